"""MoE FFN with the engine's arithmetic: the engine's router and fused-experts kernel, then the
routed scaling factor and the shared experts combined as the engine combines them.

vLLM on CPU scales the kernel's output (not the router weights) and adds the shared experts'
output after it; in eager mode each step rounds to the model dtype, while inductor fuses the
combination in fp32 in compile mode (`ActivationMath`, as for dense FFNs).
"""

from __future__ import annotations

from typing import Protocol

import torch

from crosspool.agents.ffn.dense import GatedDenseFfn
from crosspool.models.spec import ActivationMath


class MoeKernel(Protocol):
    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The router GEMM as the engine computes it (the logits it routes on)."""
        ...

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token the top-k router weights (fp32) and expert ids (int32), in the engine's order."""
        ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum, before routed scaling and shared experts."""
        ...


class RoutedMoeFfn:
    def __init__(
        self, kernel: MoeKernel, shared: GatedDenseFfn | None, routed_scaling_factor: float, math: ActivationMath
    ) -> None:
        self.kernel = kernel
        self.shared = shared
        self.scale = routed_scaling_factor
        self.fp32 = math == "fp32"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.kernel(x)
        if self.fp32:
            out = routed.float() * self.scale if self.scale != 1.0 else routed.float()
            return (out + self.shared(x).float() if self.shared else out).to(x.dtype)
        if self.scale != 1.0:
            routed *= self.scale
        return self.shared(x) + routed if self.shared else routed
