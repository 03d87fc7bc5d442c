"""vLLM's prefill context-parallel row split, computed by the engine's own PCP manager
(`v1/worker/gpu/pcp_manager.py`; docs/context-parallel.md): which rows of a scheduled batch each
PCP rank holds, as the RowShares its layer calls would carry."""

from __future__ import annotations

import numpy as np

from crosspool.transport.mailbox import RowShare


def prefill_cp_shares(
    pcp_size: int, query_lens: list[int], prefilling: list[bool], shard_decodes: bool = False
) -> list[RowShare]:
    """Per PCP rank, its rows of a batch of requests with `query_lens` scheduled tokens: a prefill
    long enough is split into 2 x pcp_size chunks (rank r gets chunks r and 2 pcp_size - 1 - r);
    a decode is on every rank (or, with `shard_decodes`, on one). A row several ranks hold is
    sent by the lowest of them and returned to all."""
    import torch
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    lens = np.asarray(query_lens, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)])
    total = int(starts[-1])
    sent = np.zeros(total, dtype=bool)
    shares = []
    for rank in range(pcp_size):
        manager = PCPManager(pcp_size, rank, torch.device("cpu"), shard_decodes)
        segments = manager._get_rank_segments(rank, lens, np.asarray(prefilling, dtype=np.bool_), starts)
        rows = np.zeros(sum(s.num_tokens for s in segments), dtype=np.int64)
        for s in segments:
            rows[s.rank_local_batch_slice] = np.arange(s.global_batch_slice.start, s.global_batch_slice.stop)
        owned = ~sent[rows]
        sent[rows] = True
        shares.append(RowShare.of(rows, total, owned))
    return shares
