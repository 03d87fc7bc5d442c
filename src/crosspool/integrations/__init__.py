"""Engine integrations: the only packages that import an engine (one subpackage per engine)."""

from __future__ import annotations

import importlib
from types import ModuleType

ENGINES = ("vllm",)


def launcher(engine: str) -> ModuleType:
    """The engine's launch module (builds its server command; imports no engine itself)."""
    assert engine in ENGINES, engine
    return importlib.import_module(f"crosspool.integrations.{engine}.launch")


def kernels(engine: str) -> ModuleType:
    """The engine's kernel module: `linear(weight)` computes as the engine's own layers do.
    Importing the engine happens when a kernel is first built, in the FfnAgent only."""
    assert engine in ENGINES, engine
    return importlib.import_module(f"crosspool.integrations.{engine}.kernels")
