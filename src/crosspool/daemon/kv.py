"""The daemon's side of elastic KV for one generation: it creates each KV Capacity Group's
channel before the engines start, funds an attached group at its floor, and every watch tick
runs the pool's arbitration (kv/policy.py) over the groups' reports and sends the new targets.

A donor's release is bounded: a shrink still short of its target after TRANSFER_S (requests
hold its tail blocks) ends with the donor keeping what it still backs; the borrower gets what
was freed. Reading a report is a few loads from shared memory: a slow or dead engine can delay
its own group's transfer, never the daemon.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from pydantic import BaseModel

from crosspool.daemon.supervisor import log
from crosspool.kv.channel import UNFUNDED, KvChannel
from crosspool.kv.policy import GroupState, arbitrate
from crosspool.plan import KvGroupPlan, Plan

TRANSFER_S = 2.0
RECENT_TRANSFERS = 32


class KvBudgetError(RuntimeError):
    """A pool's budget does not cover its groups' floors (known once the engines report block sizes)."""


class KvGroupStatus(BaseModel):
    model: str
    dp_rank: int
    attached: bool
    """False while the engine starts (its whole range backed, charged in full)."""
    block_bytes: int = 0
    """A block over all the group's ranks (0 until attached)."""
    floor_bytes: int
    ceiling_bytes: int
    target_bytes: int | None = None
    backed_bytes: int
    used_bytes: int = 0
    used_tokens: int = 0
    cached_bytes: int = 0
    demand_bytes: int = 0
    deadline_in_s: float | None = None
    """Seconds to the earliest deadline of the group's blocked work (negative: overdue)."""
    running: int = 0
    waiting: int = 0
    released_bytes: int = 0

    @property
    def shrinking(self) -> bool:
        return self.target_bytes is not None and self.backed_bytes > self.target_bytes


class KvTransfer(BaseModel):
    """A donor's shrink, ended: the bytes it stopped backing and the seconds from the daemon's
    lower target to the donor's report of its release."""

    model: str
    dp_rank: int
    started: float
    """Unix time of the lower target."""
    bytes: int
    seconds: float
    complete: bool
    """False: requests held its tail past TRANSFER_S and it kept what it still backed."""


class KvPoolStatus(BaseModel):
    device: str
    budget_bytes: int
    unassigned_bytes: int
    transfers_in_flight: int
    groups: list[KvGroupStatus]
    recent_transfers: list[KvTransfer]
    """The last RECENT_TRANSFERS transfers of this pool, oldest first."""


@dataclass(frozen=True)
class _Shrink:
    started: float
    """Unix time of the lower target (comparable with GroupReport.published)."""
    from_blocks: int


