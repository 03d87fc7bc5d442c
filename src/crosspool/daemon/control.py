"""The daemon's control API (loopback only): registration, heartbeats, failures, readiness,
status and Prometheus metrics. Members talk to it; it is never on the per-layer path."""

from __future__ import annotations

import math
import secrets
import threading
import time
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import BaseModel

from crosspool.bodylimit import BodyLimit
from crosspool.daemon.kv import KvPools, KvPoolStatus
from crosspool.daemon.registry import FailureReport, Heartbeat, Refused, Registration, Registry, slot_name
from crosspool.daemon.supervisor import log
from crosspool.member import InstanceDown, new_secret
from crosspool.metrics import DeploymentMetrics
from crosspool.plan import Plan

Phase = Literal["starting", "ready", "failed", "stopping", "stopped"]


class MemberStatus(BaseModel):
    role: str
    id: str
    rank: int
    name: str
    registered: bool
    pid: int | None
    heartbeat_age_s: float | None


class ModelStatus(BaseModel):
    state: Literal["starting", "serving", "restarting", "failed", "stopped"]
    engine: str
    url: str
    ffn_agents: list[str]
    failure: str | None = None
    """Why the Instance is restarting (state "restarting")."""
    restarts: int = 0
    """How often the Instance was restarted alone (not counting generation restarts)."""


class Status(BaseModel):
    deployment: str
    digest: str
    generation: int
    phase: Phase
    failure: str | None
    restarts: int
    endpoint: str
    members: list[MemberStatus]
    models: dict[str, ModelStatus]


class Accepted(BaseModel):
    generation: int
    phase: Phase
    failure: str | None
    heartbeat_interval_s: float
    down: dict[str, InstanceDown] = {}
    """Models whose Instance is restarting (the rest of the deployment serves)."""


class ControlState:
    """What the control API shows and changes; the daemon's generation loop drives the phase."""

    def __init__(self, plan: Plan, endpoint: str, heartbeat_timeout_s: float) -> None:
        self.lock = threading.Lock()
        self.registry = Registry(plan)
        self.endpoint = endpoint
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.phase: Phase = "starting"
        self.failure: str | None = None
        self.failure_kind: str | None = None
        self.restarts = 0
        self.models_ready: set[str] = set()
        self.down: dict[str, InstanceDown] = {}
        self.reports: list[tuple[str, tuple[str, str, int]]] = []
        """Failures members reported (reason, slot), for the generation's watch loop to act on."""
        self.instance_restarts = dict.fromkeys((m.id for m in plan.models), 0)
        self.metrics = DeploymentMetrics([m.id for m in plan.models])
        self.metrics.generation = plan.generation
        self.changed = threading.Condition(self.lock)
        self.kv: KvPools | None = None
        """The current generation's elastic KV pools (None: no attention device has kv_budget_gib)."""
        self.secret = new_secret()
        """The current generation's member secret (member.SECRET_FILE): a new one each generation."""

    @property
    def plan(self) -> Plan:
        return self.registry.plan

    def new_generation(self, plan: Plan) -> None:
        with self.lock:
            self.registry = Registry(plan)
            self.secret = new_secret()
            self.phase, self.failure, self.failure_kind = "starting", None, None
            self.models_ready, self.down, self.reports = set(), {}, []
            self.metrics.generation = plan.generation
            self.changed.notify_all()

    def set_phase(self, phase: Phase) -> None:
        with self.lock:
            self.phase = phase
            self.changed.notify_all()

    def fail(self, reason: str, kind: str) -> bool:
        """Record the generation's failure; the first one wins (returns whether this one did)."""
        with self.lock:
            if self.failure is not None:
                return False
            self.failure, self.failure_kind, self.phase = reason, kind, "failed"
            self.metrics.failed(kind)
            self.changed.notify_all()
        log(f"failure: {reason}")
        return True

    def fail_instances(
        self, models: tuple[str, ...], agents: tuple[str, ...], reason: str, kind: str, retry_after_s: float
    ) -> None:
        """Instances that failed alone (with the FfnAgents to start again): their members leave the
        registry, the front answers their models with 503 until `instance_serving`."""
        with self.lock:
            assert not any(m in self.down for m in models), (models, self.down)
            down = InstanceDown(reason=reason, retry_after_s=max(1, math.ceil(retry_after_s)))
            for model in models:
                self.down[model] = down
                self.models_ready.discard(model)
            self._forget(models, agents)
            self.metrics.failed(kind)
            self.changed.notify_all()
        log(f"failure: {reason}; restarting {', '.join(f'Instance {m!r}' for m in models)} alone")

    def _forget(self, models: tuple[str, ...], agents: tuple[str, ...]) -> None:
        self.registry.forget(
            [slot for slot in self.registry.members if slot[0] == "rank" and slot[1] in models]
            + [("FfnAgent", agent, 0) for agent in agents]
        )

    def forget(self, models: tuple[str, ...], agents: tuple[str, ...]) -> None:
        """A restart that failed: its members register anew on the next try."""
        with self.lock:
            self._forget(models, agents)

    def instance_serving(self, models: tuple[str, ...]) -> None:
        with self.lock:
            for model in models:
                del self.down[model]
                self.models_ready.add(model)
                self.instance_restarts[model] += 1
            self.changed.notify_all()

    def accepted(self) -> Accepted:
        with self.lock:
            down = dict(self.down)
        return Accepted(
            generation=self.plan.generation,
            phase=self.phase,
            failure=self.failure,
            heartbeat_interval_s=self.plan.heartbeat_interval_s,
            down=down,
        )

    def status(self) -> Status:
        with self.lock:
            now = time.monotonic()
            reg = self.registry
            members = []
            for slot in reg.expected:
                m = reg.members.get(slot)
                members.append(
                    MemberStatus(
                        role=slot[0],
                        id=slot[1],
                        rank=slot[2],
                        name=slot_name(*slot),
                        registered=m is not None,
                        pid=m.pid if m else None,
                        heartbeat_age_s=round(now - m.last_seen, 3) if m else None,
                    )
                )
            state = {"starting": "starting", "ready": "serving", "failed": "failed", "stopping": "serving"}
            models = {
                m.id: ModelStatus(
                    state="restarting"
                    if m.id in self.down and self.phase == "ready"
                    else "serving"
                    if m.id in self.models_ready and self.phase == "ready"
                    else state.get(self.phase, "stopped"),  # type: ignore[arg-type]
                    engine=m.engine,
                    url=m.url,
                    ffn_agents=m.agents(),
                    failure=self.down[m.id].reason if m.id in self.down else None,
                    restarts=self.instance_restarts[m.id],
                )
                for m in self.plan.models
            }
            return Status(
                deployment=self.plan.deployment,
                digest=self.plan.digest,
                generation=self.plan.generation,
                phase=self.phase,
                failure=self.failure,
                restarts=self.restarts,
                endpoint=self.endpoint,
                members=members,
                models=models,
            )


