"""The linear kernel SGLang's CPU model runner uses, for the FFN pool to compute what SGLang computes.

On x86 without AMX, SGLang's `UnquantizedLinearMethod.apply` is `F.linear` (srt/layers/
quantization/unquant.py); with AMX it packs weights for sgl_kernel's `weight_packed_linear`,
which the pool does not reproduce, so it refuses to build kernels there."""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import torch
import torch.nn.functional as F


def linear(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """`x -> x @ weight.T` as SGLang's CPU linear layers compute it (`weight` is [out, in])."""
    from sglang.srt.utils.common import cpu_has_amx_support

    if cpu_has_amx_support():
        raise NotImplementedError(
            "SGLang on this AMX CPU computes linears with sgl_kernel's packed GEMM, which the CrossPool "
            "FFN pool does not reproduce; serve this model through vLLM"
        )
    return lambda x: F.linear(x, weight)


def moe(*args: object) -> NoReturn:
    raise NotImplementedError("MoE families are not served through SGLang with CrossPool (the plan refuses them)")
