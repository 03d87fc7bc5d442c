"""One Generation of a deployment: start its members in order, watch them, fence, retire.

Start order: AtnAgents (mailboxes created), FfnAgents (weights loaded, inboxes created), engines
(each rank attaches its mailbox and registers while the model is built), the front endpoint.
Each member counts as started when it registered with the daemon; an engine also when its
/health answers 200. A vLLM whose plugin did not load never registers its rank, and the
generation refuses to become ready.

Retire order: the front stops taking requests, in-flight ones end (or fail), then engines, the
front, AtnAgents, FfnAgents stop (SIGTERM, SIGKILL past the grace) and the generation's shared
memory is unlinked.

With `restart = true` a serving generation keeps a failure small where it can: an Instance whose
engine or ranks fail, or the Instances with layers on a failed FfnAgent, are fenced, stopped and
started again alone (`Scope`, on a thread of their own) while the other models serve; the
generation retires for the failures of its other members.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from crosspool import envs
from crosspool.config import Deployment, ModelConfig
from crosspool.cpus import place_tree
from crosspool.daemon.control import ControlState
from crosspool.daemon.health import EngineProbe, StepWatch
from crosspool.daemon.kv import KvBudgetError, KvPools
from crosspool.daemon.restarts import RestartBudget
from crosspool.daemon.supervisor import Child, Supervisor, SupervisorStopped, log
from crosspool.fabric.inbox import AgentStats, Inbox
from crosspool.integrations import launcher
from crosspool.ipc import EngineFiles, SegmentMissing, Stop
from crosspool.member import write_secret
from crosspool.metrics import CallCounts, ExecCounts, PoolCounters
from crosspool.plan import Plan
from crosspool.transport.mailbox import PROBE_LAYER, W_LAYER, W_REQ_SEQ, Mailbox, resp_word

STOP_ENGINE, STOP_FRONT, STOP_ATN, STOP_FFN = 0, 1, 2, 3
WATCH_S = 0.1
QUIET_EXTRA_S = 5.0
"""How much longer than limits.ffn_timeout_s the FFN pool may take to answer a restarting
Instance's last call before its mailbox is handed on."""


class StartupError(RuntimeError):
    pass


@dataclass(frozen=True)
class Scope:
    """What one failure takes down when it stays small: Instances, and FfnAgents to start again."""

    models: tuple[str, ...]
    agents: tuple[str, ...] = ()

    def names(self) -> str:
        return ", ".join([*(f"Instance '{m}'" for m in self.models), *(f"FfnAgent '{a}'" for a in self.agents)])

    def holds(self, member: tuple[str, str]) -> bool:
        role, ident = member
        return ident in self.models if role in ("Instance", "rank") else role == "FfnAgent" and ident in self.agents


def _exec_counts(stats: AgentStats) -> ExecCounts:
    return ExecCounts(stats.executed, stats.execute_ns / 1e9, stats.queue_ns / 1e9)


