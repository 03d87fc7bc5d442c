"""Gated dense FFN, with the engine's arithmetic: gate and up in one matmul, activation in fp32.

vLLM merges gate/up into one GEMM and computes SiLU(gate) * up in fp32 with one rounding
(its CPU kernel in eager mode, inductor's fused kernel in compile mode); matching that
exactly is what keeps greedy tokens identical to the native engine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class GatedDenseFfn:
    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        assert gate.shape == up.shape and down.shape == (gate.shape[1], gate.shape[0])
        self.intermediate = gate.shape[0]
        self.gate_up = torch.cat([gate, up], dim=0).contiguous()
        self.down = down.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(x, self.gate_up)
        gate, up = gate_up.float().split(self.intermediate, dim=-1)
        return F.linear((F.silu(gate) * up).to(x.dtype), self.down)
