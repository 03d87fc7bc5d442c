"""The members of one generation: who is expected, who registered, heartbeats and liveness.

Every process of a generation registers once with the daemon, proving it resolved the same
plan (its fingerprint). A slot that the plan does not have, a second registration for a slot,
another plan or another generation are refused with the reason (HTTP 409).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from crosspool.cpus import descends_from
from crosspool.ipc import Peer
from crosspool.metrics import MemberMetrics
from crosspool.plan import Plan

Role = Literal["AtnAgent", "FfnAgent", "rank", "front"]
Text = Annotated[str, Field(max_length=64)]
Generation = Annotated[int, Field(ge=1, le=2**31)]


class MemberRef(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    role: Role
    id: Text
    """Agent id; for a rank its model id; "front" for the front endpoint."""
    rank: int = Field(0, ge=0, le=4096)
    generation: Generation

    @property
    def slot(self) -> tuple[str, str, int]:
        return (self.role, self.id, self.rank)


class Registration(MemberRef):
    pid: int = Field(ge=1, le=2**22)
    fingerprint: Text


class Heartbeat(MemberRef):
    seq: int = Field(ge=0, le=2**62)
    metrics: MemberMetrics = Field(default_factory=MemberMetrics)


class FailureReport(MemberRef):
    reason: str = Field(max_length=2000)


@dataclass(frozen=True)
class Death:
    """A member lost: how it was noticed (the failure kind counted in metrics) and the reason."""

    kind: Literal["exit", "heartbeat"]
    reason: str
    slot: tuple[str, str, int]


class Refused(Exception):
    """Registration or heartbeat refused; the text is the reason returned with HTTP 409."""


def slot_name(role: str, ident: str, rank: int) -> str:
    if role == "rank":
        return f"Instance '{ident}' rank {rank}"
    if role == "front":
        return "front endpoint"
    return f"{role} '{ident}'"


def expected_slots(plan: Plan) -> list[tuple[str, str, int]]:
    return [
        *(("AtnAgent", a, 0) for a in plan.atn_agents),
        *(("FfnAgent", a.id, 0) for a in plan.ffn_agents),
        *(("rank", model, rank) for model, rank in plan.rank_slots()),
        ("front", "front", 0),
    ]


@dataclass
class Member:
    slot: tuple[str, str, int]
    pid: int
    peer: Peer
    registered: float
    last_seen: float
    seq: int = -1  # the heartbeat watermark: a heartbeat must carry a larger seq
    metrics: MemberMetrics | None = None

    @property
    def name(self) -> str:
        return slot_name(*self.slot)


@dataclass
class Registry:
    plan: Plan
    members: dict[tuple[str, str, int], Member] = field(default_factory=dict)

    @property
    def expected(self) -> list[tuple[str, str, int]]:
        return expected_slots(self.plan)

    def _check_generation(self, ref: MemberRef) -> None:
        if ref.generation != self.plan.generation:
            raise Refused(
                f"{slot_name(*ref.slot)} belongs to generation {ref.generation}; "
                f"the current generation is {self.plan.generation}"
            )

    def register(self, reg: Registration) -> Member:
        self._check_generation(reg)
        if reg.slot not in self.expected:
            known = ", ".join(slot_name(*s) for s in self.expected)
            raise Refused(f"{slot_name(*reg.slot)} is not a member of this deployment (members: {known})")
        if reg.fingerprint != self.plan.fingerprint():
            raise Refused(
                f"{slot_name(*reg.slot)} resolved plan {reg.fingerprint!r}, the daemon's is "
                f"{self.plan.fingerprint()!r} (config digest {self.plan.digest}): not the same deployment"
            )
        held = self.members.get(reg.slot)
        if held is not None:
            raise Refused(f"{held.name} is already registered by pid {held.pid}")
        if descends_from(reg.pid, os.getpid()) is False:
            raise Refused(f"{slot_name(*reg.slot)}: pid {reg.pid} was not started by this daemon")
        now = time.monotonic()
        member = Member(reg.slot, reg.pid, Peer(reg.role, reg.id, reg.pid), now, now)
        self.members[reg.slot] = member
        return member

    def heartbeat(self, hb: Heartbeat) -> tuple[Member, MemberMetrics | None]:
        """Record a heartbeat; returns the member and its previous metrics."""
        self._check_generation(hb)
        member = self.members.get(hb.slot)
        if member is None:
            raise Refused(f"{slot_name(*hb.slot)} is not registered")
        if hb.seq <= member.seq:
            raise Refused(f"{member.name}: heartbeat {hb.seq} is not after {member.seq}")
        previous = member.metrics
        member.seq, member.last_seen, member.metrics = hb.seq, time.monotonic(), hb.metrics
        return member, previous

    def forget(self, slots: list[tuple[str, str, int]]) -> None:
        """Members that failed alone and will be started again: their slots can be registered anew."""
        for slot in slots:
            self.members.pop(slot, None)

    def missing(self) -> list[str]:
        return [slot_name(*s) for s in self.expected if s not in self.members]

    def first_dead(
        self, heartbeat_timeout_s: float, serving: set[str], skip: Callable[[tuple[str, str, int]], bool]
    ) -> Death | None:
        """A registered member that exited or went silent. A rank's silence counts once its
        Instance serves (`serving`: model ids): while an engine starts, compiling ranks can hold
        the GIL past the timeout (seen with 4 vLLM DP workers compiling on 2 cores), and the
        startup deadline bounds that phase. Members that `skip` names (restarting) are not looked at."""
        now = time.monotonic()
        for member in self.members.values():
            if skip(member.slot):
                continue
            if not member.peer.alive():
                return Death("exit", f"{member.name} (pid {member.pid}) exited", member.slot)
            role, model, _ = member.slot
            if role == "rank" and model not in serving:
                continue
            if now - member.last_seen > heartbeat_timeout_s:
                silent = now - member.last_seen
                return Death(
                    "heartbeat", f"{member.name} (pid {member.pid}) sent no heartbeat for {silent:.1f} s", member.slot
                )
        return None
