"""The Transport: one shared-memory mailbox per Instance DP rank, through which its layer calls
reach the FFN pool.

The AtnAgent of the rank's attention device creates and owns the mailbox. A call: the rank
writes its live rows into `input`, the layer, the row count and its submit time, publishes
`req_seq`, then rings the doorbell of every FfnAgent of the layer's execution group (Fabric).
Agent i of the group writes output plane i and a status and publishes its own
`resp_seq[i] == req_seq`. With one agent the rank copies plane 0 into the caller-owned tensor;
with k (FFN tensor parallelism) it adds the k partial sums in shard order in fp32 and casts once,
so the result does not depend on which agent finished first. One call is in flight per mailbox
(a rank's layer calls are serial), so the planes are reused without a ring.

With attention tensor parallelism the TP ranks of a DP rank hold the same hidden states and make
the same calls, so they share one mailbox: the first rank (the leader) publishes each call, the
others (followers) wait for the same replies, read the same output planes and acknowledge on
their own line; the leader publishes its next call only once every follower acknowledged the
previous one, so planes are never overwritten while a follower still reads them.

The control plane fences a mailbox to stop admitting FFN work: a fenced rank fails its call at
once with the fence reason, including a call already waiting.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from crosspool.fabric.inbox import Inbox
from crosspool.ipc import Segment, futex_wake, wait_word_change
from crosspool.metrics import LatencyHistogram, MemberMetrics
from crosspool.models.spec import DTYPES
from crosspool.transport.errors import (
    FfnAgentFailed,
    FfnCallRejected,
    FfnFenced,
    FfnPeerExited,
    FfnTimeout,
    RankDisagreement,
)

MAGIC = 0xC5055003
_DTYPE_CODES = {name: code for code, name in enumerate(DTYPES)}
SEQ_MASK = 0xFFFFFFFF

# u32 word indices; words written by different processes sit on different 64-byte lines.
W_MAGIC, W_MAX_ROWS, W_HIDDEN, W_DTYPE, W_OWNER_PID, W_SHARDS = 0, 1, 2, 3, 4, 5  # creator, then read-only
W_REQ_SEQ, W_LAYER, W_ROWS, W_SUBMIT_LO, W_SUBMIT_HI, W_RANK_PID = 16, 17, 18, 19, 20, 21  # the rank
W_FENCE, W_FENCE_LEN = 32, 33  # the control plane
MAX_SHARDS = 8
W_RESP_SEQ, W_STATUS, W_ERR_LEN = 48, 49, 50  # the FFN side: shard i's words are 16 * i further
MAX_TP = 4
W_ACK = 176  # attention TP follower f (1..MAX_TP-1): its ack at 16 * (f - 1) further, its pid next
FENCE_OFFSET, FENCE_CAPACITY = 1024, 1024
ERR_OFFSET, ERR_CAPACITY = 2048, 256  # shard i's error text at ERR_OFFSET + i * ERR_CAPACITY
DATA_OFFSET = 4096

STATUS_OK, STATUS_ERROR = 0, 1
PROBE_LAYER = 0xFFFFFFFF
"""A layer index no model has: the FfnAgent answers without computing (Transport+Fabric latency)."""


def mailbox_size(max_rows: int, hidden: int, dtype: str, shards: int = 1) -> int:
    return DATA_OFFSET + (1 + shards) * max_rows * hidden * DTYPES[dtype].itemsize


def resp_word(shard: int) -> int:
    return W_RESP_SEQ + 16 * shard


def ack_word(follower: int) -> int:
    assert 1 <= follower < MAX_TP, follower
    return W_ACK + 16 * (follower - 1)


class Mailbox:
    def __init__(self, seg: Segment) -> None:
        words = seg.words
        if words[W_MAGIC] != MAGIC:
            raise RuntimeError(f"mailbox {seg.name!r} is not initialised (bad magic)")
        self.seg = seg
        self.words = words
        self.max_rows, self.hidden, self.shards = words[W_MAX_ROWS], words[W_HIDDEN], words[W_SHARDS]
        self.dtype = list(DTYPES.values())[words[W_DTYPE]]
        plane = self.max_rows * self.hidden * self.dtype.itemsize
        shape = (self.max_rows, self.hidden)
        self.input = seg.tensor(DATA_OFFSET, shape, self.dtype)
        self.outputs = [seg.tensor(DATA_OFFSET + (1 + i) * plane, shape, self.dtype) for i in range(self.shards)]

    @classmethod
    def create(cls, name: str, max_rows: int, hidden: int, dtype: str, shards: int = 1) -> Mailbox:
        assert 1 <= shards <= MAX_SHARDS, shards
        seg = Segment(name, mailbox_size(max_rows, hidden, dtype, shards), create=True)
        w = seg.words
        w[W_MAX_ROWS], w[W_HIDDEN], w[W_DTYPE], w[W_SHARDS] = max_rows, hidden, _DTYPE_CODES[dtype], shards
        w[W_OWNER_PID] = os.getpid()
        w[W_MAGIC] = MAGIC
        return cls(seg)

    @classmethod
    def open(cls, name: str) -> Mailbox:
        return cls(Segment(name, 0, create=False))

    @property
    def name(self) -> str:
        return self.seg.name

    def rank_attached(self) -> bool:
        return self.words[W_RANK_PID] != 0

    def submit_ns(self) -> int:
        return self.words[W_SUBMIT_LO] | self.words[W_SUBMIT_HI] << 32

    def _write_text(self, offset: int, text: str, capacity: int) -> int:
        data = text.encode()[:capacity]
        self.seg.mm[offset : offset + len(data)] = data
        return len(data)

    def _read_text(self, offset: int, length_word: int) -> str:
        n = self.words[length_word]
        return bytes(self.seg.mm[offset : offset + n]).decode(errors="replace")

    def reply(self, seq: int, status: int, error: str = "", shard: int = 0) -> None:
        """Publish shard `shard`'s answer to call `seq` (its output plane already written when OK)."""
        w, base = self.words, 16 * shard
        if error:
            w[W_ERR_LEN + base] = self._write_text(ERR_OFFSET + shard * ERR_CAPACITY, error, ERR_CAPACITY)
        w[W_STATUS + base] = status
        w[W_RESP_SEQ + base] = seq
        futex_wake(self.seg.word_addr(W_RESP_SEQ + base))

    def error_text(self, shard: int) -> str:
        return self._read_text(ERR_OFFSET + shard * ERR_CAPACITY, W_ERR_LEN + 16 * shard)

    def fence(self, reason: str) -> None:
        """Admit no more FFN work through this mailbox; a waiting rank fails with `reason`."""
        if self.words[W_FENCE]:
            return
        self.words[W_FENCE_LEN] = self._write_text(FENCE_OFFSET, reason, FENCE_CAPACITY)
        self.words[W_FENCE] = 1
        for shard in range(self.shards):
            futex_wake(self.seg.word_addr(resp_word(shard)))

    def fence_reason(self) -> str | None:
        return self._read_text(FENCE_OFFSET, W_FENCE_LEN) if self.words[W_FENCE] else None


