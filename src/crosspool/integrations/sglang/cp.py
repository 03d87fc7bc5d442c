"""SGLang's prefill context-parallel row split, computed by the engine's own strategies
(`layers/cp/zigzag.py`, `layers/cp/interleave.py`; docs/context-parallel.md): which rows of a
prefill batch each CP rank holds, as the RowShares its layer calls would carry."""

from __future__ import annotations

from types import SimpleNamespace

from crosspool.transport.mailbox import RowShare

STRATEGIES = ("zigzag", "interleave")


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