def _refused(reason: str) -> JSONResponse:
    return JSONResponse({"detail": reason}, status_code=409)


_BEARER = HTTPBearer(auto_error=False)  # at module level: FastAPI resolves the annotation below here


def create_control_app(state: ControlState) -> FastAPI:
    def member(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)]) -> None:
        """The member-facing endpoints: the caller holds the current generation's member secret,
        or nothing changes (401)."""
        given = "" if credentials is None else credentials.credentials
        if not secrets.compare_digest(given.encode(), state.secret.encode()):
            raise HTTPException(401, "not a member of the current generation (member secret missing or wrong)")

    app = FastAPI(
        title="CrossPool daemon",
        summary="Control API of one CrossPool deployment: members register and send heartbeats; "
        "operators read readiness, status and metrics.",
        version="1",
    )
    app.add_middleware(BodyLimit, max_bytes=state.plan.max_request_bytes)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(state.metrics)  # type: ignore[arg-type]
    refusal = {
        401: {"description": "no or a wrong member secret"},
        409: {"description": "refused, with the reason", "model": dict[str, str]},
    }

    @app.get("/health")
    def health() -> dict[str, str]:
        """The daemon process answers (says nothing about the deployment: see /ready)."""
        return {"status": "ok"}

    @app.get("/ready", responses={503: {"description": "not ready, with what is missing"}})
    def ready() -> JSONResponse:
        with state.lock:
            missing = state.registry.missing()
            engines = [m.id for m in state.plan.models if m.id not in state.models_ready]
            restarting = [f"Instance '{m}' (restarting after: {down.reason})" for m, down in state.down.items()]
            body: dict[str, Any] = {
                "ready": state.phase == "ready" and not restarting,
                "phase": state.phase,
                "generation": state.plan.generation,
            }
            if state.phase != "ready":
                body["waiting_for"] = missing + [f"Instance '{m}' HTTP listener" for m in engines]
                if state.failure:
                    body["failure"] = state.failure
            elif restarting:
                body["waiting_for"] = restarting
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @app.get("/status")
    def status() -> Status:
        return state.status()

    @app.get("/v1/kv")
    def kv() -> list[KvPoolStatus]:
        """Elastic KV: per attention device with kv_budget_gib, what each KV Capacity Group backs,
        uses and needs (empty without elastic KV)."""
        pools = state.kv
        return [] if pools is None else pools.status()

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry).decode(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/members", responses=refusal, dependencies=[Depends(member)])  # type: ignore[arg-type]
    def register(reg: Registration) -> Accepted:
        """A member of the current generation registers (once per slot)."""
        with state.lock:
            try:
                if state.phase not in ("starting", "ready"):
                    raise Refused(f"generation {state.plan.generation} is {state.phase}: no member may join")
                state.registry.register(reg)
            except Refused as e:
                return _refused(str(e))  # type: ignore[return-value]
            state.changed.notify_all()
        return state.accepted()

    @app.post("/v1/heartbeats", responses=refusal, dependencies=[Depends(member)])  # type: ignore[arg-type]
    def heartbeat(hb: Heartbeat) -> Accepted:
        with state.lock:
            try:
                _, previous = state.registry.heartbeat(hb)
            except Refused as e:
                return _refused(str(e))  # type: ignore[return-value]
            state.metrics.add(hb.id, previous, hb.metrics)
        return state.accepted()

    @app.post("/v1/failures", responses=refusal, dependencies=[Depends(member)])  # type: ignore[arg-type]
    def failure(report: FailureReport) -> Accepted:
        """A registered member reports a fatal error (e.g. a protocol error): the daemon's watch
        loop fails what it takes down (its Instances, or the generation)."""
        with state.lock:
            member = state.registry.members.get(report.slot)
            if member is None or report.generation != state.plan.generation:
                return _refused(f"{slot_name(*report.slot)} is not a registered member of the current generation")  # type: ignore[return-value]
            state.reports.append((f"{member.name} reported: {report.reason}", report.slot))
            state.changed.notify_all()
        return state.accepted()

    return app
