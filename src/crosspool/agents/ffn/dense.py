"""Gated dense FFN with the engine's arithmetic: gate and up in one GEMM, then the activation
in the precision the engine's execution mode uses.

Token identity with the native engine needs bitwise-equal FFN outputs. vLLM on x86 CPU
computes SiLU(gate) * up with `forward_native` in eager mode (bf16, rounded after SiLU and
after the product) while inductor fuses the same expression in fp32 in compile mode (one
rounding). The plan carries which one each Instance needs (`ActivationMath`).

The linear kernels come from the Instance's engine integration (`integrations.kernels`), so
each GEMM is the one the engine itself would run on this CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from crosspool.kernels import Linear, LinearFactory
from crosspool.models.spec import ActivationMath


class GatedDenseFfn:
    def __init__(
        self,
        gate: torch.Tensor,
        up: torch.Tensor,
        down: torch.Tensor,
        activation_math: ActivationMath,
        linear: LinearFactory,
        fuse_gate_up: bool = True,
    ) -> None:
        assert gate.shape == up.shape and down.shape == (gate.shape[1], gate.shape[0])
        self.intermediate = gate.shape[0]
        self.fp32_activation = activation_math == "fp32"
        # Two GEMMs where the engine runs them apart: a GPU GEMM's reduction order can depend on N.
        self.gate_up = linear(torch.cat([gate, up], dim=0).contiguous()) if fuse_gate_up else None
        self.gate: Linear | None = None if fuse_gate_up else linear(gate.contiguous())
        self.up: Linear | None = None if fuse_gate_up else linear(up.contiguous())
        self.down = linear(down.contiguous())

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The FFN of `x`, written into `out` when given (the down GEMM writes it directly)."""
        if self.gate_up is not None:
            gate, up = self.gate_up(x).split(self.intermediate, dim=-1)
        else:
            assert self.gate is not None and self.up is not None
            gate, up = self.gate(x), self.up(x)
        if self.fp32_activation:
            gate, up = gate.float(), up.float()
        return self.down((F.silu(gate) * up).to(x.dtype), out)