@dataclass(frozen=True)
class RankLayout:
    """What one Instance rank's Transport needs to know: its mailbox, the execution group of every
    layer (FfnAgent ids in shard order), each agent's inbox, the call bound and its TP position."""

    model: str
    mailbox: str
    layer_agents: list[list[str]]
    inboxes: dict[str, str]
    timeout_s: float
    tp_rank: int = 0
    tp: int = 1
    """`tp_rank` 0 publishes the calls of the mailbox's `tp` ranks; the others follow."""


class RankTransport:
    """The Instance rank's end of its mailbox: one blocking, bounded call per layer."""

    def __init__(self, layout: RankLayout) -> None:
        assert 0 <= layout.tp_rank < layout.tp <= MAX_TP, (layout.tp_rank, layout.tp)
        self.model = layout.model
        self.mailbox = Mailbox.open(layout.mailbox)
        w = self.mailbox.words
        inboxes = {agent: Inbox.open(name, agent) for agent, name in layout.inboxes.items()}
        self.layer_inboxes = [[inboxes[a] for a in group] for group in layout.layer_agents]
        assert max(map(len, self.layer_inboxes)) <= self.mailbox.shards, "mailbox has too few output planes"
        self.peers = {agent: inbox.peer() for agent, inbox in inboxes.items()}
        self.bound_s = layout.timeout_s
        self.seq = w[W_REQ_SEQ]
        self.latency = LatencyHistogram()
        self.tp_rank, self.followers = layout.tp_rank, range(1, layout.tp)
        if self.tp_rank:
            w[ack_word(self.tp_rank) + 1] = os.getpid()  # the follower's pid word
        else:
            w[W_RANK_PID] = os.getpid()

    def _check(self, group: list[Inbox], during: str) -> None:
        reason = self.mailbox.fence_reason()
        if reason is not None:
            raise FfnFenced(f"{reason}{during}")
        for inbox in group:
            peer = self.peers[inbox.agent]
            if not peer.alive():
                raise FfnPeerExited(f"FFN pool failed: {peer} exited{during}")

    def call(self, layer: int, hidden: torch.Tensor, out: torch.Tensor) -> None:
        mb = self.mailbox
        rows = hidden.shape[0]
        if hidden.dim() != 2 or hidden.shape[1] != mb.hidden or hidden.dtype != mb.dtype:
            raise FfnCallRejected(
                f"FFN call for layer {layer} of {self.model}: expected [rows, {mb.hidden}] {mb.dtype}, "
                f"got {list(hidden.shape)} {hidden.dtype}"
            )
        if rows > mb.max_rows:
            raise FfnCallRejected(
                f"FFN call for layer {layer} of {self.model} carries {rows} rows; the mailbox holds "
                f"{mb.max_rows} (raise limits.max_batched_tokens)"
            )
        if rows == 0:
            return
        start = time.perf_counter()
        group = self.layer_inboxes[layer]
        if self.tp_rank:
            self._follow(layer, rows, group)
        else:
            mb.input[:rows].copy_(hidden)
            self._round_trip(layer, rows, group)
        if len(group) == 1:
            out.copy_(mb.outputs[0][:rows])
        else:
            total = mb.outputs[0][:rows].float()
            for plane in mb.outputs[1 : len(group)]:
                total += plane[:rows]
            out.copy_(total)
        if self.tp_rank:
            mb.words[ack_word(self.tp_rank)] = self.seq
            futex_wake(mb.seg.word_addr(ack_word(self.tp_rank)))
        self.latency.observe(time.perf_counter() - start)

    def metrics(self) -> MemberMetrics:
        return MemberMetrics(ffn_calls={self.model: self.latency.snapshot()})

    def probe(self, rows: int = 1) -> None:
        """A call the first FfnAgent answers without computing: the Transport+Fabric round trip."""
        self._round_trip(PROBE_LAYER, rows, self.layer_inboxes[0][:1])

    def _round_trip(self, layer: int, rows: int, group: list[Inbox]) -> None:
        w = self.mailbox.words
        if w[W_FENCE]:
            raise FfnFenced(f"{self.mailbox.fence_reason()} during layer {layer} of {self.model}")
        deadline = time.monotonic() + self.bound_s
        for follower in self.followers:  # they must have read the previous call's planes
            who = f"attention TP rank {follower} of {self.model}"
            self._wait_word(ack_word(follower), self.seq, deadline, group, who, f" before layer {layer}")
        now = time.monotonic_ns()
        w[W_LAYER], w[W_ROWS], w[W_SUBMIT_LO], w[W_SUBMIT_HI] = layer, rows, now & SEQ_MASK, now >> 32
        seq = self.seq = (self.seq + 1) & SEQ_MASK
        w[W_REQ_SEQ] = seq
        for inbox in group:
            inbox.ring()
        self._wait_replies(seq, layer, rows, group, time.monotonic() + self.bound_s)

    def _follow(self, layer: int, rows: int, group: list[Inbox]) -> None:
        """A TP follower's call: the leader publishes the same call; wait for its replies."""
        seq = self.seq = (self.seq + 1) & SEQ_MASK
        self._wait_replies(seq, layer, rows, group, time.monotonic() + self.bound_s)
        w = self.mailbox.words
        if (w[W_LAYER], w[W_ROWS]) != (layer, rows):
            raise RankDisagreement(
                f"attention TP ranks of {self.model} disagree: call {seq} is layer {w[W_LAYER]} with "
                f"{w[W_ROWS]} rows on rank 0, layer {layer} with {rows} rows on rank {self.tp_rank}"
            )

    def _wait_replies(self, seq: int, layer: int, rows: int, group: list[Inbox], deadline: float) -> None:
        for shard in range(len(group)):
            who = f"FFN pool failed: FfnAgent {group[shard].agent!r}"
            during = f" during layer {layer} of {self.model}"
            self._wait_word(resp_word(shard), seq, deadline, group, who, during, f" ({rows} rows)")
            if self.mailbox.words[W_STATUS + 16 * shard] != STATUS_OK:
                raise FfnAgentFailed(self.mailbox.error_text(shard))

    def _wait_word(
        self, word: int, target: int, deadline: float, group: list[Inbox], who: str, during: str, detail: str = ""
    ) -> None:
        value = self.mailbox.words[word]
        while value != target:
            try:
                value = wait_word_change(
                    self.mailbox.seg, word, value, deadline=deadline, check=lambda: self._check(group, during)
                )
            except TimeoutError:
                raise FfnTimeout(f"{who} did not answer within {self.bound_s:g} s{during}{detail}") from None
