"""Resources checked before they are used: /dev/shm room (a segment's pages are allocated at
creation, a deployment's segments are checked before anything starts) and checkpoints a
deployment names (a malformed config.json or a truncated safetensors file is one error line,
exit 2, before any process starts)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from crosspool.ipc import SHM_DIR, SHM_MARGIN_BYTES, SHM_PREFIX, Segment, ShmFull, shm_shortage


def test_a_segment_larger_than_dev_shm_fails_at_creation_and_leaves_nothing():
    name = f"{SHM_PREFIX}test-too-large"
    with pytest.raises(ShmFull, match="has no room for segment"):
        Segment(name, shutil.disk_usage(SHM_DIR).total + 4096, create=True)
    assert not (SHM_DIR / name).exists()


def test_the_preflight_names_the_shortage():
    free = shutil.disk_usage(SHM_DIR).free
    assert free > SHM_MARGIN_BYTES, "this host's /dev/shm is nearly full"
    assert shm_shortage(0) is None
    problem = shm_shortage(free)
    assert problem is not None and "MiB free" in problem and "\n" not in problem


def _broken(tiny: Path, tmp: Path, kind: str) -> Path:
    model = tmp / kind
    shutil.copytree(tiny, model)
    if kind == "config":
        (model / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"], "hidden_size": ')
    else:
        weights = model / "model.safetensors"
        with weights.open("r+b") as f:
            f.truncate(weights.stat().st_size // 2)
    deployment = tmp / f"{kind}.toml"
    deployment.write_text(f'[[model]]\nid = "m"\npath = "{model}"\nengine = "vllm"\n')
    return deployment


@pytest.mark.parametrize("kind", ["config", "truncated"])
@pytest.mark.parametrize("command", ["config check", "daemon"])
def test_a_broken_checkpoint_is_one_error_line_and_exit_2(tiny_models, tmp_path, kind, command):
    deployment = _broken(tiny_models["qwen3"], tmp_path, kind)
    done = subprocess.run(
        [sys.executable, "-m", "crosspool", *command.split(), str(deployment)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("crosspool: error:"), done.stderr
    assert ("config.json is not readable JSON" if kind == "config" else "not a complete safetensors file") in lines[0]
