"""The Transport: one shared-memory mailbox per Instance DP rank, through which its layer calls
reach the FFN pool.

The AtnAgent of the rank's attention device creates and owns the mailbox. A call: the rank
writes its live rows into `input`, the layer, the row count and its submit time, publishes
`req_seq`, then rings the doorbell of every FfnAgent of the layer's execution group (Fabric).
Agent i of the group writes output plane i and a status, publishes its own `resp_seq[i] ==
req_seq` and posts the reply semaphore of every reader. With one agent the rank copies plane 0
into the caller-owned tensor; with k (FFN tensor parallelism) it adds the k partial sums in shard
order in fp32 and casts once, so the result does not depend on which agent finished first. One
call is in flight per mailbox (a rank's layer calls are serial), so the planes are reused
without a ring.

With attention tensor parallelism the TP ranks of a DP rank hold the same hidden states and make
the same calls, so they share one mailbox: the first rank (the leader) publishes each call, the
others (followers) wait for the same replies, read the same output planes and acknowledge on
their own line; the leader publishes its next call only once every follower acknowledged the
previous one, so planes are never overwritten while a follower still reads them.
The readers of a mailbox share its calls in one of two row layouts, fixed when it is created:
* replicated (attention TP, and the context-parallel modes whose ranks gather every row): every
  reader hands the pool the same rows and gets all of them back. The leader publishes a 64-bit
  digest of its rows with the call and a follower checks its own rows against it.
* local (context-parallel modes whose ranks hold different rows of one invocation): each call
  carries the rank's `RowShare`, the invocation row of each of its rows. Every reader writes the
  rows it sends at their invocation rows and arrives; the leader checks that the sent rows cover
  the invocation once each, publishes once all arrived, and each reader gets back its rows. The
  pool computes the whole invocation in its order, so a rank's rows come back as they would from
  one rank holding all of them.
A reader whose layer, row count, rows or row ownership disagree fails its call (RankDisagreement)
instead of taking another rank's result.

Waits are process-shared glibc semaphores (a reply semaphore per shard and reader, an ack
semaphore per follower): `sem_post` enters the kernel only when the reader sleeps, and the
sequence words stay the truth (a semaphore count is a hint; a reader that saw its word before it
slept leaves a count the next wait consumes). Liveness of the peers, the call's bound and the
fence reason are looked at only when a wait slice expires or a wake brings no reply.

The control plane fences a mailbox to stop admitting FFN work: a fenced rank fails its call at
once with the fence reason, including a call already waiting.

Each reader keeps its counters in the mailbox (a heartbeat timestamp, calls, time in calls and a
latency histogram): the daemon reads them there, nothing is sent from inside the engine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from crosspool.fabric.inbox import Inbox
from crosspool.ipc import SEM_SIZE, SLICE_S, Segment, Semaphore
from crosspool.models.spec import DTYPES
from crosspool.transport import _calls as calls
from crosspool.transport._calls import RankChannel
from crosspool.transport.errors import (
    FfnAgentFailed,
    FfnCallError,
    FfnCallRejected,
    FfnFenced,
    FfnPeerExited,
    FfnTimeout,
    RankDisagreement,
)

MAGIC = 0xC5055005
_DTYPE_CODES = {name: code for code, name in enumerate(DTYPES)}
SEQ_MASK = 0xFFFFFFFF

# u32 word indices; words written by different processes sit on different 64-byte lines.
W_MAGIC, W_MAX_ROWS, W_HIDDEN, W_DTYPE, W_OWNER_PID, W_SHARDS, W_READERS, W_LOCAL_ROWS = range(8)  # creator
W_REQ_SEQ, W_LAYER, W_ROWS, W_SUBMIT_LO, W_SUBMIT_HI, W_RANK_PID, W_DIGEST_LO, W_DIGEST_HI = range(16, 24)  # the rank
W_ROW_VERDICT = 24  # the leader, local rows: whether the readers' rows cover the invocation
W_FENCE, W_FENCE_LEN = 32, 33  # the control plane
MAX_SHARDS = 8
W_RESP_SEQ, W_STATUS, W_ERR_LEN = 48, 49, 50  # the FFN side: shard i's words are 16 * i further
MAX_TP = 4
W_ACK = 176  # attention TP follower f (1..MAX_TP-1): its ack at 16 * (f - 1) further, its pid next
FENCE_OFFSET, FENCE_CAPACITY = 1024, 1024
ERR_OFFSET, ERR_CAPACITY = 2048, 256  # shard i's error text at ERR_OFFSET + i * ERR_CAPACITY
REPLY_SEMS_OFFSET = 4096  # semaphore of (shard, reader) at + (shard * MAX_TP + reader) * SEM_SIZE
ACK_SEMS_OFFSET = REPLY_SEMS_OFFSET + MAX_SHARDS * MAX_TP * SEM_SIZE  # follower f's at + (f - 1) * SEM_SIZE
READER_STATS_OFFSET, READER_STATS_WORDS = 6144, 32  # u64 counters of reader r at + r * 8 * READER_STATS_WORDS
DATA_OFFSET = 8192

# A reader's u64 counters: what the daemon reads for liveness and metrics.
R_HEARTBEAT_NS, R_CALLS, R_CALL_NS, R_BUCKETS = 0, 1, 2, 3
LATENCY_BUCKETS_NS = tuple(
    int(b * 1e9) for b in (2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.5, 1.0)
)
"""Upper bounds of the call-latency histogram (a one-row round trip is ~20 us, a 2048-row call
tens of ms); the last bucket, +Inf, follows them."""
assert R_BUCKETS + len(LATENCY_BUCKETS_NS) + 1 <= READER_STATS_WORDS

STATUS_OK, STATUS_ERROR = 0, 1
PROBE_LAYER = 0xFFFFFFFF
"""A layer index no model has: the FfnAgent answers without computing (Transport+Fabric latency)."""


def mailbox_size(max_rows: int, hidden: int, dtype: str, shards: int = 1, readers: int = 1, local: bool = False) -> int:
    """The planes, then with local rows each reader's row indices (a count, then a u32 per row)."""
    indices = readers * (max_rows + 1) * 4 if local else 0
    return DATA_OFFSET + (1 + shards) * max_rows * hidden * DTYPES[dtype].itemsize + indices


