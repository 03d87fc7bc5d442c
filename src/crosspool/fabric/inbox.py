"""The Fabric's shared-memory end at an FfnAgent: its inbox, a doorbell any rank can ring.

A rank publishes a call in its own mailbox and rings the doorbell of every FfnAgent that holds
the layer; the agent's executor lanes wake on it and claim calls from the mailboxes they serve.
The doorbell is a counting semaphore, one count per call, so a wake is never lost and no rank
waits for another to submit.
"""

from __future__ import annotations

import os

from crosspool.ipc import Peer, Segment, Semaphore

MAGIC = 0xC5055004
W_MAGIC, W_PID = 0, 1
DOORBELL_OFFSET = 64
INBOX_SIZE = 4096


class Inbox:
    def __init__(self, seg: Segment, agent: str, *, create: bool = False) -> None:
        self.seg, self.agent = seg, agent
        self.doorbell = Semaphore(seg, DOORBELL_OFFSET, create=create)
        if create:
            seg.words[W_PID] = os.getpid()
            seg.words[W_MAGIC] = MAGIC
        elif seg.words[W_MAGIC] != MAGIC:
            raise RuntimeError(f"FfnAgent inbox {seg.name!r} is not initialised")
        self.ring = self.doorbell.post

    @classmethod
    def create(cls, name: str, agent: str) -> Inbox:
        return cls(Segment(name, INBOX_SIZE, create=True), agent, create=True)

    @classmethod
    def open(cls, name: str, agent: str) -> Inbox:
        return cls(Segment(name, 0, create=False), agent)

    def peer(self) -> Peer:
        return Peer("FfnAgent", self.agent, self.seg.words[W_PID])
