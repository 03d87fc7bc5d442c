"""A member's link to the daemon: register once, send heartbeats (with metrics), report failures.

Every member registers and reports failures here. HTTP heartbeats are for the members off the
layer-call path (the AtnAgents, the front); ranks and FfnAgents beat in shared memory instead
(`RankTransport.heartbeat`, `Inbox.heartbeat`). A member that cannot register does not start; a
heartbeat that does not get through is retried at the next interval (the daemon declares the
member dead when they stay away).
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
from pydantic import BaseModel

from crosspool.metrics import MemberMetrics
from crosspool.plan import Plan

REQUEST_TIMEOUT_S = 5.0
SECRET_FILE = "member-secret"
"""Beside a generation's plan file, mode 0600 in the generation's 0700 run directory: the
generation's member secret, which every member-facing endpoint of the control API requires."""


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def write_secret(plan_path: Path, secret: str) -> None:
    fd = os.open(plan_path.with_name(SECRET_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)


def load_membership(plan_path: Path) -> tuple[Plan, str]:
    """A member's plan and the generation's member secret, both from the files the daemon wrote."""
    plan = Plan.model_validate_json(plan_path.read_text())
    return plan, plan_path.with_name(SECRET_FILE).read_text()


class InstanceDown(BaseModel):
    """An Instance that failed alone and is restarting (the daemon's answers carry them): the
    front answers its model with 503 and Retry-After."""

    reason: str
    retry_after_s: int
    """When the Instance is expected back: the restart's backoff and the Instance's last start time."""


class ControlError(RuntimeError):
    """The daemon could not be asked, or said no."""


class DaemonUnreachable(ControlError):
    pass


class DaemonRefused(ControlError):
    """HTTP 409 (or another error status) with the daemon's reason."""


class ControlClient:
    def __init__(self, plan: Plan, secret: str, role: str, ident: str, rank: int = 0) -> None:
        self.plan = plan
        self.ref = {"role": role, "id": ident, "rank": rank, "generation": plan.generation}
        self.http = httpx.Client(
            base_url=plan.control_url, timeout=REQUEST_TIMEOUT_S, headers={"Authorization": f"Bearer {secret}"}
        )
        self.phase = "starting"
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        """Called once, from the thread that learnt it, when the daemon first answers with a failure."""
        self.down: dict[str, InstanceDown] = {}
        """Models whose Instance is restarting alone, as of the daemon's last answer."""
        self.on_down: Callable[[list[str]], None] | None = None
        """Called, from the thread that learnt it, with the models that newly went down."""
        self._stop = threading.Event()

    def _post(self, path: str, body: dict) -> dict:
        try:
            r = self.http.post(path, json={**self.ref, **body})
        except httpx.HTTPError as e:
            raise DaemonUnreachable(f"CrossPool daemon at {self.plan.control_url} unreachable: {e}") from None
        if r.status_code != 200:
            detail = r.json().get("detail") if r.headers.get("content-type") == "application/json" else r.text
            raise DaemonRefused(f"CrossPool daemon refused {path}: HTTP {r.status_code}: {detail}")
        answer: dict = r.json()
        first = self.failure is None and answer["failure"] is not None
        self.phase, self.failure = answer["phase"], answer["failure"]
        down = {model: InstanceDown.model_validate(d) for model, d in answer.get("down", {}).items()}
        went_down = [model for model in down if model not in self.down]
        self.down = down
        if first and self.on_failure is not None:
            self.on_failure(answer["failure"])
        if went_down and self.on_down is not None:
            self.on_down(went_down)
        return answer

    def register(self) -> None:
        self._post("/v1/members", {"pid": os.getpid(), "fingerprint": self.plan.fingerprint()})

    def report_failure(self, reason: str) -> None:
        try:
            self._post("/v1/failures", {"reason": reason[:2000]})
        except ControlError as e:
            print(f"crosspool: could not report failure to the daemon: {e}", file=sys.stderr, flush=True)

    def start_heartbeats(self, metrics: Callable[[], MemberMetrics] = MemberMetrics) -> None:
        def beat() -> None:
            seq = 0
            while not self._stop.wait(self.plan.heartbeat_interval_s):
                seq += 1
                try:
                    self._post("/v1/heartbeats", {"seq": seq, "metrics": metrics().model_dump()})
                except ControlError:
                    continue  # the daemon decides what silence means

        threading.Thread(target=beat, name="crosspool-heartbeat", daemon=True).start()

    def close(self) -> None:
        self._stop.set()
