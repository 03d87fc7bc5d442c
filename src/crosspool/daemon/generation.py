"""One Generation of a deployment: start its members in order, watch them, fence, retire.

Start order: AtnAgents (mailboxes created), FfnAgents (weights loaded, inboxes created), engines
(each rank attaches its mailbox and registers while the model is built), the front endpoint.
Each member counts as started when it registered with the daemon; an engine also when its
/health answers 200. A vLLM whose plugin did not load never registers its rank, and the
generation refuses to become ready.

Retire order: the front stops taking requests, in-flight ones end (or fail), then engines, the
front, AtnAgents, FfnAgents stop (SIGTERM, SIGKILL past the grace) and the generation's shared
memory is unlinked.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

from crosspool import envs
from crosspool.config import Deployment
from crosspool.daemon.control import ControlState
from crosspool.daemon.supervisor import Supervisor, log
from crosspool.integrations import launcher
from crosspool.ipc import SegmentMissing, Stop
from crosspool.plan import Plan
from crosspool.transport.mailbox import Mailbox

STOP_ENGINE, STOP_FRONT, STOP_ATN, STOP_FFN = 0, 1, 2, 3
WATCH_S = 0.1


class StartupError(RuntimeError):
    pass


class Generation:
    def __init__(self, deployment: Deployment, plan: Plan, state: ControlState, stop: Stop) -> None:
        self.deployment, self.plan, self.state, self.stop = deployment, plan, state, stop
        self.sup = Supervisor(plan.shm_prefix)
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"crosspool-{plan.token}-"))
        self.plan_path = self.run_dir / "plan.json"
        self.plan_path.write_text(plan.model_dump_json(indent=1))

    def log(self, message: str) -> None:
        log(f"generation {self.plan.generation}: {message}")

    # -- start ---------------------------------------------------------------------------------

    def start(self) -> None:
        deadline = time.monotonic() + self.deployment.limits.startup_timeout_s
        self.start_pool(deadline)
        self.start_engines(deadline)
        self.start_front(deadline)
        self.state.set_phase("ready")

    def _check(self, deadline: float, what: str) -> None:
        if self.stop.is_set():
            raise StartupError("interrupted during startup")
        if time.monotonic() > deadline:
            raise StartupError(
                f"{what} not ready within limits.startup_timeout_s = {self.deployment.limits.startup_timeout_s:g}"
            )
        reason = self.failure()
        if reason is not None:
            raise StartupError(f"{reason} during startup")

    def _wait_registered(self, slot: tuple[str, str, int], what: str, deadline: float) -> None:
        while True:
            self._check(deadline, what)
            with self.state.lock:
                if slot in self.state.registry.members:
                    return
                self.state.changed.wait(WATCH_S)

    def _start_agent(self, role: str, module: str, agent_id: str, stop_order: int) -> None:
        argv = [sys.executable, "-m", f"crosspool.agents.{module}", "--plan", str(self.plan_path), "--id", agent_id]
        self.sup.start(f"{role} '{agent_id}'", argv, envs.sharing_cores(os.environ), stop_order=stop_order)

    def start_pool(self, deadline: float) -> None:
        """AtnAgents (mailboxes), then FfnAgents (weights, inbox): after this the pool executes calls.
        FfnAgents start together: each spends most of its start importing its engine's kernels."""
        for atn in self.plan.atn_agents:
            self._start_agent("AtnAgent", "atn_agent", atn, STOP_ATN)
            self._wait_registered(("AtnAgent", atn, 0), f"AtnAgent '{atn}'", deadline)
        for agent in self.plan.ffn_agents:
            self._start_agent("FfnAgent", "ffn_agent", agent.id, STOP_FFN)
        for agent in self.plan.ffn_agents:
            self._wait_registered(("FfnAgent", agent.id, 0), f"FfnAgent '{agent.id}'", deadline)

    def start_engines(self, deadline: float) -> None:
        d = self.deployment
        for model in d.model:
            engine = launcher(model.engine)
            port = int(self.plan.model(model.id).url.rsplit(":", 1)[1])
            argv = engine.server_command(model, d.limits.max_batched_tokens, d.host, port)
            env = engine.engine_env(model, self.plan_path)
            self.sup.start(f"Instance '{model.id}'", argv, env, stop_order=STOP_ENGINE)
        for model in d.model:
            self._wait_engine(model.id, deadline)

    def _wait_engine(self, model_id: str, deadline: float) -> None:
        what = f"Instance '{model_id}'"
        url = self.plan.model(model_id).url
        ranks = [("rank", model_id, rank) for model_id_, rank in self.plan.rank_slots() if model_id_ == model_id]
        with httpx.Client(timeout=2.0) as client:
            while True:
                self._check(deadline, what)
                try:
                    healthy = client.get(url + "/health").status_code == 200
                except httpx.HTTPError:
                    healthy = False
                if healthy:
                    with self.state.lock:
                        attached = all(r in self.state.registry.members for r in ranks)
                        if attached:
                            self.state.models_ready.add(model_id)
                    if not attached:
                        raise StartupError(
                            f"{what} is serving but its ranks never registered with the FFN pool: the CrossPool "
                            "plugin is not active in the engine (is crosspool installed in the engine's environment?)"
                        )
                    return
                time.sleep(0.5)

    def start_front(self, deadline: float) -> None:
        argv = [
            *(sys.executable, "-m", "crosspool.front.server", "--plan", str(self.plan_path)),
            *("--grace-s", str(self.deployment.limits.shutdown_grace_s)),
        ]
        self.sup.start("front endpoint", argv, dict(os.environ), stop_order=STOP_FRONT)
        self._wait_registered(("front", "front", 0), "front endpoint", deadline)
        with httpx.Client(timeout=2.0) as client:
            while True:
                self._check(deadline, "front endpoint")
                try:
                    if client.get(f"http://{self.plan.host}:{self.plan.port}/v1/models").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)

    # -- watch and retire ----------------------------------------------------------------------

    def failure(self) -> str | None:
        """The first failure of this generation, recorded in the control state; None while healthy."""
        dead = self.sup.exited()
        if dead is not None:
            errors = dead.errors or self.sup.agent_errors()
            cause = f" ({errors[0]})" if errors else ""
            self.state.fail(f"{dead.name} {dead.exit_text()}{cause}", "exit")
        else:
            with self.state.lock:
                death = self.state.registry.first_dead(
                    self.deployment.limits.heartbeat_timeout_s, self.state.models_ready
                )
            if death is not None:
                self.state.fail(death.reason, death.kind)
        if self.state.failure is not None:
            self.fence(self.state.failure)
        return self.state.failure

    def supervise(self) -> str | None:
        """Block until a stop request (None) or the first failure (its reason)."""
        while not self.stop.wait(WATCH_S):
            reason = self.failure()
            if reason is not None:
                return reason
        return None

    def fence(self, reason: str) -> None:
        """Admit no more FFN work: every rank's current and next call fails with the failure."""
        for mplan in self.plan.mailboxes:
            try:
                Mailbox.open(mplan.name).fence(f"FFN pool failed: {reason}")
            except SegmentMissing:
                continue  # never created: nobody can be waiting on it

    def drain(self, grace_s: float) -> None:
        """Let the front's in-flight requests end (finish, or fail once fenced), at most `grace_s`."""
        end = time.monotonic() + grace_s + self.plan.heartbeat_interval_s
        seen_after = time.monotonic()
        while time.monotonic() < end:
            with self.state.lock:
                front = self.state.registry.members.get(("front", "front", 0))
                if front is None or (
                    front.last_seen > seen_after and front.metrics is not None and not front.metrics.inflight
                ):
                    return
            time.sleep(0.05)
        self.log(f"requests still in flight after {grace_s:g} s; stopping anyway")

    def close(self) -> None:
        self.sup.stop_all(self.deployment.limits.shutdown_grace_s)
        shutil.rmtree(self.run_dir, ignore_errors=True)
