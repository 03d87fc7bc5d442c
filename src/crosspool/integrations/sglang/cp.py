"""SGLang prefill context parallelism (docs/context-parallel.md): the row split of the engine's own
strategies (`layers/cp/zigzag.py`, `layers/cp/interleave.py`) as RowShares, and the zigzag
attention SGLang's torch_native backend lacks, which CrossPool supplies to serve CP on CPU."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from crosspool.transport.mailbox import RowShare

CP_SPLIT = "zigzag prefill CP through CrossPool's torch_native attention"
"""What each CP rank logs at its first split batch: the evidence that SGLang split one."""


def prefill_cp_shares(strategy: str, cp_size: int, extend_lens: list[int]) -> list[RowShare] | None:
    """Per CP rank, its rows of a batch of prefills `extend_lens` long (local order, each row sent
    by the one rank that holds it); None where the engine runs the batch without CP (zigzag: a
    prefill shorter than 2 x cp_size rows)."""
    from sglang.srt.layers.cp.interleave import InterleaveCPStrategy
    from sglang.srt.layers.cp.zigzag import ZigzagCPStrategy
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    kind = {"zigzag": ZigzagCPStrategy, "interleave": InterleaveCPStrategy}[strategy]
    total = sum(extend_lens)
    shares = []
    for rank in range(cp_size):
        # The engine reads its CP rank from its process-wide parallel state; a subclass names it.
        ranked = type(kind.__name__, (kind,), {"cp_rank": rank})(cp_size)
        batch = SimpleNamespace(forward_mode=ForwardMode.EXTEND, extend_seq_lens_cpu=extend_lens, input_ids=None)
        if not ranked.can_apply(total, batch):
            return None
        batch.attn_cp_metadata = ranked.build_metadata(total, extend_lens, extend_lens)
        shares.append(RowShare.of(ranked.local_q_indices(total, batch).numpy(), total))
    return shares


def install_torch_native_prefill_cp() -> None:
    """Zigzag prefill CP for SGLang's torch_native attention, which has no CP hooks (its
    forward_extend writes the rank's local K/V at the batch's full cache locations and fails).
    What FlashAttention does under zigzag (`flashattention_backend.py`, `layers/cp/zigzag.py`),
    with the engine's own pieces: `materialize_full_kv` all-gathers K/V over the CP group and
    writes the whole batch's K/V on every rank; then each of the rank's two query blocks per
    sequence attends causally to the KV before and up to it (`kv_len_prev` / `kv_len_next`), as an
    extend of that length. Pad rows (ranks hold up to `max_rank_len`) are zero. Batches the
    strategy does not split (decode, short prefills) run the backend's own path."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.cp.base import ContextParallelStrategyKind, get_cp_strategy

    native = TorchNativeAttnBackend.forward_extend
    if getattr(native, "crosspool_cp", False):
        return
    announced: list[bool] = []

    def forward_extend(
        self: TorchNativeAttnBackend,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Any,
        forward_batch: Any,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        meta = forward_batch.attn_cp_metadata
        if meta is None:
            return native(self, q, k, v, layer, forward_batch, save_kv_cache)
        strategy = get_cp_strategy()
        assert strategy is not None and strategy.kind == ContextParallelStrategyKind.ZIGZAG, strategy
        if not announced:
            announced.append(True)  # once per rank: the evidence that a batch was split
            # one write: the ranks share the engine's output pipe
            sys.stderr.write(f"crosspool: CP rank {strategy.cp_rank} of {strategy.cp_size}: {CP_SPLIT}\n")
            sys.stderr.flush()
        assert not layer.is_cross_attention and save_kv_cache and k is not None and v is not None
        strategy.materialize_full_kv(forward_batch, layer, k, v)
        q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o = q.new_zeros((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        o_ = o.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        start = 0
        for q_lens, kv_lens in (
            (meta.actual_seq_q_prev_tensor, meta.kv_len_prev_tensor),
            (meta.actual_seq_q_next_tensor, meta.kv_len_next_tensor),
        ):
            end = start + int(q_lens.sum())
            self._run_sdpa_forward_extend(
                q_[start:end],
                o_[start:end],
                self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                self.token_to_kv_pool.get_value_buffer(layer.layer_id),
                self.req_to_token_pool.req_to_token,
                forward_batch.req_pool_indices,
                kv_lens,
                kv_lens - q_lens,
                q_lens,
                None,
                scaling=layer.scaling,
                enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
                causal=True,
            )
            start = end
        return o

    forward_extend.crosspool_cp = True  # type: ignore[attr-defined]
    TorchNativeAttnBackend.forward_extend = forward_extend  # type: ignore[method-assign]
    _cpu_stream_for_eager_runner()


class _NoCudaStream(ModuleType):
    """torch for SGLang's eager runner, whose CP path asks `torch.cuda.current_stream()` (a CPU
    build raises) only to hand it to the strategy's gather, which zigzag ignores."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.__dict__.update(torch.__dict__)
        self.cuda = SimpleNamespace(**{**vars(torch.cuda), "current_stream": lambda device=None: None})


def _cpu_stream_for_eager_runner() -> None:
    from sglang.srt.model_executor.runner import eager_runner

    eager_runner.torch = _NoCudaStream()  # type: ignore[attr-defined]
