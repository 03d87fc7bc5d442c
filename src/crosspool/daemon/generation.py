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
from crosspool.cpus import place_tree
from crosspool.daemon.control import ControlState
from crosspool.daemon.health import EngineProbe, StepWatch
from crosspool.daemon.kv import KvBudgetError, KvPools
from crosspool.daemon.supervisor import Child, Supervisor, log
from crosspool.fabric.inbox import Inbox
from crosspool.integrations import launcher
from crosspool.ipc import EngineFiles, SegmentMissing, Stop
from crosspool.member import write_secret
from crosspool.metrics import CallCounts, ExecCounts, PoolCounters
from crosspool.plan import Plan
from crosspool.transport.mailbox import W_LAYER, W_REQ_SEQ, Mailbox

STOP_ENGINE, STOP_FRONT, STOP_ATN, STOP_FFN = 0, 1, 2, 3
WATCH_S = 0.1


class StartupError(RuntimeError):
    pass


class Generation:
    def __init__(
        self, deployment: Deployment, plan: Plan, state: ControlState, stop: Stop, engine_files: EngineFiles
    ) -> None:
        self.deployment, self.plan, self.state, self.stop = deployment, plan, state, stop
        self.sup = Supervisor(plan.shm_prefix, engine_files)
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"crosspool-{plan.token}-"))
        self.plan_path = self.run_dir / "plan.json"
        self.plan_path.write_text(plan.model_dump_json(indent=1))
        write_secret(self.plan_path, state.secret)
        self.mailboxes: list[Mailbox] = []  # by MailboxPlan.index, once the AtnAgents created them
        self.inboxes: dict[str, Inbox] = {}  # by FfnAgent, once they registered
        self.engines: dict[str, Child] = {}  # by model
        # Elastic KV channels exist before the engines start: each engine's scheduler attaches at its start.
        self.kv = KvPools(plan) if plan.kv_groups else None
        state.kv = self.kv
        self.probe: EngineProbe | None = None  # once serving
        self.steps = StepWatch()

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

    def _start_agent(self, role: str, module: str, agent_id: str, stop_order: int, cpus: list[int]) -> None:
        argv = [sys.executable, "-m", f"crosspool.agents.{module}", "--plan", str(self.plan_path), "--id", agent_id]
        env = envs.sharing_cores(os.environ)
        self.sup.start(f"{role} '{agent_id}'", argv, env, stop_order=stop_order, cpus=cpus)

    def start_pool(self, deadline: float) -> None:
        """AtnAgents (mailboxes), then FfnAgents (weights, inbox): after this the pool executes calls.
        FfnAgents start together: each spends most of its start importing its engine's kernels."""
        for atn in self.plan.atn_agents:
            self._start_agent("AtnAgent", "atn_agent", atn, STOP_ATN, self.plan.control_cpus)
            self._wait_registered(("AtnAgent", atn, 0), f"AtnAgent '{atn}'", deadline)
        self.mailboxes = [Mailbox.open(mb.name) for mb in self.plan.mailboxes]
        for agent in self.plan.ffn_agents:
            self._start_agent("FfnAgent", "ffn_agent", agent.id, STOP_FFN, agent.cpus)
        for agent in self.plan.ffn_agents:
            self._wait_registered(("FfnAgent", agent.id, 0), f"FfnAgent '{agent.id}'", deadline)
        self.state.metrics.attach(self.pool_counters)

    def inbox(self, agent: str) -> Inbox:
        """The FfnAgent's inbox (it exists once the agent registered)."""
        if agent not in self.inboxes:
            self.inboxes[agent] = Inbox.open(self.plan.inbox_name(agent), agent)
        return self.inboxes[agent]

    def pool_counters(self) -> PoolCounters:
        """The FFN path's counters of this generation, read from the mailboxes and inboxes."""
        counters = PoolCounters(queue_depth={a.id: 0 for a in self.plan.ffn_agents})
        for mplan, mailbox in zip(self.plan.mailboxes, self.mailboxes, strict=True):
            calls = counters.calls.setdefault(mplan.model, CallCounts())
            for reader in range(mplan.tp):
                seen = mailbox.reader_stats(reader)
                calls.add(CallCounts(seen.calls, seen.call_ns / 1e9, list(seen.buckets)))
            model = self.plan.model(mplan.model)
            request, layer = mailbox.words[W_REQ_SEQ], mailbox.words[W_LAYER]
            for agent in model.agents():
                done = self.inbox(agent).agent_stats(mplan.index)
                counts = ExecCounts(done.executed, done.execute_ns / 1e9, done.queue_ns / 1e9)
                counters.executed.setdefault((agent, mplan.model), ExecCounts()).add(counts)
                if request != done.claimed and layer < model.num_layers and agent in model.layer_agents[layer]:
                    counters.queue_depth[agent] += 1
        return counters

    def _shm_heartbeats(self) -> None:
        """Ranks and FfnAgents beat in shared memory (a timestamp in their mailbox or inbox), not
        over HTTP: nothing on the layer-call path waits for the daemon. Bring their last_seen up to
        date."""
        with self.state.lock:
            for (role, name, rank), member in self.state.registry.members.items():
                if role == "rank" and self.mailboxes:
                    tp = self.plan.model(name).attention_tp
                    mplan = self.plan.mailboxes_of(name)[rank // tp]
                    beat_ns = self.mailboxes[mplan.index].heartbeat_ns(rank % tp)
                elif role == "FfnAgent":
                    beat_ns = self.inbox(name).heartbeat_ns()
                else:
                    continue
                member.last_seen = max(member.last_seen, beat_ns / 1e9)

    def start_engines(self, deadline: float) -> None:
        d = self.deployment
        for model in d.model:
            engine = launcher(model.engine)
            port = int(self.plan.model(model.id).url.rsplit(":", 1)[1])
            argv = engine.server_command(model, d.limits.max_batched_tokens, d.host, port)
            rank_cpus = self.plan.model(model.id).rank_cpus
            env = engine.engine_env(model, self.plan_path, rank_cpus)
            # The engine's processes start where its ranks run (an engine binds its ranks within the
            # CPUs it inherits); once it serves, those that are not ranks move to the control CPUs.
            cpus = sorted({cpu for rank in rank_cpus for cpu in rank})
            self.engines[model.id] = self.sup.start(
                f"Instance '{model.id}'", argv, env, stop_order=STOP_ENGINE, cpus=cpus
            )
        for model in d.model:
            self._wait_engine(model.id, deadline)
            self._place_engine(model.id)
        if self.kv is not None:
            try:
                self.kv.check_floors()
            except KvBudgetError as e:
                raise StartupError(str(e)) from None

    def _place_engine(self, model_id: str) -> None:
        """The engine's processes other than its ranks (vLLM's API server and EngineCore, which
        busy-polls its workers; SGLang's server and detokenizer) onto the control CPUs, and each
        rank onto its CPUs (vLLM binds its workers itself; SGLang binds only with AMX kernels)."""
        ranks = self.plan.model(model_id).rank_cpus
        with self.state.lock:
            pids = {
                m.pid: ranks[slot[2]]
                for slot, m in self.state.registry.members.items()
                if slot[0] == "rank" and slot[1] == model_id
            }
        place_tree(self.engines[model_id].proc.pid, pids, self.plan.control_cpus)

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
        self.sup.start("front endpoint", argv, dict(os.environ), stop_order=STOP_FRONT, cpus=self.plan.control_cpus)
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
        self._shm_heartbeats()
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
            silent = None if self.probe is None else self.probe.silent(self.deployment.limits.engine_health_timeout_s)
            bound = self.deployment.limits.engine_health_timeout_s
            if silent is not None:
                model, seconds = silent
                self.state.fail(
                    f"Instance '{model}' engine server did not answer for {seconds:.0f} s "
                    f"(limits.engine_health_timeout_s = {bound:g})",
                    "hung",
                )
            stalled = None if self.probe is None else self.steps.stalled(self._layer_calls(), self._at_engine(), bound)
            if stalled is not None:
                model, seconds, waiting = stalled
                self.state.fail(
                    f"Instance '{model}' made no layer call for {seconds:.0f} s with {waiting} request(s) at its "
                    f"engine: its step stalled (limits.engine_health_timeout_s = {bound:g})",
                    "hung",
                )
        if self.state.failure is not None:
            self.fence(self.state.failure)
        return self.state.failure

    def _layer_calls(self) -> dict[str, int]:
        """Per model, the calls its ranks published (each mailbox's sequence word)."""
        calls = dict.fromkeys((m.id for m in self.plan.models), 0)
        for mplan, mailbox in zip(self.plan.mailboxes, self.mailboxes, strict=True):
            calls[mplan.model] += mailbox.words[W_REQ_SEQ]
        return calls

    def _at_engine(self) -> dict[str, int]:
        """Per model, the requests the front waits on its engine for (as of the front's last heartbeat)."""
        with self.state.lock:
            front = self.state.registry.members.get(("front", "front", 0))
            return dict(front.metrics.at_engine) if front is not None and front.metrics is not None else {}

    def supervise(self) -> str | None:
        """Block until a stop request (None) or the first failure (its reason)."""
        self.probe = EngineProbe({m.id: m.url + launcher(m.engine).LIVENESS_PATH for m in self.plan.models})
        while not self.stop.wait(WATCH_S):
            if self.kv is not None:
                self.kv.tick()
            reason = self.failure()
            if reason is not None:
                return reason
        return None

    def fence(self, reason: str) -> None:
        """Admit no more FFN work: every rank's current and next call fails with the failure."""
        for mailbox in self.mailboxes or self._existing_mailboxes():
            mailbox.fence(f"FFN pool failed: {reason}")

    def _existing_mailboxes(self) -> list[Mailbox]:
        """The mailboxes an AtnAgent created before the pool was fully up (a failure during startup)."""
        found = []
        for mplan in self.plan.mailboxes:
            try:
                found.append(Mailbox.open(mplan.name))
            except SegmentMissing:
                continue  # never created: nobody can be waiting on it
        return found

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
        if self.probe is not None:
            self.probe.close()
        self.sup.stop_all(self.deployment.limits.shutdown_grace_s)
        if self.kv is not None:
            self.kv.close()
        self.state.metrics.retire()
        shutil.rmtree(self.run_dir, ignore_errors=True)
