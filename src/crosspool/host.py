"""The host a measurement ran on, for every evidence file: the CPU model and the instruction-set
flags that decide which kernels the engines pick (vLLM's AVX2 / AVX-512 / AVX512-BF16+AMX builds,
SGLang's AMX path)."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def describe() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.machine())
    flags = next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())
    import torch

    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "cpu_flags": [f for f in KERNEL_FLAGS if f in flags],
        "torch": torch.__version__,
    }
