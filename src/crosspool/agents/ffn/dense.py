"""Gated dense FFN with the engine's arithmetic: gate and up in one GEMM, then the activation
in the precision the engine's execution mode uses.

Token identity with the native engine needs bitwise-equal FFN outputs. vLLM on x86 CPU
computes SiLU(gate) * up with `forward_native` in eager mode (bf16, rounded after SiLU and
after the product) while inductor fuses the same expression in fp32 in compile mode (one
rounding). The plan carries which one each Instance needs (`ActivationMath`).

Where oneDNN has a bf16 matmul for this CPU (AVX512-BF16 / AVX-NE-CONVERT), bf16 weights are
prepacked once into its blocked layout, as vLLM's `create_onednn_mm` does: the same bits as
`F.linear` for every row count (checked for M = 1..4096), but a plain row-major weight is
re-laid-out by oneDNN on every call (a one-row SmolLM2-135M FFN ran 1.6x slower). Where it has
none (AVX2-only CPUs), vLLM's `create_onednn_mm` fails too and vLLM falls back to `F.linear`,
which is what runs here then.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

ActivationMath = Literal["fp32", "dtype"]
Linear = Callable[[torch.Tensor], torch.Tensor]


def _linear(weight: torch.Tensor) -> Linear:
    if weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available():
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        except RuntimeError:  # no oneDNN bf16 matmul on this CPU (vLLM falls back to F.linear too)
            return lambda x: F.linear(x, weight)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    # fp32: oneDNN and MKL differ in the last bits; F.linear is what the plan qualifies.
    return lambda x: F.linear(x, weight)


class GatedDenseFfn:
    def __init__(
        self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, activation_math: ActivationMath
    ) -> None:
        assert gate.shape == up.shape and down.shape == (gate.shape[1], gate.shape[0])
        self.intermediate = gate.shape[0]
        self.fp32_activation = activation_math == "fp32"
        self.gate_up = _linear(torch.cat([gate, up], dim=0).contiguous())
        self.down = _linear(down.contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if self.fp32_activation:
            gate_up = gate_up.float()
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down((F.silu(gate) * up).to(x.dtype))
