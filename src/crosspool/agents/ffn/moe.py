"""MoE FFN with the engine's arithmetic: the engine's router and fused-experts kernel, then the
routed scaling factor and the shared experts combined as the engine combines them.

vLLM on CPU scales the kernel's output (not the router weights) and adds the shared experts'
output after it; in eager mode each step rounds to the model dtype, while inductor fuses the
combination in fp32 in compile mode (`ActivationMath`, as for dense FFNs).
"""

from __future__ import annotations

import torch

from crosspool.agents.ffn.dense import GatedDenseFfn
from crosspool.kernels import MoeKernel
from crosspool.models.spec import ActivationMath


class RoutedMoeFfn:
    def __init__(
        self, kernel: MoeKernel, shared: GatedDenseFfn | None, routed_scaling_factor: float, math: ActivationMath
    ) -> None:
        self.kernel = kernel
        self.shared = shared
        self.scale = routed_scaling_factor
        self.fp32 = math == "fp32"

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The MoE FFN of `x`, written into `out` when given."""
        routed = self.kernel(x)
        if self.fp32:
            total = routed.float() * self.scale if self.scale != 1.0 else routed.float()
            if self.shared:
                total += self.shared(x).float()
            return total.to(x.dtype) if out is None else out.copy_(total)
        if self.scale != 1.0:
            routed *= self.scale
        if self.shared:
            return torch.add(self.shared(x), routed, out=out) if out is not None else self.shared(x) + routed
        return routed if out is None else out.copy_(routed)
