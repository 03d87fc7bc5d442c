"""`crosspool daemon` (alias `crosspool serve`): one process per deployment. It serves the control
API, runs one Generation at a time, picks the first failure, and either stops (default) or
starts the next generation (`restart = true`). It is never on the per-layer path.

Exit code: 0 after SIGINT/SIGTERM, 1 after a failure it did not (or may not) restart from.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import uvicorn

from crosspool.cpus import pin_process
from crosspool.daemon.control import ControlState, create_control_app
from crosspool.daemon.generation import Generation, StartupError
from crosspool.daemon.restarts import RestartBudget, no_restart
from crosspool.daemon.supervisor import log
from crosspool.ipc import EngineFiles, Stop, bind_port, shm_shortage
from crosspool.plan import Plan
from crosspool.resolve import Resolved
from crosspool.transport.mailbox import mailbox_size

CONTROL_START_S = 10.0


class Daemon:
    def __init__(self, resolved: Resolved) -> None:
        self.resolved = resolved
        d = self.deployment = resolved.deployment
        self.stop = Stop()
        self.state = ControlState(resolved.plan(1), f"http://{d.host}:{d.port}/v1", d.limits.heartbeat_timeout_s)
        self.server: uvicorn.Server | None = None
        self.generation: Generation | None = None
        self.engine_files = EngineFiles.now()
        self.restarts = RestartBudget(d)

    def start_control(self, *, front: bool = True) -> None:
        d = self.deployment
        ports = ((d.port, "port"), (d.control, "control_port")) if front else ((d.control, "control_port"),)
        for port, what in ports:
            try:
                bind_port(d.host, port)
            except OSError as e:
                raise StartupError(f"{what} {port} on {d.host} is not free: {e.strerror}") from None
        app = create_control_app(self.state)
        self.server = uvicorn.Server(uvicorn.Config(app, host=d.host, port=d.control, log_level="warning"))
        thread = threading.Thread(target=self.server.run, name="control-api", daemon=True)
        thread.start()
        deadline = time.monotonic() + CONTROL_START_S
        while not self.server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise StartupError(f"control API could not listen on {d.host}:{d.control}")
            time.sleep(0.02)

    def new_generation(self) -> Generation:
        """The next generation, with fresh segment names and engine ports (not started yet)."""
        number = 1 if self.generation is None else self.generation.plan.generation + 1
        plan = self.state.plan if number == 1 else self.resolved.plan(number)
        if number > 1:
            self.state.new_generation(plan)
        self.generation = Generation(self.deployment, plan, self.state, self.stop, self.engine_files, self.restarts)
        return self.generation

    def run(self) -> int:
        """Serve until a signal (0) or a failure it does not restart from (1)."""
        d = self.deployment
        self.start_control()
        log(f"control API on {d.host}:{d.control} (GET /status, /ready, /metrics)")
        while True:
            gen = self.new_generation()
            started = time.monotonic()
            try:
                gen.start()
            except StartupError as e:
                if not self.stop.is_set():  # a stop request during startup is a stop, not a failure
                    self.state.fail(str(e), "startup")
            reason = self.state.failure
            if reason is None and not self.stop.is_set():
                print(
                    f"crosspool: ready in {time.monotonic() - started:.1f} s: {self.state.endpoint} serving "
                    f"{', '.join(m.id for m in d.model)} (generation {gen.plan.generation})",
                    flush=True,
                )
                reason = gen.supervise()
            if reason is None:  # a stop request
                log("stopping (signal)")
                self.state.set_phase("stopping")
                gen.drain(d.limits.shutdown_grace_s)
                gen.close()
                self.state.set_phase("stopped")
                return 0
            gen.drain(d.limits.shutdown_grace_s)
            gen.close()
            recent = self.restarts.recent()
            refusal = no_restart(d, gen.plan.generation, self.state.failure_kind, recent, self.stop.is_set())
            if refusal is None:
                backoff = self.restarts.backoff_s()
                log(f"restarting in {backoff:g} s ({recent} restart(s) in the last {d.restart_window_s:g} s)")
                if self.stop.wait(backoff):
                    refusal = "a stop was requested"
            if refusal is not None:
                log(f"not restarting: {refusal}")
                return 1
            self.restarts.take()
            self.state.restarts += 1
            log(f"generation {gen.plan.generation} retired after: {reason}; restarting")

    def close(self) -> None:
        if self.generation is not None:
            self.generation.close()
        if self.server is not None:
            self.server.should_exit = True


@contextmanager
def running_pool(resolved: Resolved) -> Iterator[Generation]:
    """The control API and the FFN pool of generation 1, no engines and no front: for benchmarks
    and tests that drive ranks themselves (the ranks still register with this daemon)."""
    d = resolved.deployment
    resolved = replace(resolved, deployment=d.model_copy(update={"control_port": bind_port(d.host)}))
    daemon = Daemon(resolved)
    try:
        daemon.start_control(front=False)
        gen = daemon.new_generation()
        gen.start_pool(time.monotonic() + d.limits.startup_timeout_s)
        yield gen
    finally:
        daemon.close()


def planned_shm_bytes(plan: Plan) -> int:
    """Bytes of /dev/shm a generation's own segments take: the rank mailboxes (the inboxes and
    elastic-KV channels are a few KiB each)."""
    return sum(mailbox_size(mb.max_rows, mb.hidden, mb.dtype, mb.shards, mb.tp, mb.local_rows) for mb in plan.mailboxes)


def run_daemon(resolved: Resolved) -> int:
    shortage = shm_shortage(planned_shm_bytes(resolved.plan()))
    if shortage is not None:
        print(f"crosspool: error: {shortage}", file=sys.stderr, flush=True)
        return 2
    # The daemon is off the layer-call path: its threads (control API, output forwarders, the
    # watch loop) run on the control CPUs, and it starts each member on the member's own.
    pin_process(os.getpid(), resolved.cpus.control)
    daemon = Daemon(resolved)
    previous = {sig: signal.signal(sig, daemon.stop.request) for sig in (signal.SIGINT, signal.SIGTERM)}
    code = 1
    try:
        code = daemon.run()
    except StartupError as e:
        log(f"failure: {e}")
    finally:
        daemon.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log(f"stopped (exit {code})")
    return code
