"""The linear and MoE kernels vLLM's CPU worker uses, for the FFN pool to compute what the engine computes.

vLLM picks a GEMM per weight and CPU (`dispatch_cpu_unquantized_gemm`: zentorch, AMX sgl-kernel,
a prepacked oneDNN handler, or `F.linear`). The pool asks vLLM itself, so its results are the
engine's bit for bit on every CPU, and as fast: on an AVX2 EPYC, vLLM's oneDNN handler ran a
16-row fp32 SmolLM2 FFN in 2.5 ms where torch's own oneDNN path took 3.9 ms for the same bits.
This is the FfnAgent's one, bounded dependency on the engine: callables over tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from crosspool.kernels import Linear
from crosspool.models.spec import MoeRouting


def linear(weight: torch.Tensor) -> Linear:
    """`x -> x @ weight.T` as vLLM's CPU linear layers compute it (`weight` is [out, in]), able to
    write into a given output: vLLM's own oneDNN and packed kernels take their output buffer
    (`torch.ops._C.onednn_mm`, `weight_packed_linear`), so the FfnAgent's down GEMM writes the
    mailbox's output plane directly; other kernels' results are copied there."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layer = nn.Module()
    layer.weight = nn.Parameter(weight, requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    kernel: Callable[..., torch.Tensor] = layer.cpu_linear  # type: ignore[assignment]
    kept = layer.weight
    # The dispatch returns a closure over what it prepared; its variables say which kernel it chose.
    chosen = dict(zip(kernel.__code__.co_freevars, (c.cell_contents for c in kernel.__closure__ or ()), strict=True))
    n = weight.shape[0]
    if "handler" in chosen:
        handler = chosen["handler"]  # its destructor releases the oneDNN primitive: kept by the closure
        onednn_mm = torch.ops._C.onednn_mm

        def run_onednn(x: torch.Tensor, out: torch.Tensor | None = None, /) -> torch.Tensor:
            out = x.new_empty(x.shape[0], n) if out is None else out
            onednn_mm(out, x, None, handler.handler_tensor)
            return out

        return run_onednn
    if "packed_weight" in chosen:
        packed = chosen["packed_weight"]
        packed_linear = torch.ops._C.weight_packed_linear

        def run_packed(x: torch.Tensor, out: torch.Tensor | None = None, /) -> torch.Tensor:
            out = x.new_empty(x.shape[0], n) if out is None else out
            packed_linear(out, x, packed, None, True)
            return out

        return run_packed

    def run(x: torch.Tensor, out: torch.Tensor | None = None, /) -> torch.Tensor:
        y = kernel(x, kept, None)
        return y if out is None else out.copy_(y)

    return run


def moe_experts(experts: int, hidden: int, intermediate: int, top_k: int, dtype: torch.dtype) -> Any:
    """The experts kernel vLLM's MoE layer gets for this shape on this CPU: its config as the
    layer builds it (unquantized, SiLU-gated, no EP: one FFN shard is a whole layer to vLLM) and
    the class its oracle selects (`select_unquantized_moe_backend`: the AMX kernel for bf16 on
    x86 with AMX, the portable "vec" kernel otherwise), constructed but not yet given weights."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FUSED_MOE_UNQUANTIZED_CONFIG,
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExpertsModular
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import select_unquantized_moe_backend

    config = FusedMoEConfig(
        num_experts=experts,
        experts_per_token=top_k,
        hidden_dim=hidden,
        intermediate_size=intermediate,
        num_local_experts=experts,
        num_logical_experts=experts,
        activation=MoEActivation.SILU,
        device="cpu",
        routing_method=RoutingMethodType.Unspecified,  # CPU experts take any: routing runs in CPURouter
        moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=dtype,
    )
    _, experts_cls = select_unquantized_moe_backend(config)
    assert experts_cls is not None
    kernel = experts_cls(config, FUSED_MOE_UNQUANTIZED_CONFIG)
    assert isinstance(kernel, FusedMoEExpertsModular), experts_cls  # vLLM's CPU experts are
    return kernel


class FusedMoe:
    """vLLM's CPU MoE path, as its MoE layer runs it: the gate GEMM in the model dtype (on CPU
    vLLM's `GateLinear` computes router logits in the weight's dtype), `CPURouter`'s routing, and
    the experts kernel of `moe_experts` with that kernel's own intermediate padding and weight
    prepacking."""

    def __init__(
        self,
        router: torch.Tensor,
        bias: torch.Tensor | None,
        w13: torch.Tensor,
        w2: torch.Tensor,
        routing: MoeRouting,
    ) -> None:
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

        experts, hidden, inter = w2.shape
        self.experts = moe_experts(experts, hidden, inter, routing.top_k, w13.dtype)
        self.weights = nn.Module()
        self.weights.w13_weight = nn.Parameter(w13.contiguous(), requires_grad=False)
        self.weights.w2_weight = nn.Parameter(w2.contiguous(), requires_grad=False)
        self.experts.process_weights_after_loading(self.weights)  # pads and prepacks as vLLM does
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
        self.num_experts = experts
        self.silu = MoEActivation.SILU

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.router._compute_routing(x, self.gate(x), None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = torch.empty_like(x)
        w13, w2 = self.weights.w13_weight, self.weights.w2_weight
        assert isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)
        # CPU experts keep their own scratch space (workspace shapes of 0) and write `out` whole.
        self.experts.apply(
            out, x, w13, w2, weights, ids, self.silu, self.num_experts,
            None, None, None, x.new_empty(0), x.new_empty(0), None, False,
        )  # fmt: skip
        return out


moe = FusedMoe
