"""The Fabric's shared-memory end at an FfnAgent: its inbox, a doorbell any rank can ring, and the
agent's counters per mailbox it serves.

A rank publishes a call in its own mailbox and rings the doorbell of every FfnAgent that holds
the layer; the agent's executor lanes wake on it and claim calls from the mailboxes they serve.
The doorbell is a counting semaphore, one count per call, so a wake is never lost and no rank
waits for another to submit.

The counters (per mailbox index of the plan: calls executed, time computing, time a call waited
for a lane, the last request claimed) are written by the agent's lanes, and its heartbeat (a
timestamp) by its main thread; the daemon reads them for its metrics and the agent's liveness.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from crosspool.ipc import Peer, Segment, Semaphore

MAGIC = 0xC5055007
W_MAGIC, W_PID, W_SLOTS = 0, 1, 2
HEARTBEAT_OFFSET = 16  # u64: CLOCK_MONOTONIC ns of the agent's last heartbeat
DOORBELL_OFFSET = 64
STATS_OFFSET, STATS_WORDS = 1024, 4  # u64 counters of mailbox i at STATS_OFFSET + 8 * STATS_WORDS * i
S_EXECUTED, S_EXECUTE_NS, S_QUEUE_NS, S_CLAIMED = 0, 1, 2, 3
COUNTERS = {"c_executed": S_EXECUTED, "c_execute_ns": S_EXECUTE_NS, "c_queue_ns": S_QUEUE_NS, "c_claimed": S_CLAIMED}
"""Where an agent's counters lie within its slot, as the C end of a call gets it."""


@dataclass(frozen=True)
class AgentStats:
    """An FfnAgent's counters for one mailbox."""

    executed: int
    execute_ns: int
    """Time computing the layers (the call's rows in, the result in the output plane)."""
    queue_ns: int
    """Time from the rank's publication to a lane claiming the call."""
    claimed: int
    """The mailbox's last request sequence the agent claimed or saw pass."""


class Inbox:
    def __init__(self, seg: Segment, agent: str, *, create: bool = False) -> None:
        self.seg, self.agent = seg, agent
        self.doorbell = Semaphore(seg, DOORBELL_OFFSET, create=create)
        if create:
            seg.words[W_PID] = os.getpid()
            seg.words[W_MAGIC] = MAGIC
        elif seg.words[W_MAGIC] != MAGIC:
            raise RuntimeError(f"FfnAgent inbox {seg.name!r} is not initialised")
        self.slots = seg.words[W_SLOTS]
        self.stats = seg.mm_view(STATS_OFFSET, seg.size).cast("Q")
        self._heartbeat = seg.mm_view(HEARTBEAT_OFFSET, HEARTBEAT_OFFSET + 8).cast("Q")

    @classmethod
    def create(cls, name: str, agent: str, mailboxes: int) -> Inbox:
        seg = Segment(name, STATS_OFFSET + 8 * STATS_WORDS * mailboxes, create=True)
        seg.words[W_SLOTS] = mailboxes
        return cls(seg, agent, create=True)

    @classmethod
    def open(cls, name: str, agent: str) -> Inbox:
        return cls(Segment(name, 0, create=False), agent)

    def heartbeat(self) -> None:
        """Tell the daemon the agent lives (it reads the timestamp here)."""
        self._heartbeat[0] = time.monotonic_ns()

    def heartbeat_ns(self) -> int:
        return self._heartbeat[0]

    def peer(self) -> Peer:
        return Peer("FfnAgent", self.agent, self.seg.words[W_PID])

    def counters_address(self, mailbox: int) -> int:
        """Where the agent's counters for mailbox `mailbox` lie in this process (for the C end of a call)."""
        assert 0 <= mailbox < self.slots, (mailbox, self.slots)
        return self.seg.addr + STATS_OFFSET + 8 * STATS_WORDS * mailbox

    def counters(self, mailbox: int) -> memoryview:
        """The agent's u64 counters for mailbox `mailbox` (S_EXECUTED, S_EXECUTE_NS, S_QUEUE_NS)."""
        assert 0 <= mailbox < self.slots, (mailbox, self.slots)
        return self.stats[STATS_WORDS * mailbox : STATS_WORDS * (mailbox + 1)]

    def agent_stats(self, mailbox: int) -> AgentStats:
        c = self.counters(mailbox)
        return AgentStats(c[S_EXECUTED], c[S_EXECUTE_NS], c[S_QUEUE_NS], c[S_CLAIMED])
