"""The linear kernel SGLang's CPU model runner uses, for the FFN pool to compute what SGLang computes.

On x86 without AMX, SGLang's `UnquantizedLinearMethod.apply` is `F.linear` (srt/layers/
quantization/unquant.py); with AMX it packs weights for sgl_kernel's `weight_packed_linear`,
which the pool does not reproduce, so it refuses to build kernels there."""

from __future__ import annotations

from typing import NoReturn

import torch

from crosspool.kernels import Linear, plain_linear


def linear(weight: torch.Tensor) -> Linear:
    """`x -> x @ weight.T` as SGLang's CPU linear layers compute it (`weight` is [out, in])."""
    from sglang.srt.utils.common import cpu_has_amx_support

    if cpu_has_amx_support():
        raise NotImplementedError(
            "SGLang on this AMX CPU computes linears with sgl_kernel's packed GEMM, which the CrossPool "
            "FFN pool does not reproduce; serve this model through vLLM"
        )
    return plain_linear(weight)


def moe(*args: object) -> NoReturn:
    raise NotImplementedError("MoE families are not served through SGLang with CrossPool (the plan refuses them)")
