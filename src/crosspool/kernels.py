"""The contract between the FFN pool and an engine integration's kernels: what an FfnAgent calls
to compute a layer exactly as the engine would (`integrations.kernels(engine)` returns a module
that is an `EngineKernels`). Engine-neutral: the integrations implement it, the agents use it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from crosspool.models.spec import MoeRouting


class Linear(Protocol):
    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None, /) -> torch.Tensor:
        """x @ weight.T, written into `out` when given (contiguous, [rows, out features]) and returned."""
        ...


LinearFactory = Callable[[torch.Tensor], Linear]
"""weight [out, in] -> the kernel computing x @ weight.T"""


def plain_linear(weight: torch.Tensor) -> Linear:
    """`F.linear`: the kernel of engines that compute their linears with plain torch on this CPU,
    and of the GPU lanes. On CUDA, `F.linear` of a 2D input without bias is `mm(x, weight.T)`,
    one cuBLAS call, which can write `out` directly; on CPU the result is copied (F.linear may
    take another kernel there than mm)."""
    transposed = weight.t()

    def run(x: torch.Tensor, out: torch.Tensor | None = None, /) -> torch.Tensor:
        if out is not None and x.is_cuda:
            return torch.mm(x, transposed, out=out)
        y = F.linear(x, weight)
        return y if out is None else out.copy_(y)

    return run


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


class EngineKernels(Protocol):
    """An engine integration's kernel module: `moe` takes router [E, H], correction bias [E] or
    None, w13 [E, 2I, H] (gate rows first), w2 [E, H, I]."""

    def linear(self, weight: torch.Tensor, /) -> Linear: ...

    def moe(
        self,
        router: torch.Tensor,
        bias: torch.Tensor | None,
        w13: torch.Tensor,
        w2: torch.Tensor,
        routing: MoeRouting,
        /,
    ) -> MoeKernel: ...


if TYPE_CHECKING:  # mypy checks that each integration's kernel module is an EngineKernels
    from crosspool.integrations.sglang import kernels as _sglang_kernels
    from crosspool.integrations.vllm import kernels as _vllm_kernels

    _KERNELS: tuple[EngineKernels, ...] = (_vllm_kernels, _sglang_kernels)
