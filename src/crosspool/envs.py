"""The environment variables CrossPool reads or sets, each named once."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

CACHE = "CROSSPOOL_CACHE"
"""Root of CrossPool's files on this host: prepared models, tiny checkpoints, engine compile caches."""
PLAN = "CROSSPOOL_PLAN"
"""Set by CrossPool in an engine's environment: the generation's plan file (the plugins stay inert without it)."""
MODEL = "CROSSPOOL_MODEL"
"""Set with PLAN: the model id this engine serves."""
SUPERVISOR_PID = "CROSSPOOL_SUPERVISOR_PID"
"""Set in every member's environment: the pid of the daemon that started it."""


def sharing_cores(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a process that shares CPU cores with other CrossPool processes (agents, engines):
    OpenMP threads sleep when idle unless `env` says otherwise. libgomp's threads spin after every
    parallel region by default and take the core the next process on the call path needs: two
    vLLM engines side by side on 2 cores took 110 ms a decode step instead of 7 (same tokens), a
    one-row call to a tiny Qwen3 layer p50 2.9 ms instead of 0.33 ms."""
    return {"OMP_WAIT_POLICY": "PASSIVE", **env}


def cache_root() -> Path:
    return Path(os.environ.get(CACHE) or Path.home() / ".cache" / "crosspool")
