"""Invocation ring from one AtnAgent to one FfnAgent.

The AtnAgent (single writer, its threads serialised by a lock) fills a slot and advances
`head`; the FfnAgent executes slots in order, delivers the result straight into the
caller's mailbox (zero copy) and marks the slot done. Each slot has its own done word, so
the AtnAgent thread that submitted it waits on that word alone.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from crosspool.ipc import Segment, futex_wake

SLOTS = 64
MAGIC = 0xC5055002
W_MAGIC, W_FFN_PID = 0, 1
W_HEAD = 16  # written by the AtnAgent
SLOT_BASE, SLOT_WORDS = 64, 16  # one 64-byte line per slot
# slot fields
S_SEQ, S_MAILBOX, S_LAYER, S_ROWS, S_CALL_SEQ, S_DONE = range(6)
RING_SIZE = 4 * (SLOT_BASE + SLOTS * SLOT_WORDS)


@dataclass(frozen=True)
class Invocation:
    seq: int  # ring sequence, 1-based
    mailbox: int  # index into the plan's mailbox list
    layer: int
    rows: int
    call_seq: int  # the rank's request sequence, echoed into the mailbox reply


class Ring:
    def __init__(self, seg: Segment) -> None:
        if seg.words[W_MAGIC] != MAGIC:
            raise RuntimeError(f"fabric ring {seg.name!r} is not initialised")
        self.seg = seg
        self._lock = threading.Lock()

    @classmethod
    def create(cls, name: str) -> Ring:
        seg = Segment(name, RING_SIZE, create=True)
        seg.words[W_FFN_PID] = os.getpid()
        seg.words[W_MAGIC] = MAGIC
        return cls(seg)

    @classmethod
    def open(cls, name: str) -> Ring:
        return cls(Segment(name, 0, create=False))

    @property
    def ffn_pid(self) -> int:
        return self.seg.words[W_FFN_PID]

    @staticmethod
    def _base(seq: int) -> int:
        return SLOT_BASE + ((seq - 1) % SLOTS) * SLOT_WORDS

    def done_word(self, seq: int) -> int:
        return self._base(seq) + S_DONE

    def submit(self, mailbox: int, layer: int, rows: int, call_seq: int) -> int:
        """Publish one invocation; returns its ring sequence (wait on `done_word(seq)`)."""
        w = self.seg.words
        with self._lock:
            seq = w[W_HEAD] + 1
            base = self._base(seq)
            # A slot is reused only after its previous occupant completed; with at most one
            # call in flight per mailbox and fewer mailboxes than slots this always holds.
            assert seq <= SLOTS or w[base + S_DONE] == seq - SLOTS, "fabric ring overrun"
            w[base + S_MAILBOX], w[base + S_LAYER], w[base + S_ROWS] = mailbox, layer, rows
            w[base + S_CALL_SEQ] = call_seq
            w[base + S_SEQ] = seq
            w[W_HEAD] = seq
        futex_wake(self.seg.word_addr(W_HEAD))
        return seq

    def read(self, seq: int) -> Invocation:
        base = self._base(seq)
        w = self.seg.words
        if w[base + S_SEQ] != seq:
            raise RuntimeError(f"fabric protocol error: slot holds seq {w[base + S_SEQ]}, expected {seq}")
        return Invocation(seq, w[base + S_MAILBOX], w[base + S_LAYER], w[base + S_ROWS], w[base + S_CALL_SEQ])

    def complete(self, seq: int) -> None:
        index = self.done_word(seq)
        self.seg.words[index] = seq
        futex_wake(self.seg.word_addr(index))