def resp_word(shard: int) -> int:
    return W_RESP_SEQ + 16 * shard


def ack_word(follower: int) -> int:
    assert 1 <= follower < MAX_TP, follower
    return W_ACK + 16 * (follower - 1)


@dataclass(frozen=True)
class ReaderStats:
    """One reader's counters as the daemon sees them."""

    heartbeat_ns: int
    """CLOCK_MONOTONIC of its last heartbeat (0: none yet)."""
    calls: int
    call_ns: int
    buckets: tuple[int, ...]
    """Calls per latency bucket (`LATENCY_BUCKETS_NS`, then +Inf), not cumulative."""


class Mailbox:
    def __init__(self, seg: Segment, *, create: bool = False) -> None:
        words = seg.words
        if not create and words[W_MAGIC] != MAGIC:
            raise RuntimeError(f"mailbox {seg.name!r} is not initialised (bad magic)")
        self.seg = seg
        self.words = words
        self.max_rows, self.hidden, self.shards = words[W_MAX_ROWS], words[W_HIDDEN], words[W_SHARDS]
        self.readers = words[W_READERS]
        self.local_rows = bool(words[W_LOCAL_ROWS])
        self.dtype = list(DTYPES.values())[words[W_DTYPE]]
        plane = self.max_rows * self.hidden * self.dtype.itemsize
        shape = (self.max_rows, self.hidden)
        self.input = seg.tensor(DATA_OFFSET, shape, self.dtype)
        self.outputs = [seg.tensor(DATA_OFFSET + (1 + i) * plane, shape, self.dtype) for i in range(self.shards)]
        self.index_offset = DATA_OFFSET + (1 + self.shards) * plane if self.local_rows else 0
        self.reply_sems = [
            [
                Semaphore(seg, REPLY_SEMS_OFFSET + (s * MAX_TP + r) * SEM_SIZE, create=create)
                for r in range(self.readers)
            ]
            for s in range(self.shards)
        ]
        self.ack_sems = [
            Semaphore(seg, ACK_SEMS_OFFSET + (f - 1) * SEM_SIZE, create=create) for f in range(1, self.readers)
        ]
        self.stats = seg.mm_view(READER_STATS_OFFSET, DATA_OFFSET).cast("Q")

    @classmethod
    def create(
        cls,
        name: str,
        max_rows: int,
        hidden: int,
        dtype: str,
        shards: int = 1,
        readers: int = 1,
        local_rows: bool = False,
    ) -> Mailbox:
        assert 1 <= shards <= MAX_SHARDS and 1 <= readers <= MAX_TP, (shards, readers)
        seg = Segment(name, mailbox_size(max_rows, hidden, dtype, shards, readers, local_rows), create=True)
        w = seg.words
        w[W_MAX_ROWS], w[W_HIDDEN], w[W_DTYPE], w[W_SHARDS] = max_rows, hidden, _DTYPE_CODES[dtype], shards
        w[W_READERS], w[W_OWNER_PID], w[W_LOCAL_ROWS] = readers, os.getpid(), local_rows
        mailbox = cls(seg, create=True)
        w[W_MAGIC] = MAGIC
        return mailbox

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
        for sem in self.reply_sems[shard]:
            sem.post()

    def error_text(self, shard: int) -> str:
        return self._read_text(ERR_OFFSET + shard * ERR_CAPACITY, W_ERR_LEN + 16 * shard)

    def fence(self, reason: str) -> None:
        """Admit no more FFN work through this mailbox; a waiting rank fails with `reason`."""
        if self.words[W_FENCE]:
            return
        self.words[W_FENCE_LEN] = self._write_text(FENCE_OFFSET, reason, FENCE_CAPACITY)
        self.words[W_FENCE] = 1
        for sems in self.reply_sems:
            for sem in sems:
                sem.post()
        for sem in self.ack_sems:
            sem.post()

    def reset(self) -> None:
        """Hand a fenced mailbox to the next engine of its Instance: the previous one's processes
        are gone and every agent answered its last call. The sequence goes on from where it
        stopped (a new rank starts at `req_seq`, the agents' claims are there), the followers
        count as done with the last call, wake-up counts left by the fence are taken back, and
        the fence is lifted last."""
        w = self.words
        assert w[W_FENCE], "only a fenced mailbox is handed on"
        for follower in range(1, self.readers):
            w[ack_word(follower)], w[ack_word(follower) + 1] = w[W_REQ_SEQ], 0
        w[W_RANK_PID] = 0
        for sem in [*(s for sems in self.reply_sems for s in sems), *self.ack_sems]:
            while sem.try_take():
                pass
        for reader in range(self.readers):
            self.stats[reader * READER_STATS_WORDS + R_HEARTBEAT_NS] = 0
        w[W_FENCE_LEN] = 0
        w[W_FENCE] = 0

    def fence_reason(self) -> str | None:
        return self._read_text(FENCE_OFFSET, W_FENCE_LEN) if self.words[W_FENCE] else None

    def heartbeat_ns(self, reader: int) -> int:
        return self.stats[reader * READER_STATS_WORDS + R_HEARTBEAT_NS]

    def reader_stats(self, reader: int) -> ReaderStats:
        base = reader * READER_STATS_WORDS
        s = self.stats[base : base + READER_STATS_WORDS]
        buckets = tuple(s[R_BUCKETS : R_BUCKETS + len(LATENCY_BUCKETS_NS) + 1])
        return ReaderStats(s[R_HEARTBEAT_NS], s[R_CALLS], s[R_CALL_NS], buckets)


