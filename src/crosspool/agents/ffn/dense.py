"""Gated dense FFN with the engine's arithmetic: gate and up in one GEMM, then the activation
in the precision the engine's execution mode uses.

Token identity with the native engine needs bitwise-equal FFN outputs. vLLM on x86 CPU
computes SiLU(gate) * up with `forward_native` in eager mode (bf16, rounded after SiLU and
after the product) while inductor fuses the same expression in fp32 in compile mode (one
rounding). The plan carries which one each Instance needs (`ActivationMath`).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

ActivationMath = Literal["fp32", "dtype"]


class GatedDenseFfn:
    def __init__(
        self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, activation_math: ActivationMath
    ) -> None:
        assert gate.shape == up.shape and down.shape == (gate.shape[1], gate.shape[0])
        self.intermediate = gate.shape[0]
        self.fp32_activation = activation_math == "fp32"
        self.gate_up = torch.cat([gate, up], dim=0).contiguous()
        self.down = down.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(x, self.gate_up)
        if self.fp32_activation:
            gate_up = gate_up.float()
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return F.linear((F.silu(gate) * up).to(x.dtype), self.down)
