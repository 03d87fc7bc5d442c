"""How an engine integration refuses what CrossPool cannot serve: one table per engine of
unsupported arguments (value that is fine, reason) and of arguments CrossPool sets itself."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Unsupported = Mapping[str, tuple[Any, str]]


def engine_arg_problems(
    engine_args: Mapping[str, Any], unsupported: Unsupported, owned: Mapping[str, str]
) -> list[str]:
    """One line per refused `engine_args` entry of a deployment file (field and value named)."""
    problems = []
    for name, value in engine_args.items():
        key = name.replace("-", "_")
        if key in owned:
            problems.append(f"engine_args.{name}: set by CrossPool from {owned[key]} (got {value!r})")
        elif key in unsupported and value != unsupported[key][0]:
            problems.append(f"engine_args.{name}: not supported with CrossPool: {unsupported[key][1]} (got {value!r})")
    return problems


def runtime_problems(seen: Mapping[str, Any], unsupported: Unsupported) -> list[str]:
    """What a running engine resolved that CrossPool refuses (checked in the engine's processes)."""
    return [f"{k}={v!r}: {unsupported[k][1]}" for k, v in seen.items() if v != unsupported[k][0]]
