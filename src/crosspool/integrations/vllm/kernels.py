"""The linear kernels vLLM's CPU worker uses, for the FFN pool to compute what the engine computes.

vLLM picks a GEMM per weight and CPU (`dispatch_cpu_unquantized_gemm`: zentorch, AMX sgl-kernel,
a prepacked oneDNN handler, or `F.linear`). The pool asks vLLM itself, so its results are the
engine's bit for bit on every CPU, and as fast: on an AVX2 EPYC, vLLM's oneDNN handler ran a
16-row fp32 SmolLM2 FFN in 2.5 ms where torch's own oneDNN path took 3.9 ms for the same bits.
This is the FfnAgent's one, bounded dependency on the engine: a callable over tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def linear(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """`x -> x @ weight.T` as vLLM's CPU linear layers compute it (`weight` is [out, in])."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layer = nn.Module()
    layer.weight = nn.Parameter(weight, requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    kernel: Callable[..., torch.Tensor] = layer.cpu_linear  # type: ignore[assignment]
    kept = layer.weight
    return lambda x: kernel(x, kept, None)
