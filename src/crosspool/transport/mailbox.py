"""The rank <-> AtnAgent mailbox: one shared-memory segment per Instance rank.

The AtnAgent creates it; the rank writes live rows into `input` and publishes `req_seq`;
the FFN side writes `output`, a status and publishes `resp_seq == req_seq`. One call is in
flight per mailbox (an Instance rank's layer calls are serial).
"""

from __future__ import annotations

import os
import time

import torch

from crosspool.ipc import Peer, PeerDied, Segment, futex_wake, wait_word_change

MAGIC = 0xC5055001
DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_DTYPE_CODES = {name: code for code, name in enumerate(DTYPES)}

# u32 word indices; fields written by different processes sit on different cache lines.
W_MAGIC, W_MAX_ROWS, W_HIDDEN, W_DTYPE, W_ATN_PID = 0, 1, 2, 3, 4
W_REQ_SEQ, W_LAYER, W_ROWS = 16, 17, 18  # written by the rank
W_RANK_PID = 19
W_RESP_SEQ, W_STATUS, W_ERR_LEN = 32, 33, 34  # written by the FFN side
ERR_OFFSET, ERR_CAPACITY = 256, 1024
DATA_OFFSET = 4096

STATUS_OK, STATUS_ERROR = 0, 1
RANK_TIMEOUT_MARGIN_S = 1.0


def mailbox_size(max_rows: int, hidden: int, dtype: str) -> int:
    return DATA_OFFSET + 2 * max_rows * hidden * DTYPES[dtype].itemsize


class Mailbox:
    def __init__(self, seg: Segment) -> None:
        words = seg.words
        if words[W_MAGIC] != MAGIC:
            raise RuntimeError(f"mailbox {seg.name!r} is not initialised (bad magic)")
        self.seg = seg
        self.max_rows, self.hidden = words[W_MAX_ROWS], words[W_HIDDEN]
        self.dtype = list(DTYPES.values())[words[W_DTYPE]]
        plane = self.max_rows * self.hidden * self.dtype.itemsize
        self.input = seg.tensor(DATA_OFFSET, (self.max_rows, self.hidden), self.dtype)
        self.output = seg.tensor(DATA_OFFSET + plane, (self.max_rows, self.hidden), self.dtype)

    @classmethod
    def create(cls, name: str, max_rows: int, hidden: int, dtype: str) -> Mailbox:
        seg = Segment(name, mailbox_size(max_rows, hidden, dtype), create=True)
        w = seg.words
        w[W_MAX_ROWS], w[W_HIDDEN], w[W_DTYPE] = max_rows, hidden, _DTYPE_CODES[dtype]
        w[W_ATN_PID] = os.getpid()
        w[W_MAGIC] = MAGIC
        return cls(seg)

    @classmethod
    def open(cls, name: str) -> Mailbox:
        return cls(Segment(name, 0, create=False))

    @property
    def name(self) -> str:
        return self.seg.name

    def words(self) -> memoryview:
        return self.seg.words

    def rank_attached(self) -> bool:
        return self.seg.words[W_RANK_PID] != 0

    def reply(self, seq: int, status: int, error: str = "") -> None:
        """Publish the answer to call `seq` (output already written when status is OK)."""
        w = self.seg.words
        if error:
            data = error.encode()[:ERR_CAPACITY]
            self.seg.mm[ERR_OFFSET : ERR_OFFSET + len(data)] = data
            w[W_ERR_LEN] = len(data)
        w[W_STATUS] = status
        w[W_RESP_SEQ] = seq
        futex_wake(self.seg.word_addr(W_RESP_SEQ))

    def error_text(self) -> str:
        n = self.seg.words[W_ERR_LEN]
        return bytes(self.seg.mm[ERR_OFFSET : ERR_OFFSET + n]).decode(errors="replace")


class RankTransport:
    """The Instance rank's end of its mailbox: one blocking, bounded call per layer."""

    def __init__(self, mailbox_name: str, atn_agent: str, timeout_s: float) -> None:
        self.mailbox = Mailbox.open(mailbox_name)
        w = self.mailbox.words()
        self.atn = Peer("AtnAgent", atn_agent, w[W_ATN_PID])
        # The AtnAgent bounds the FFN side by timeout_s and names it; the rank's own bound is
        # the backstop for a silent AtnAgent, so it must fire later.
        self.bound_s = timeout_s + RANK_TIMEOUT_MARGIN_S
        self.seq = w[W_REQ_SEQ]
        w[W_RANK_PID] = os.getpid()

    def _check_atn(self) -> None:
        if not self.atn.alive():
            raise PeerDied(f"FFN pool unreachable: {self.atn} exited")

    def call(self, layer: int, hidden: torch.Tensor, out: torch.Tensor) -> None:
        mb = self.mailbox
        rows = hidden.shape[0]
        if hidden.dim() != 2 or hidden.shape[1] != mb.hidden or hidden.dtype != mb.dtype:
            raise RuntimeError(
                f"FFN call for layer {layer}: expected [rows, {mb.hidden}] {mb.dtype}, "
                f"got {list(hidden.shape)} {hidden.dtype}"
            )
        if rows > mb.max_rows:
            raise RuntimeError(
                f"FFN call for layer {layer} carries {rows} rows; the mailbox holds "
                f"{mb.max_rows} (raise limits.max_batched_tokens)"
            )
        if rows == 0:
            return
        mb.input[:rows].copy_(hidden)
        w = mb.words()
        w[W_LAYER], w[W_ROWS] = layer, rows
        self.seq = (self.seq + 1) & 0xFFFFFFFF
        w[W_REQ_SEQ] = self.seq
        futex_wake(mb.seg.word_addr(W_REQ_SEQ))
        deadline = time.monotonic() + self.bound_s
        old = w[W_RESP_SEQ]
        while old != self.seq:
            try:
                old = wait_word_change(mb.seg, W_RESP_SEQ, old, deadline=deadline, check=self._check_atn)
            except TimeoutError:
                raise RuntimeError(
                    f"FFN pool did not answer layer {layer} ({rows} rows) within {self.bound_s:g} s "
                    f"(AtnAgent {self.atn.name!r} {'alive' if self.atn.alive() else 'exited'})"
                ) from None
        if w[W_STATUS] != STATUS_OK:
            raise RuntimeError(mb.error_text())
        out.copy_(mb.output[:rows])
