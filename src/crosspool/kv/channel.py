"""The control channel of one KV Capacity Group: a shared-memory segment between the daemon and
the group's engine scheduler (the one place that decides for all the group's TP ranks).

The daemon writes a target (blocks the group may back), bumps the command sequence and posts
the engine's semaphore; the engine applies it between steps and publishes a `GroupReport`: what
it backs, what its blocked work needs and by when. Words are 8-byte aligned (single stores on
x86-64); a reader may see a newer target with an older sequence, which only makes the engine
apply the same target twice.
"""

from __future__ import annotations

import time
from dataclasses import astuple, dataclass, fields

from crosspool.ipc import Segment, Semaphore

_TARGET, _COMMAND_SEQ, _APPLIED_SEQ, _ATTACHED = 0, 1, 2, 3
_REPORT = 4  # GroupReport's int fields follow, then its float fields
UNFUNDED = -1  # the target before the daemon has funded the group


@dataclass(frozen=True)
class GroupReport:
    """What a group's engine publishes after attaching and after every step."""

    block_bytes: int
    """Bytes one block takes over all the group's ranks."""
    total_blocks: int
    """Blocks reserved (the address range): the most the group may back."""
    floor_blocks: int
    """Blocks it keeps whatever the target: the configured floor, at least one max_model_len sequence."""
    backed_blocks: int
    """Blocks in its allocator or in use; the others are released to the OS."""
    used_blocks: int
    """Backed blocks held by requests."""
    used_tokens: int
    """Tokens whose KV the running requests hold (logical occupancy)."""
    cached_blocks: int
    """Free backed blocks that still hold prefix-cache entries."""
    demand_blocks: int
    """Blocks its blocked prefill and decode work needs beyond what is free."""
    running: int
    waiting: int
    released_bytes: int
    """Resident bytes given back to the OS so far (madvise), over all ranks."""
    deadline: float
    """Earliest deadline (unix time) of its blocked work; 0: nothing blocked."""
    published: float = 0.0
    """Unix time of this report."""


_INT_FIELDS = [f.name for f in fields(GroupReport) if f.type == "int"]
_FLOAT_FIELDS = [f.name for f in fields(GroupReport) if f.type == "float"]
assert [f.name for f in fields(GroupReport)] == _INT_FIELDS + _FLOAT_FIELDS
_FLOATS_AT = 8 * (_REPORT + len(_INT_FIELDS))
_SEM_AT = _FLOATS_AT + 8 * len(_FLOAT_FIELDS)
SIZE = _SEM_AT + 64


class KvChannel:
    def __init__(self, name: str, *, create: bool) -> None:
        self.seg = Segment(name, SIZE, create=create)
        self.ints = memoryview(self.seg.mm)[:_FLOATS_AT].cast("q")
        self.floats = memoryview(self.seg.mm)[_FLOATS_AT:_SEM_AT].cast("d")
        self.wake = Semaphore(self.seg, _SEM_AT, create=create)
        """The engine waits here for commands while it has nothing else to do."""
        if create:
            self.ints[_TARGET] = UNFUNDED

    # -- daemon side ---------------------------------------------------------------------------

    def command(self, target_blocks: int) -> None:
        assert target_blocks >= 0
        self.ints[_TARGET] = target_blocks
        self.ints[_COMMAND_SEQ] += 1
        self.wake.post()

    @property
    def target(self) -> int:
        return self.ints[_TARGET]

    def report(self) -> GroupReport | None:
        """The engine's last report; None before it attached."""
        if not self.ints[_ATTACHED]:
            return None
        ints = [self.ints[_REPORT + i] for i in range(len(_INT_FIELDS))]
        floats = [self.floats[i] for i in range(len(_FLOAT_FIELDS))]
        return GroupReport(*ints, *floats)

    # -- engine side ---------------------------------------------------------------------------

    def pending(self) -> tuple[int, int] | None:
        """(sequence, target) of a command not yet applied, or None."""
        seq = self.ints[_COMMAND_SEQ]
        if seq == self.ints[_APPLIED_SEQ]:
            return None
        return seq, self.ints[_TARGET]

    def applied(self, seq: int) -> None:
        self.ints[_APPLIED_SEQ] = seq

    def publish(self, report: GroupReport) -> None:
        values = dict(zip([f.name for f in fields(GroupReport)], astuple(report), strict=True))
        values["published"] = time.time()
        for i, name in enumerate(_INT_FIELDS):
            self.ints[_REPORT + i] = values[name]
        for i, name in enumerate(_FLOAT_FIELDS):
            self.floats[i] = values[name]
        self.ints[_ATTACHED] = 1

    def close(self) -> None:
        self.ints.release()
        self.floats.release()
