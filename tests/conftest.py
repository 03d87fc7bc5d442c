"""Shared fixtures: tiny checkpoints (fixed seed), the real SmolLM2 checkpoint, leak checks."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from crosspool.ipc import SHM_DIR, SHM_PREFIX

CACHE = Path(os.environ.get("CROSSPOOL_CACHE", Path.home() / ".cache" / "crosspool"))


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, Path]:
    from crosspool.models.prepare import make_tiny_checkpoint

    root = CACHE / "tiny"
    return {f: make_tiny_checkpoint(f, root / f"tiny-{f}", seed=0) for f in ("qwen3", "llama")}


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from crosspool.models.prepare import prepare_smollm2

    return prepare_smollm2()


def crosspool_shm() -> set[str]:
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(SHM_PREFIX)}


def project_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    mine = str(os.getpid())
    return [
        line
        for line in out.splitlines()[1:]
        if (
            "crosspool.agents" in line
            or "vllm.entrypoints" in line
            or "VLLM::" in line
            or "crosspool.integrations.vllm.offline" in line
        )
        and line.split()[0] != mine
    ]


@pytest.fixture
def no_leftovers():
    """Fails the test if it leaves a CrossPool shm segment or a project process behind."""
    before = crosspool_shm()
    yield
    import time

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (crosspool_shm() - before or project_processes()):
        time.sleep(0.2)
    assert crosspool_shm() - before == set(), "shared memory left behind"
    assert project_processes() == [], "processes left behind"