class Generation:
    def __init__(
        self,
        deployment: Deployment,
        plan: Plan,
        state: ControlState,
        stop: Stop,
        engine_files: EngineFiles,
        restarts: RestartBudget,
    ) -> None:
        self.deployment, self.plan, self.state, self.stop, self.restarts = deployment, plan, state, stop, restarts
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
        self.engine_started: dict[str, float] = {}
        self.start_s: dict[str, float] = {}  # how long each Instance took to serve, last time
        self.down: list[Scope] = []  # restarting alone, each on its thread
        self.recoveries: list[threading.Thread] = []
        self.retiring = threading.Event()
        self._inbox_lock = threading.Lock()  # a restarted FfnAgent's inbox replaces the old one
        self.exec_before: dict[tuple[str, str], ExecCounts] = {}  # restarted FfnAgents' counts

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

    def _checker(self, deadline: float, what: str) -> Callable[[], None]:
        return lambda: self._check(deadline, what)

    def _wait_registered(self, slot: tuple[str, str, int], check: Callable[[], None]) -> None:
        while True:
            check()
            with self.state.lock:
                if slot in self.state.registry.members:
                    return
                self.state.changed.wait(WATCH_S)

    def _start_agent(self, role: str, module: str, agent_id: str, stop_order: int, cpus: list[int]) -> None:
        argv = [sys.executable, "-m", f"crosspool.agents.{module}", "--plan", str(self.plan_path), "--id", agent_id]
        env = envs.sharing_cores(os.environ)
        self.sup.start(f"{role} '{agent_id}'", argv, env, member=(role, agent_id), stop_order=stop_order, cpus=cpus)

    def start_pool(self, deadline: float) -> None:
        """AtnAgents (mailboxes), then FfnAgents (weights, inbox): after this the pool executes calls.
        FfnAgents start together: each spends most of its start importing its engine's kernels."""
        for atn in self.plan.atn_agents:
            self._start_agent("AtnAgent", "atn_agent", atn, STOP_ATN, self.plan.control_cpus)
            self._wait_registered(("AtnAgent", atn, 0), self._checker(deadline, f"AtnAgent '{atn}'"))
        self.mailboxes = [Mailbox.open(mb.name) for mb in self.plan.mailboxes]
        for agent in self.plan.ffn_agents:
            self._start_agent("FfnAgent", "ffn_agent", agent.id, STOP_FFN, agent.cpus)
        for agent in self.plan.ffn_agents:
            self._wait_registered(("FfnAgent", agent.id, 0), self._checker(deadline, f"FfnAgent '{agent.id}'"))
        self.state.metrics.attach(self.pool_counters)

    def inbox(self, agent: str) -> Inbox:
        """The FfnAgent's inbox (it exists once the agent registered)."""
        with self._inbox_lock:
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
                counters.executed.setdefault((agent, mplan.model), ExecCounts()).add(_exec_counts(done))
                if request != done.claimed and layer < model.num_layers and agent in model.layer_agents[layer]:
                    counters.queue_depth[agent] += 1
        for key, before in self.exec_before.items():
            counters.executed.setdefault(key, ExecCounts()).add(before)
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

    def _start_engine(self, model: ModelConfig) -> None:
        d = self.deployment
        engine = launcher(model.engine)
        port = int(self.plan.model(model.id).url.rsplit(":", 1)[1])
        argv = engine.server_command(model, d.limits.max_batched_tokens, d.host, port)
        rank_cpus = self.plan.model(model.id).rank_cpus
        env = engine.engine_env(model, self.plan_path, rank_cpus)
        # The engine's processes start where its ranks run (an engine binds its ranks within the
        # CPUs it inherits); once it serves, those that are not ranks move to the control CPUs.
        cpus = sorted({cpu for rank in rank_cpus for cpu in rank})
        self.engines[model.id] = self.sup.start(
            f"Instance '{model.id}'", argv, env, member=("Instance", model.id), stop_order=STOP_ENGINE, cpus=cpus
        )
        self.engine_started[model.id] = time.monotonic()

    def start_engines(self, deadline: float) -> None:
        d = self.deployment
        for model in d.model:
            self._start_engine(model)
        for model in d.model:
            self._wait_engine(model.id, self._checker(deadline, f"Instance '{model.id}'"))
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

    def _wait_engine(self, model_id: str, check: Callable[[], None]) -> None:
        what = f"Instance '{model_id}'"
        url = self.plan.model(model_id).url
        ranks = [("rank", model_id, rank) for model_id_, rank in self.plan.rank_slots() if model_id_ == model_id]
        with httpx.Client(timeout=2.0) as client:
            while True:
                check()
                try:
                    healthy = client.get(url + "/health").status_code == 200
                except httpx.HTTPError:
                    healthy = False
                if healthy:
                    self.start_s[model_id] = time.monotonic() - self.engine_started[model_id]
                    with self.state.lock:
                        attached = all(r in self.state.registry.members for r in ranks)
                        if attached and model_id not in self.state.down:
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
        self.sup.start(
            "front endpoint",
            argv,
            dict(os.environ),
            member=("front", "front"),
            stop_order=STOP_FRONT,
            cpus=self.plan.control_cpus,
        )
        self._wait_registered(("front", "front", 0), self._checker(deadline, "front endpoint"))
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
        """The first failure of this generation, recorded in the control state; None while healthy
        (or while only Instances restart alone)."""
        self._shm_heartbeats()
        for reason, kind, member in self._failures():
            scope = self.scope_of(*member)
            if scope is None:
                self.state.fail(reason, kind)
                break
            self.recover(scope, reason, kind)
        if self.state.failure is not None:
            self.fence(self.state.failure)
        return self.state.failure

    def _is_down(self, member: tuple[str, str]) -> bool:
        return any(scope.holds(member) for scope in list(self.down))

    def _failures(self) -> Iterator[tuple[str, str, tuple[str, str]]]:
        """(reason, failure kind, (role, id) of the member) of every failure not being restarted."""
        for dead in self.sup.exited():
            if not self._is_down(dead.member):
                errors = dead.errors or self.sup.agent_errors()
                cause = f" ({errors[0]})" if errors else ""
                yield f"{dead.name} {dead.exit_text()}{cause}", "exit", dead.member
        with self.state.lock:
            reports, self.state.reports = self.state.reports, []
        for reason, slot in reports:
            if not self._is_down(slot[:2]):
                yield reason, "reported", slot[:2]
        limits = self.deployment.limits
        with self.state.lock:
            death = self.state.registry.first_dead(
                limits.heartbeat_timeout_s, self.state.models_ready, lambda slot: self._is_down(slot[:2])
            )
        if death is not None:
            yield death.reason, death.kind, death.slot[:2]
        if self.probe is None:
            return
        down = {m for scope in list(self.down) for m in scope.models}
        bound = limits.engine_health_timeout_s
        silent = self.probe.silent(bound, down)
        if silent is not None:
            model, seconds = silent
            yield (
                f"Instance '{model}' engine server did not answer for {seconds:.0f} s "
                f"(limits.engine_health_timeout_s = {bound:g})",
                "hung",
                ("Instance", model),
            )
        calls = {m: n for m, n in self._layer_calls().items() if m not in down}
        stalled = self.steps.stalled(calls, self._at_engine(), bound)
        if stalled is not None:
            model, seconds, waiting = stalled
            yield (
                f"Instance '{model}' made no layer call for {seconds:.0f} s with {waiting} request(s) at its "
                f"engine: its step stalled (limits.engine_health_timeout_s = {bound:g})",
                "hung",
                ("Instance", model),
            )

    # -- failures that stay small ------------------------------------------------------------------

    def scope_of(self, role: str, ident: str) -> Scope | None:
        """What a failure of this member takes down, or None: the whole generation. Instances
        restart alone only once the generation serves, with `restart = true`, outside elastic KV
        (a KV Capacity Group's engines share one budget), and not while a restart that overlaps
        runs."""
        if not self.deployment.restart or self.state.phase != "ready" or self.retiring.is_set():
            return None
        if role in ("Instance", "rank"):
            scope = Scope((ident,))
        elif role == "FfnAgent":
            scope = Scope(tuple(m.id for m in self.plan.models if ident in m.agents()), (ident,))
        else:
            return None
        if any(g.model in scope.models for g in self.plan.kv_groups):
            return None
        busy = list(self.down)
        if any(set(scope.models) & set(b.models) or set(scope.agents) & set(b.agents) for b in busy):
            return None
        return scope

    def _mailboxes_of(self, models: tuple[str, ...]) -> list[tuple[int, Mailbox]]:
        return [(mb.index, self.mailboxes[mb.index]) for mb in self.plan.mailboxes if mb.model in models]

    def recover(self, scope: Scope, reason: str, kind: str) -> None:
        """Fence the scope's Instances (their ranks fail at once, the front answers their models
        503) and start them again on a thread of their own; the rest of the deployment serves."""
        backoff = self.restarts.backoff_s()
        expected = backoff + max(self.start_s.get(m, self.deployment.limits.startup_timeout_s) for m in scope.models)
        self.state.fail_instances(scope.models, scope.agents, reason, kind, expected)
        self.down.append(scope)
        for _, mailbox in self._mailboxes_of(scope.models):
            mailbox.fence(f"FFN pool failed: {reason}")
        thread = threading.Thread(target=self._restart, args=(scope, reason), name="crosspool-restart", daemon=True)
        self.recoveries.append(thread)
        thread.start()

    def _restart(self, scope: Scope, reason: str) -> None:
        limits, d = self.deployment.limits, self.deployment
        try:
            while True:
                for _, mailbox in self._mailboxes_of(scope.models):  # again after a failed start
                    mailbox.fence(f"FFN pool failed: {reason}")
                victims = [c for c in list(self.sup.members) if scope.holds(c.member)]
                self.sup.stop_members(victims, limits.shutdown_grace_s)
                if self.restarts.recent() >= d.max_restarts:
                    self.state.fail(
                        f"{reason}; {scope.names()} not restarted: max_restarts = {d.max_restarts} reached "
                        f"within restart_window_s = {d.restart_window_s:g}",
                        "exit",
                    )
                    return
                backoff = self.restarts.backoff_s()
                self.log(f"restarting {scope.names()} in {backoff:g} s")
                if self.retiring.wait(backoff) or self.stop.is_set():
                    return
                self.restarts.take()
                started = time.monotonic()
                try:
                    self._start_scope(scope)
                except (StartupError, SupervisorStopped) as e:
                    if self.retiring.is_set() or self.stop.is_set() or self.state.failure is not None:
                        return
                    reason = f"restart of {scope.names()} failed: {e}"
                    self.log(reason)
                    self.state.forget(scope.models, scope.agents)
                    continue
                self.down.remove(scope)
                self.state.instance_serving(scope.models)
                self.log(f"{scope.names()} serving again after {time.monotonic() - started:.1f} s")
                return
        except Exception as e:  # an Instance must not stay down without a failure named
            self.state.fail(f"restarting {scope.names()} failed: {type(e).__name__}: {e}", "exit")

    def _start_scope(self, scope: Scope) -> None:
        """The scope's FfnAgents, then its mailboxes handed on, then its engines: as at start."""
        limits = self.deployment.limits
        deadline = time.monotonic() + limits.startup_timeout_s

        def check(what: str, until: float = deadline) -> Callable[[], None]:
            within_s = until - time.monotonic()

            def raise_if_failed() -> None:
                if self.retiring.is_set() or self.stop.is_set() or self.state.failure is not None:
                    raise StartupError("the generation is stopping")
                if time.monotonic() > until:
                    raise StartupError(f"{what} not ready within {within_s:.0f} s")
                for child in self.sup.exited():
                    if scope.holds(child.member):
                        raise StartupError(f"{child.name} {child.exit_text()}")

            return raise_if_failed

        for agent in scope.agents:
            old = self.inbox(agent)  # read every watch tick while the agent was registered
            old.seg.unlink()  # a killed agent leaves it; the new one creates it anew
            cpus = next(a.cpus for a in self.plan.ffn_agents if a.id == agent)
            self._start_agent("FfnAgent", "ffn_agent", agent, STOP_FFN, cpus)
            self._wait_registered(("FfnAgent", agent, 0), check(f"FfnAgent '{agent}'"))
            fresh = Inbox.open(self.plan.inbox_name(agent), agent)
            with self._inbox_lock:  # the old agent's counts stay in the totals
                for mb in self.plan.mailboxes:
                    if mb.model in scope.models:
                        before = self.exec_before.setdefault((agent, mb.model), ExecCounts())
                        before.add(_exec_counts(old.agent_stats(mb.index)))
                self.inboxes[agent] = fresh
        for index, mailbox in self._mailboxes_of(scope.models):
            quiet_check = check(
                "the FFN pool's answer to its last call", time.monotonic() + limits.ffn_timeout_s + QUIET_EXTRA_S
            )
            while not self.mailbox_answered(index, mailbox, scope):
                quiet_check()
                time.sleep(WATCH_S)
            mailbox.reset()
        configs = {m.id: m for m in self.deployment.model}
        for model in scope.models:
            self._start_engine(configs[model])
        for model in scope.models:
            self._wait_engine(model, check(f"Instance '{model}'"))
            self._place_engine(model)
            assert self.probe is not None
            self.probe.restarted(model)

    def mailbox_answered(self, index: int, mailbox: Mailbox, scope: Scope) -> bool:
        """Whether every FfnAgent of the mailbox claimed its last call (fenced: dropped) and every
        agent of that call's execution group answered it (a restarted agent never will)."""
        mplan = self.plan.mailboxes[index]
        model = self.plan.model(mplan.model)
        request, layer = mailbox.words[W_REQ_SEQ], mailbox.words[W_LAYER]
        if any(self.inbox(a).agent_stats(index).claimed != request for a in model.agents()):
            return False
        if request == 0:
            group: list[str] = []
        elif layer == PROBE_LAYER:
            group = model.layer_agents[0][:1]
        else:
            group = model.layer_agents[layer] if layer < model.num_layers else []
        return all(mailbox.words[resp_word(s)] == request for s, a in enumerate(group) if a not in scope.agents)

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
        self.retiring.set()
        grace = self.deployment.limits.shutdown_grace_s
        for thread in self.recoveries:  # each sees `retiring` within a wait slice, or ends its stop
            thread.join(timeout=2 * grace + 10)
        if self.probe is not None:
            self.probe.close()
        self.sup.stop_all(self.deployment.limits.shutdown_grace_s)
        if self.kv is not None:
            self.kv.close()
        self.state.metrics.retire()
        shutil.rmtree(self.run_dir, ignore_errors=True)
