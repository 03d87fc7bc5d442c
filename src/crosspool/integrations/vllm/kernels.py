"""The linear and MoE kernels vLLM's CPU worker uses, for the FFN pool to compute what the engine computes.

vLLM picks a GEMM per weight and CPU (`dispatch_cpu_unquantized_gemm`: zentorch, AMX sgl-kernel,
a prepacked oneDNN handler, or `F.linear`). The pool asks vLLM itself, so its results are the
engine's bit for bit on every CPU, and as fast: on an AVX2 EPYC, vLLM's oneDNN handler ran a
16-row fp32 SmolLM2 FFN in 2.5 ms where torch's own oneDNN path took 3.9 ms for the same bits.
This is the FfnAgent's one, bounded dependency on the engine: callables over tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from crosspool.models.spec import MoeRouting


def linear(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """`x -> x @ weight.T` as vLLM's CPU linear layers compute it (`weight` is [out, in])."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layer = nn.Module()
    layer.weight = nn.Parameter(weight, requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    kernel: Callable[..., torch.Tensor] = layer.cpu_linear  # type: ignore[assignment]
    kept = layer.weight
    return lambda x: kernel(x, kept, None)


class FusedMoe:
    """vLLM's CPU MoE path: the gate GEMM, `CPURouter`'s routing and `cpu_fused_moe` on
    prepacked expert weights (the "vec" kernel vLLM selects on x86 without AMX). One deliberate
    difference: where the family's reference routes on fp32 logits (DeepSeek), so does this,
    while vLLM 0.32's CPU gate returns bf16 logits (expert choices differ on near-ties)."""

    ISA = "vec"
    ALIGN = 32  # vLLM pads the expert intermediate dimension to a multiple of this

    def __init__(
        self,
        router: torch.Tensor,
        bias: torch.Tensor | None,
        w13: torch.Tensor,
        w2: torch.Tensor,
        routing: MoeRouting,
    ) -> None:
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

        amx = torch.cpu._is_amx_tile_supported()
        if amx and w13.dtype == torch.bfloat16:
            raise NotImplementedError(
                "vLLM runs bf16 MoE with its AMX kernel on this CPU; CrossPool's FFN pool has only "
                "qualified the 'vec' kernel (x86 without AMX)"
            )
        experts, hidden = w2.shape[0], w2.shape[1]
        if hidden % self.ALIGN:
            raise ValueError(f"vLLM's CPU MoE kernel needs a hidden size divisible by {self.ALIGN}, got {hidden}")
        if routing.router_fp32:  # the family's own router arithmetic (vLLM would route on bf16 logits)
            router32 = router.float()
            self.gate: Callable[[torch.Tensor], torch.Tensor] = lambda x: F.linear(x.float(), router32)
        else:
            self.gate = linear(router)
        # vLLM's router applies the routed scaling factor after the kernel on CPU (not to the weights).
        self.router = CPURouter(
            top_k=routing.top_k,
            global_num_experts=experts,
            use_grouped_topk=routing.grouped,
            num_expert_group=routing.n_group,
            topk_group=routing.topk_group,
            renormalize=routing.renormalize,
            scoring_func=routing.scoring,
            e_score_correction_bias=bias,
        )
        inter = w2.shape[2]
        padded = -(-inter // self.ALIGN) * self.ALIGN
        if padded != inter:  # zero rows/columns, as vLLM's _pad_moe_intermediate: results unchanged
            w13p = w13.new_zeros(experts, 2 * padded, hidden)
            w13p[:, :inter], w13p[:, padded : padded + inter] = w13[:, :inter], w13[:, inter:]
            w2p = w2.new_zeros(experts, hidden, padded)
            w2p[:, :, :inter] = w2
            w13, w2 = w13p, w2p
        self.w13 = cpu_prepack_moe_weight(w13.contiguous(), self.ISA)
        self.w2 = cpu_prepack_moe_weight(w2.contiguous(), self.ISA)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.router._compute_routing(x, self.gate(x), None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from vllm._custom_ops import cpu_fused_moe

        weights, ids = self.route(x)
        out = torch.empty_like(x)
        cpu_fused_moe(out, x, self.w13, self.w2, None, None, weights, ids, "silu", self.ISA)
        return out


moe = FusedMoe