@dataclass(frozen=True)
class RowShare:
    """A rank's part of a layer call on a local-row mailbox: its row i is row `index[i]` of the
    invocation's `total` rows. It sends the pool the rows it owns and gets all of its rows back; a
    row several ranks hold is owned by one of them (the others get it back only)."""

    index: np.ndarray
    """u32 invocation rows; `RECEIVE_ONLY` set on the rows another rank sends."""
    total: int

    @classmethod
    def of(
        cls, rows: Sequence[int] | np.ndarray, total: int, owned: Sequence[bool] | np.ndarray | None = None
    ) -> RowShare:
        index = np.asarray(rows, dtype=np.int64)
        assert index.ndim == 1 and (index.size == 0 or 0 <= index.min() <= index.max() < total), (index, total)
        words = index.astype(np.uint32)
        if owned is not None:
            words[~np.asarray(owned, dtype=bool)] |= np.uint32(calls.RECEIVE_ONLY)
        return cls(words, total)


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
    spin_us: int = 0
    """How long a call watches for its reply (yielding the CPU) before it sleeps."""


LAYOUT = {
    "req_seq": W_REQ_SEQ,
    "layer": W_LAYER,
    "rows": W_ROWS,
    "submit_lo": W_SUBMIT_LO,
    "submit_hi": W_SUBMIT_HI,
    "digest_lo": W_DIGEST_LO,
    "digest_hi": W_DIGEST_HI,
    "row_verdict": W_ROW_VERDICT,
    "fence": W_FENCE,
    "resp_seq": W_RESP_SEQ,
    "status": W_STATUS,
    "ack": W_ACK,
    "stride": 16,
    "reply_sems": REPLY_SEMS_OFFSET,
    "ack_sems": ACK_SEMS_OFFSET,
    "sem_size": SEM_SIZE,
    "max_tp": MAX_TP,
    "reader_stats": READER_STATS_OFFSET,
    "reader_words": READER_STATS_WORDS,
    "data": DATA_OFFSET,
    "r_calls": R_CALLS,
    "r_call_ns": R_CALL_NS,
    "r_buckets": R_BUCKETS,
    "probe_layer": PROBE_LAYER,
    "status_ok": STATUS_OK,
}
"""The mailbox layout, as the C ends of a call (`_calls`) get it."""