class KvPools:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.channels = {g.name: KvChannel(g.name, create=True) for g in plan.kv_groups}
        self.shrinks: dict[str, _Shrink] = {}
        self.recent: dict[str, deque[KvTransfer]] = {p.device: deque(maxlen=RECENT_TRANSFERS) for p in plan.kv_pools}

    def _groups(self, device: str) -> list[KvGroupPlan]:
        return [g for g in self.plan.kv_groups if g.device == device]

    def _state(self, group: KvGroupPlan) -> GroupState | None:
        channel = self.channels[group.name]
        report = channel.report()
        if report is None:
            return None
        if channel.target == UNFUNDED:
            channel.command(report.floor_blocks)
        return GroupState(
            name=group.name,
            block_bytes=report.block_bytes,
            floor_blocks=report.floor_blocks,
            ceiling_blocks=report.total_blocks,
            target_blocks=channel.target,
            backed_blocks=report.backed_blocks,
            demand_blocks=report.demand_blocks,
            deadline=report.deadline,
        )

    def check_floors(self) -> None:
        """Once every engine attached: the floors fit each budget (raises KvBudgetError)."""
        for pool in self.plan.kv_pools:
            states = [self._state(g) for g in self._groups(pool.device)]
            floors = sum(s.floor_blocks * s.block_bytes for s in states if s is not None)
            if floors > pool.budget_bytes:
                raise KvBudgetError(
                    f"attention_device {pool.device!r}: kv_budget_gib = {pool.budget_bytes / 2**30:g} does not cover "
                    f"its groups' floors ({floors / 2**30:.3f} GiB: kv_floor_gib, at least one max_model_len "
                    "sequence per group)"
                )

    def tick(self) -> None:
        now = time.time()
        for pool in self.plan.kv_pools:
            groups = self._groups(pool.device)
            states = [self._state(g) for g in groups]
            if any(s is None for s in states):
                continue  # an engine still starts with its whole range backed: nothing to move yet
            attached = [s for s in states if s is not None]
            for name, target in arbitrate(pool.budget_bytes, attached).items():
                self.channels[name].command(target)
            for g, s in zip(groups, attached, strict=True):
                shrinking = s.backed_blocks > self.channels[s.name].target  # the target just sent counts
                shrink = self.shrinks.get(s.name)
                if shrink is None:
                    if shrinking:
                        self.shrinks[s.name] = _Shrink(now, s.backed_blocks)
                elif not shrinking:
                    self._ended(pool.device, g, s, shrink, complete=True)
                elif now - shrink.started > TRANSFER_S:
                    log(f"elastic KV: {s.name} keeps {s.backed_blocks} blocks (requests hold its tail)")
                    self.channels[s.name].command(s.backed_blocks)
                    self._ended(pool.device, g, s, shrink, complete=False)

    def _ended(self, device: str, g: KvGroupPlan, s: GroupState, shrink: _Shrink, *, complete: bool) -> None:
        del self.shrinks[s.name]
        report = self.channels[s.name].report()
        assert report is not None
        self.recent[device].append(
            KvTransfer(
                model=g.model,
                dp_rank=g.dp_rank,
                started=shrink.started,
                bytes=(shrink.from_blocks - s.backed_blocks) * s.block_bytes,
                seconds=round(max(report.published - shrink.started, 0.0), 4),
                complete=complete,
            )
        )

    def _group_status(self, g: KvGroupPlan, now: float) -> KvGroupStatus:
        channel = self.channels[g.name]
        r = channel.report()
        if r is None:  # still starting: its whole range is backed
            common = dict(floor_bytes=g.floor_bytes, ceiling_bytes=g.ceiling_bytes, backed_bytes=g.ceiling_bytes)
            return KvGroupStatus(model=g.model, dp_rank=g.dp_rank, attached=False, **common)
        b = r.block_bytes
        target = None if channel.target == UNFUNDED else channel.target
        return KvGroupStatus(
            model=g.model,
            dp_rank=g.dp_rank,
            attached=True,
            block_bytes=b,
            floor_bytes=r.floor_blocks * b,
            ceiling_bytes=r.total_blocks * b,
            target_bytes=None if target is None else target * b,
            backed_bytes=r.backed_blocks * b,
            used_bytes=r.used_blocks * b,
            used_tokens=r.used_tokens,
            cached_bytes=r.cached_blocks * b,
            demand_bytes=r.demand_blocks * b,
            deadline_in_s=round(r.deadline - now, 3) if r.deadline else None,
            running=r.running,
            waiting=r.waiting,
            released_bytes=r.released_bytes,
        )

    def status(self) -> list[KvPoolStatus]:
        now = time.time()
        pools = []
        for pool in self.plan.kv_pools:
            groups = [self._group_status(g, now) for g in self._groups(pool.device)]
            charged = sum(max(g.target_bytes or 0, g.backed_bytes) for g in groups)
            pools.append(
                KvPoolStatus(
                    device=pool.device,
                    budget_bytes=pool.budget_bytes,
                    unassigned_bytes=pool.budget_bytes - charged,
                    transfers_in_flight=sum(g.shrinking for g in groups),
                    groups=groups,
                    recent_transfers=list(self.recent[pool.device]),
                )
            )
        return pools

    def close(self) -> None:
        """After the engines stopped: the channels are the daemon's, it unlinks them."""
        for channel in self.channels.values():
            channel.close()
            channel.seg.unlink()
