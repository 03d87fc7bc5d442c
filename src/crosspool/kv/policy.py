"""Who backs how much of a KV Capacity Pool: the daemon's arbitration, a pure function of the
groups' reports (unit-tested on recorded demand traces).

Each round: groups with demand are funded earliest deadline first (overdue ones come first),
from unassigned bytes before anything else; what unassigned bytes cannot cover is taken from
one donor, a group without demand holding more than its floor (the largest surplus first).
One transfer per pool at a time: while a donor shrinks, no other donor is asked. A group is
charged for the larger of its target and what it still backs, so bytes are never promised twice
while a release is under way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GroupState:
    name: str
    block_bytes: int
    floor_blocks: int
    ceiling_blocks: int
    target_blocks: int
    backed_blocks: int
    demand_blocks: int
    deadline: float
    """Earliest deadline (unix time) of the group's blocked work; 0: none."""

    @property
    def charged_blocks(self) -> int:
        return max(self.target_blocks, self.backed_blocks)

    @property
    def shrinking(self) -> bool:
        return self.backed_blocks > self.target_blocks


def _urgency(group: GroupState) -> float:
    return group.deadline if group.deadline > 0 else math.inf


def arbitrate(budget_bytes: int, groups: list[GroupState]) -> dict[str, int]:
    """New targets (blocks) of the groups whose target changes this round."""
    targets = {g.name: g.target_blocks for g in groups}
    free = budget_bytes - sum(g.charged_blocks * g.block_bytes for g in groups)
    transfer = any(g.shrinking for g in groups)
    needy = sorted((g for g in groups if g.demand_blocks > 0 and g.target_blocks < g.ceiling_blocks), key=_urgency)
    for g in needy:
        want = min(g.demand_blocks, g.ceiling_blocks - g.target_blocks)
        grant = min(want, max(free, 0) // g.block_bytes)
        targets[g.name] += grant
        free -= grant * g.block_bytes
        want -= grant
        if want == 0 or transfer:
            continue
        donors = [
            d
            for d in groups
            if d.demand_blocks == 0 and not d.shrinking and targets[d.name] > d.floor_blocks and d.name != g.name
        ]
        if not donors:
            continue
        donor = max(donors, key=lambda d: (targets[d.name] - d.floor_blocks) * d.block_bytes)
        take = min(-(-want * g.block_bytes // donor.block_bytes), targets[donor.name] - donor.floor_blocks)
        targets[donor.name] -= take
        transfer = True
    return {g.name: targets[g.name] for g in groups if targets[g.name] != g.target_blocks}
