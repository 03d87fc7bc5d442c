"""`crosspool serve`: start every member of a deployment, wait until it is ready, serve, stop.

Start order: AtnAgents (mailboxes created), FfnAgents (weights loaded, inboxes created), engines
(each rank attaches its mailbox while the model is built), then the front endpoint. Ready means every
member is alive, each FFN agent and AtnAgent reported ready, every engine answers /health and
every Instance rank attached its Transport (proof the plugin is active: a vLLM that silently
failed to load the plugin never attaches). The first failure wins and stops the deployment.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI

from crosspool.config import Deployment
from crosspool.daemon.front import create_front
from crosspool.daemon.supervisor import Member, Supervisor, bind_port
from crosspool.integrations import launcher
from crosspool.plan import Plan
from crosspool.transport.mailbox import Mailbox

STOP_ENGINE, STOP_ATN, STOP_FFN = 0, 1, 2


def _agent_env() -> dict[str, str]:
    # libgomp threads spin after each parallel region by default; on a shared CPU host that spin
    # takes the core the rank or the other agent needs next. Agents' threads sleep instead.
    return {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}


class StartupError(RuntimeError):
    pass


def _agent_argv(module: str, plan_path: Path, agent_id: str) -> list[str]:
    return [sys.executable, "-m", f"crosspool.agents.{module}", "--plan", str(plan_path), "--id", agent_id]


def _check_port_free(host: str, port: int) -> None:
    try:
        bind_port(host, port)
    except OSError as e:
        raise StartupError(f"port {port} on {host} is not free: {e.strerror}") from None


class RunningDeployment:
    """One running generation of a deployment (members, front, failure)."""

    def __init__(self, deployment: Deployment, plan: Plan) -> None:
        self.deployment, self.plan = deployment, plan
        self.sup = Supervisor(plan.shm_prefix)
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"crosspool-{plan.token}-"))
        self.plan_path = self.run_dir / "plan.json"
        self.plan_path.write_text(plan.model_dump_json(indent=1))
        self.stop = threading.Event()
        self.engines: dict[str, tuple[Member, str]] = {}
        self.front: uvicorn.Server | None = None
        self.front_app: FastAPI | None = None

    def _deadline_check(self, deadline: float, what: str) -> None:
        if self.stop.is_set():
            raise StartupError("interrupted during startup")
        if time.monotonic() > deadline:
            raise StartupError(
                f"{what} not ready within limits.startup_timeout_s = {self.deployment.limits.startup_timeout_s:g}"
            )
        dead = self.sup.exited()
        if dead is not None:
            errors = self.sup.agent_errors()
            raise StartupError(f"{dead.name} {dead.exit_text()} during startup" + (f": {errors[-1]}" if errors else ""))

    def start(self) -> None:
        deadline = time.monotonic() + self.deployment.limits.startup_timeout_s
        _check_port_free(self.deployment.host, self.deployment.port)
        self.start_pool(deadline)
        self.start_engines(deadline)
        self._start_front(deadline)

    def start_pool(self, deadline: float) -> None:
        """AtnAgents (mailboxes), then FfnAgents (weights, inbox): after this the pool executes calls."""
        plan = self.plan
        for atn in plan.atn_agents:
            self._start_agent(f"AtnAgent '{atn}'", "atn_agent", atn, STOP_ATN, deadline)
        for agent in plan.ffn_agents:
            self._start_agent(f"FfnAgent '{agent.id}'", "ffn_agent", agent.id, STOP_FFN, deadline)

    def _start_agent(self, name: str, module: str, agent_id: str, stop_order: int, deadline: float) -> None:
        member, fd = self.sup.start(
            name, _agent_argv(module, self.plan_path, agent_id), _agent_env(), stop_order=stop_order, ready_pipe=True
        )
        assert fd is not None
        self.sup.wait_ready_pipe(member, fd, deadline)

    def start_engines(self, deadline: float) -> None:
        d = self.deployment
        for model in d.model:
            engine = launcher(model.engine)
            port = bind_port(d.host)
            argv = engine.server_command(model, d.limits.max_batched_tokens, d.host, port)
            member, _ = self.sup.start(
                f"vLLM instance '{model.id}'", argv, engine.engine_env(model, self.plan_path), stop_order=STOP_ENGINE
            )
            self.engines[model.id] = (member, f"http://{d.host}:{port}")
        for model_id, (_, url) in self.engines.items():
            self._wait_engine(model_id, url, deadline)

    def _wait_engine(self, model_id: str, url: str, deadline: float) -> None:
        mailboxes = [Mailbox.open(mb.name) for mb in self.plan.mailboxes_of(model_id)]
        with httpx.Client(timeout=2.0) as client:
            while True:
                self._deadline_check(deadline, f"vLLM instance '{model_id}'")
                try:
                    healthy = client.get(url + "/health").status_code == 200
                except httpx.HTTPError:
                    healthy = False
                if healthy:
                    if not all(mb.rank_attached() for mb in mailboxes):
                        raise StartupError(
                            f"vLLM instance '{model_id}' is serving but its ranks never attached to the FFN pool: "
                            "the CrossPool vLLM plugin is not active in the engine "
                            "(is crosspool installed in the engine's environment?)"
                        )
                    return
                time.sleep(0.5)

    def _start_front(self, deadline: float) -> None:
        d = self.deployment
        upstreams = {model_id: url for model_id, (_, url) in self.engines.items()}
        app = create_front(upstreams, lambda: self.sup.failure, request_timeout_s=600.0)
        self.front_app = app
        self.front = uvicorn.Server(uvicorn.Config(app, host=d.host, port=d.port, log_level="warning", lifespan="on"))
        thread = threading.Thread(target=self.front.run, name="front", daemon=True)
        thread.start()
        while not self.front.started:
            self._deadline_check(deadline, "front endpoint")
            if not thread.is_alive():
                raise StartupError(f"front endpoint could not listen on {d.host}:{d.port}")
            time.sleep(0.05)

    def supervise(self) -> None:
        """Block until a signal or the first member failure."""
        while not self.stop.wait(0.1):
            dead = self.sup.exited()
            if dead is not None:
                errors = self.sup.agent_errors()
                cause = f" ({errors[0]})" if errors and dead.stop_order == STOP_ENGINE else ""
                self.sup.fail(f"{dead.name} {dead.exit_text()}{cause}")
                self.fence()
                return

    def fence(self) -> None:
        """Admit no more FFN work: every rank's current and next call fails with the failure."""
        reason = f"FFN pool failed: {self.sup.failure}"
        for mplan in self.plan.mailboxes:
            try:
                Mailbox.open(mplan.name).fence(reason)
            except RuntimeError:
                continue  # never created: nobody can be waiting on it

    def drain(self, grace_s: float) -> None:
        """Stop accepting; let in-flight requests finish or fail, at most `grace_s`."""
        if self.front_app is None:
            return
        self.front_app.state.accepting = False
        end = time.monotonic() + grace_s
        while self.front_app.state.inflight > 0 and time.monotonic() < end:
            time.sleep(0.05)

    def close(self) -> None:
        if self.front is not None:
            self.front.should_exit = True
        self.sup.stop_all(self.deployment.limits.shutdown_grace_s)
        shutil.rmtree(self.run_dir, ignore_errors=True)


def serve(deployment: Deployment, plan: Plan) -> int:
    """Run the deployment until SIGINT/SIGTERM (exit 0) or the first failure (exit 1)."""
    run = RunningDeployment(deployment, plan)
    previous = {sig: signal.signal(sig, lambda *_: run.stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    started = time.monotonic()
    code = 1
    try:
        run.start()
        d = deployment
        print(
            f"crosspool: ready in {time.monotonic() - started:.1f} s: http://{d.host}:{d.port}/v1 serving "
            f"{', '.join(m.id for m in d.model)} (generation {plan.generation})",
            flush=True,
        )
        run.supervise()
        if run.sup.failure is None:
            run.sup.log("stopping (signal)")
            run.drain(deployment.limits.shutdown_grace_s)
            code = 0
        else:
            run.drain(deployment.limits.shutdown_grace_s)
    except StartupError as e:
        run.sup.fail(str(e))
    finally:
        run.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    run.sup.log(f"stopped (exit {code})")
    return code
