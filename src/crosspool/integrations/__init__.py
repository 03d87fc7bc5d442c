"""Engine integrations: the only packages that import an engine (one subpackage per engine)."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

ENGINES = ("vllm", "sglang")


def launcher(engine: str) -> ModuleType:
    """The engine's launch module (builds its server command; imports no engine itself)."""
    assert engine in ENGINES, engine
    return importlib.import_module(f"crosspool.integrations.{engine}.launch")


def kernels(engine: str) -> ModuleType:
    """The engine's kernel module: `linear(weight)` computes as the engine's own layers do.
    Importing the engine happens when a kernel is first built, in the FfnAgent only."""
    assert engine in ENGINES, engine
    return importlib.import_module(f"crosspool.integrations.{engine}.kernels")


def serves(engine: str, architecture: str) -> bool:
    """Whether CrossPool serves this model architecture through `engine`."""
    architectures = launcher(engine).ARCHITECTURES  # None: every family in crosspool.models
    return architectures is None or architecture in architectures


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
