"""The daemon's control API (loopback only): registration, heartbeats, failures, readiness,
status and Prometheus metrics. Members talk to it; it is never on the per-layer path."""

from __future__ import annotations

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
from crosspool.member import new_secret
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
    state: Literal["starting", "serving", "failed", "stopped"]
    engine: str
    url: str
    ffn_agents: list[str]


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
            self.models_ready = set()
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

    def accepted(self) -> Accepted:
        return Accepted(
            generation=self.plan.generation,
            phase=self.phase,
            failure=self.failure,
            heartbeat_interval_s=self.plan.heartbeat_interval_s,
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
                    state="serving"
                    if m.id in self.models_ready and self.phase == "ready"
                    else state.get(self.phase, "stopped"),  # type: ignore[arg-type]
                    engine=m.engine,
                    url=m.url,
                    ffn_agents=m.agents(),
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
            body: dict[str, Any] = {
                "ready": state.phase == "ready",
                "phase": state.phase,
                "generation": state.plan.generation,
            }
            if state.phase != "ready":
                body["waiting_for"] = missing + [f"Instance '{m}' HTTP listener" for m in engines]
                if state.failure:
                    body["failure"] = state.failure
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
        """A registered member reports a fatal error (e.g. a protocol error); the first failure wins."""
        with state.lock:
            member = state.registry.members.get(report.slot)
            if member is None or report.generation != state.plan.generation:
                return _refused(f"{slot_name(*report.slot)} is not a registered member of the current generation")  # type: ignore[return-value]
        state.fail(f"{member.name} reported: {report.reason}", "reported")
        return state.accepted()

    return app
