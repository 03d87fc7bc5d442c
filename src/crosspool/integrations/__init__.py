"""Engine integrations: the only packages that import an engine (one subpackage per engine)."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, cast

from crosspool.config import ModelConfig
from crosspool.models.spec import ActivationMath

ENGINES = ("vllm", "sglang")


class EngineLauncher(Protocol):
    """What the core knows of an engine without importing it: `integrations.<engine>.launch`."""

    ENGINE: str
    VERSION: str
    ARCHITECTURES: tuple[str, ...] | None
    """The architectures CrossPool serves through this engine; None: every family in crosspool.models."""
    LIVENESS_PATH: str
    """What the daemon asks every second while the engine serves: its HTTP server answers 200 without
    work for the engine's scheduler."""

    def host_problems(self) -> list[str]:
        """Why the engine's CPU path on this host is not one the FFN pool reproduces (empty: it is)."""
        ...

    def model_problems(self, model: ModelConfig, /) -> list[str]:
        """What of this model's configuration the engine cannot serve with CrossPool, a line each
        (`field: reason (got value)`), checked before any process starts."""
        ...

    def activation_math(self, model: ModelConfig, /) -> ActivationMath:
        """How the engine's execution mode rounds the FFN activation (the pool must do the same)."""
        ...

    def engine_env(self, model: ModelConfig, plan_path: Path | None, rank_cpus: list[list[int]], /) -> dict[str, str]:
        """The engine process's environment, its ranks bound to `rank_cpus` (one list per rank, in
        dp_rank * attention_tp + tp_rank order); `plan_path` None runs the engine natively."""
        ...

    def server_command(self, model: ModelConfig, max_batched_tokens: int, host: str, port: int, /) -> list[str]:
        """argv of the engine's OpenAI-compatible server for this model."""
        ...


if TYPE_CHECKING:  # mypy checks that each launch module is an EngineLauncher
    from crosspool.integrations.sglang import launch as _sglang_launch
    from crosspool.integrations.vllm import launch as _vllm_launch

    _LAUNCHERS: tuple[EngineLauncher, ...] = (_vllm_launch, _sglang_launch)


def launcher(engine: str) -> EngineLauncher:
    """The engine's launch module (builds its server command; imports no engine itself)."""
    assert engine in ENGINES, engine
    return cast(EngineLauncher, importlib.import_module(f"crosspool.integrations.{engine}.launch"))


def kernels(engine: str) -> ModuleType:
    """The engine's kernel module, a `crosspool.kernels.EngineKernels`: `linear(weight)` and
    `moe(...)` compute as the engine's own layers do. The engine is imported when a kernel is
    first built, in the FfnAgent (and qualify) only."""
    assert engine in ENGINES, engine
    return importlib.import_module(f"crosspool.integrations.{engine}.kernels")


def serves(engine: str, architecture: str) -> bool:
    """Whether CrossPool serves this model architecture through `engine`."""
    architectures = launcher(engine).ARCHITECTURES
    return architectures is None or architecture in architectures


def threads_bind(rank_cpus: list[list[int]]) -> str:
    """Rank CPUs in the form both engines' bind variables take: "0,1|2,3" (a rank's CPUs, ranks by |)."""
    return "|".join(",".join(map(str, cpus)) for cpus in rank_cpus)


def command_flags(kwargs: dict[str, Any]) -> list[str]:
    """Engine arguments as server command-line flags: `--name value`, a bare `--name` for True,
    nothing for False or None, `--name v1 v2` for a list."""
    argv: list[str] = []
    for name, value in kwargs.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    return argv