class RankTransport:
    """The Instance rank's end of its mailbox: one blocking, bounded call per layer (`_calls.RankChannel`)."""

    def __init__(self, layout: RankLayout) -> None:
        assert 0 <= layout.tp_rank < layout.tp <= MAX_TP, (layout.tp_rank, layout.tp)
        self.model = layout.model
        mb = self.mailbox = Mailbox.open(layout.mailbox)
        assert mb.readers == layout.tp, (mb.readers, layout.tp)
        self.max_rows, self.hidden, self.dtype = mb.max_rows, mb.hidden, mb.dtype
        agents = sorted(layout.inboxes)
        inboxes = [Inbox.open(layout.inboxes[agent], agent) for agent in agents]
        self.layer_agents = layout.layer_agents
        assert max(map(len, self.layer_agents)) <= mb.shards, "mailbox has too few output planes"
        self.peers = [inbox.peer() for inbox in inboxes]
        self.bound_s = layout.timeout_s
        self.reader = layout.tp_rank
        base = self.reader * READER_STATS_WORDS
        self.stats = mb.stats[base : base + READER_STATS_WORDS]
        self.channel = RankChannel(
            layout=LAYOUT,
            base=mb.seg.addr,
            reader=self.reader,
            readers=layout.tp,
            hidden=mb.hidden,
            itemsize=mb.dtype.itemsize,
            bf16=mb.dtype == torch.bfloat16,
            max_rows=mb.max_rows,
            groups=[[agents.index(a) for a in group] for group in layout.layer_agents],
            doorbells=[inbox.doorbell.address for inbox in inboxes],
            pidfds=[peer.fd for peer in self.peers],
            bound_ns=int(layout.timeout_s * 1e9),
            spin_ns=layout.spin_us * 1000,
            slice_ns=int(SLICE_S * 1e9),
            buckets_ns=LATENCY_BUCKETS_NS,
            index_offset=mb.index_offset,
        )
        self._keep = (inboxes, self.peers)  # the channel points into their mappings and pidfds
        if self.reader:
            mb.words[ack_word(self.reader) + 1] = os.getpid()  # the follower's pid word
        else:
            mb.words[W_RANK_PID] = os.getpid()
        self.heartbeat()

    @property
    def seq(self) -> int:
        return int(self.channel.seq)

    def heartbeat(self) -> None:
        """Tell the daemon this rank lives (it reads the timestamp from the mailbox)."""
        self.stats[R_HEARTBEAT_NS] = time.monotonic_ns()

    def call(self, layer: int, hidden: torch.Tensor, out: torch.Tensor, share: RowShare | None = None) -> None:
        """FFN of layer `layer` for `hidden` [rows, hidden] into `out` (same shape and dtype); on a
        local-row mailbox `share` says which invocation rows `hidden` holds."""
        rows = hidden.shape[0]
        if hidden.dtype != self.dtype or hidden.dim() != 2 or hidden.shape[1] != self.hidden or rows > self.max_rows:
            raise self._rejected(layer, hidden)
        if (share is not None) != self.mailbox.local_rows:
            layout = "local rows: a call needs its RowShare" if self.mailbox.local_rows else "replicated rows"
            raise FfnCallRejected(f"FFN call for layer {layer} of {self.model}: the mailbox holds {layout}")
        if share is not None:
            if share.index.shape != (rows,) or not 0 < share.total <= self.max_rows:
                raise FfnCallRejected(
                    f"FFN call for layer {layer} of {self.model}: {rows} rows with a RowShare of "
                    f"{share.index.size} rows out of {share.total} (the mailbox holds {self.max_rows})"
                )
            status = self._call(layer, hidden, out, share)
            rows = share.total  # what the ranks' calls are compared by
        elif rows == 0:
            return
        else:
            status = self._call(layer, hidden, out, None)
        if status:
            raise self._failure(status, layer, rows)

    def _call(self, layer: int, hidden: torch.Tensor, out: torch.Tensor, share: RowShare | None) -> int:
        if out.shape != hidden.shape or out.dtype != self.dtype:
            raise FfnCallRejected(
                f"FFN call for layer {layer} of {self.model}: output {list(out.shape)} {out.dtype} for input "
                f"{list(hidden.shape)} {hidden.dtype}"
            )
        target = out if out.is_contiguous() else torch.empty_like(hidden, memory_format=torch.contiguous_format)
        source = hidden.contiguous()
        if share is None:
            status = self.channel.call(layer, source.data_ptr(), target.data_ptr(), hidden.shape[0])
        else:
            index = np.ascontiguousarray(share.index)
            status = self.channel.call(
                layer, source.data_ptr(), target.data_ptr(), hidden.shape[0], index.ctypes.data, share.total
            )
        if not status and target is not out:
            out.copy_(target)
        return status

    def probe(self, rows: int = 1) -> None:
        """A call the first FfnAgent answers without computing: the Transport+Fabric round trip."""
        if self.mailbox.local_rows:
            raise FfnCallRejected(f"a probe of {self.model}: its mailbox holds local rows, and a probe has none")
        status = self.channel.probe(rows)
        if status:
            raise self._failure(status, None, rows)

    def _rejected(self, layer: int, hidden: torch.Tensor) -> FfnCallRejected:
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden or hidden.dtype != self.dtype:
            return FfnCallRejected(
                f"FFN call for layer {layer} of {self.model}: expected [rows, {self.hidden}] {self.dtype}, "
                f"got {list(hidden.shape)} {hidden.dtype}"
            )
        return FfnCallRejected(
            f"FFN call for layer {layer} of {self.model} carries {hidden.shape[0]} rows; the mailbox holds "
            f"{self.max_rows} (raise limits.max_batched_tokens)"
        )

    def _failure(self, status: int, layer: int | None, rows: int) -> FfnCallError:
        """The typed error of a failed call (the channel's status and the index it names)."""
        during = f" during layer {layer} of {self.model}" if layer is not None else f" during a probe of {self.model}"
        index = self.channel.failed_index
        if status == calls.FENCED:
            return FfnFenced(f"{self.mailbox.fence_reason()}{during}")
        if status == calls.PEER_EXITED:
            return FfnPeerExited(f"FFN pool failed: {self.peers[index]} exited{during}")
        group = self.layer_agents[layer if layer is not None else 0]
        if status == calls.AGENT_ERROR:
            return FfnAgentFailed(self.mailbox.error_text(index))
        if status == calls.DISAGREE:
            w = self.mailbox.words
            return RankDisagreement(
                f"attention TP ranks of {self.model} disagree: call {self.seq} is layer {w[W_LAYER]} with "
                f"{w[W_ROWS]} rows on rank 0, layer {layer} with {rows} rows on rank {self.reader}"
            )
        if status == calls.ROWS_UNOWNED:
            return RankDisagreement(
                f"the ranks of {self.model} do not own the rows of call {self.seq} (layer {layer}) once each: "
                f"the rows they send must cover its {rows} rows exactly, and every row they get "
                "back must be one of them"
            )
        if status == calls.ROWS_DIFFER:
            return RankDisagreement(
                f"attention TP rank {self.reader} of {self.model} handed the pool other rows than rank 0 for layer "
                f"{layer} ({rows} rows): the ranks of a mailbox must hold identical rows"
            )
        assert status == calls.TIMEOUT, status
        bound = f"{self.bound_s:g} s"
        if index < 0:
            return FfnTimeout(f"attention TP rank {-index} of {self.model} did not answer within {bound}{during}")
        agent = group[index]
        return FfnTimeout(f"FFN pool failed: FfnAgent {agent!r} did not answer within {bound}{during} ({rows} rows)")
