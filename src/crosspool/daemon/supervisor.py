"""Child processes of a generation: start, exit, ordered stop, cleanup.

Each member runs in its own process group, so stopping it also stops what it spawned (vLLM's
EngineCore and workers). Output is forwarded line by line with the member's name; agents'
`error:` lines are kept as failure reasons. Members get a temporary directory of their own as
TMPDIR (the engines put their ZeroMQ ipc:// socket files there and leave them when killed).
After the stop, the deployment's shared memory is unlinked, that directory removed and engine
leftovers created during the run (multiprocessing semaphores of killed vLLM processes) are
removed from /dev/shm, so nothing stays behind. Every wait here is bounded.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from crosspool import envs
from crosspool.cpus import running_on
from crosspool.ipc import GROUP_GONE_S, EngineFiles, unlink_segments, wait_groups_gone

OUTPUT_BACKLOG = 10_000
"""Lines of member output held for a slow sink before lines are dropped."""
KILL_WAIT_S = 10.0


def log(message: str) -> None:
    print(f"crosspool: {message}", file=sys.stderr, flush=True)


class SupervisorStopped(RuntimeError):
    """A member was to start after the generation's stop began."""


@dataclass
class Child:
    name: str  # e.g. "FfnAgent 'ffn0'"
    proc: subprocess.Popen[bytes]
    stop_order: int
    member: tuple[str, str]
    """(role, id): ("Instance", model id) for an engine."""
    errors: list[str] = field(default_factory=list)

    def exit_text(self) -> str:
        code = self.proc.returncode
        if code is None:
            return "running"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"


class Supervisor:
    def __init__(self, shm_prefix: str, engine_files: EngineFiles) -> None:
        """`engine_files`: /dev/shm before the deployment's first engine started. Every stop sweeps
        what engines left since then, so a file an earlier generation's stop could not remove yet
        (a killed process still mapped it) goes with a later one."""
        self.shm_prefix, self.engine_files = shm_prefix, engine_files
        self.members: list[Child] = []
        self.stopped = False
        # Instance restarts start and stop members from threads of their own. Every member starts
        # from this one thread, which outlives them: PR_SET_PDEATHSIG fires when the thread that
        # started a process ends, not the process (a restart thread's engine got SIGTERM as the
        # thread returned).
        self._lock = threading.Lock()
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="crosspool-spawn")
        self.tmp_dir = Path(tempfile.mkdtemp(prefix=f"{shm_prefix}members-"))

    def _drain(self, member: Child, stream: object, lines: queue.Queue[str | None]) -> None:
        """Read the member's output as it comes, whatever the sink does: a member never blocks on
        a full pipe. Past `OUTPUT_BACKLOG` lines waiting for the sink, lines are dropped (counted)."""
        dropped = 0
        for raw in iter(stream.readline, b""):  # type: ignore[attr-defined]
            line = raw.decode(errors="replace").rstrip()
            if "] error: " in line and line.startswith("["):
                member.errors.append(line.split("] error: ", 1)[1])
            try:
                if dropped:
                    lines.put_nowait(f"{member.name}| ({dropped} lines dropped: the daemon's output was not read)")
                    dropped = 0
                lines.put_nowait(f"{member.name}| {line}")
            except queue.Full:
                dropped += 1
        with contextlib.suppress(queue.Full):  # a writer stuck on its sink never ends anyway
            lines.put_nowait(None)

    @staticmethod
    def _write(lines: queue.Queue[str | None], sink: TextIO) -> None:
        writable = True
        while (line := lines.get()) is not None:
            if writable:
                try:
                    print(line, file=sink, flush=True)
                except (OSError, ValueError):  # the sink was closed: keep draining, stop writing
                    writable = False

    def start(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        *,
        member: tuple[str, str],
        stop_order: int,
        cpus: list[int],
        sink: TextIO | None = None,
    ) -> Child:
        """Start a member in its own session on `cpus`; its output goes, line by line with its
        name, to `sink` (default: stderr)."""
        with self._lock:
            if self.stopped:
                raise SupervisorStopped(f"{name} not started: the generation is stopping")
            proc = self._spawner.submit(self._spawn, argv, env, cpus).result()
            child = Child(name, proc, stop_order, member)
            self.members.append(child)
        lines: queue.Queue[str | None] = queue.Queue(OUTPUT_BACKLOG)
        threading.Thread(target=self._drain, args=(child, proc.stdout, lines), daemon=True).start()
        threading.Thread(target=self._write, args=(lines, sink or sys.stderr), daemon=True).start()
        return child

    def _spawn(self, argv: list[str], env: dict[str, str], cpus: list[int]) -> subprocess.Popen[bytes]:
        with running_on(cpus):
            return subprocess.Popen(
                argv,
                env={**env, envs.SUPERVISOR_PID: str(os.getpid()), "TMPDIR": str(self.tmp_dir)},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def exited(self) -> list[Child]:
        return [m for m in list(self.members) if m.proc.poll() is not None]

    def agent_errors(self) -> list[str]:
        return [e for m in list(self.members) for e in m.errors]

    def stop_all(self, grace_s: float) -> None:
        """Stop members in stop order (engines, front, AtnAgents, FfnAgents); SIGKILL past the grace."""
        with self._lock:
            if self.stopped:
                return
            self.stopped = True
        for order in sorted({m.stop_order for m in self.members}):
            _stop_group([m for m in self.members if m.stop_order == order], grace_s)
        self._cleanup()

    def stop_members(self, members: list[Child], grace_s: float) -> None:
        """Stop some members while the rest serve (an Instance restarting alone): SIGKILL past the
        grace, until no process of their groups is left. Their shared memory and the engines'
        leftovers go with the generation's stop (a sweep now could take a live engine's)."""
        _stop_group(members, grace_s)
        if not wait_groups_gone([m.proc.pid for m in members], GROUP_GONE_S):
            log(f"processes of {', '.join(m.name for m in members)} still ran {GROUP_GONE_S:g} s after SIGKILL")
        with self._lock:
            self.members = [m for m in self.members if m not in members]

    def _cleanup(self) -> None:
        self._spawner.shutdown(wait=False)  # its members are stopped
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        removed = unlink_segments(self.shm_prefix)
        if not wait_groups_gone([m.proc.pid for m in self.members], GROUP_GONE_S):
            log(f"processes of stopped members still ran {GROUP_GONE_S:g} s after SIGKILL")
        stale = self.engine_files.sweep()
        if removed:
            log(f"unlinked {len(removed)} CrossPool shared-memory segment(s) left by stopped members")
        if stale:
            log(f"removed {len(stale)} engine leftover(s) from /dev/shm: {', '.join(sorted(stale)[:5])}")


def _stop_group(members: list[Child], grace_s: float) -> None:
    for m in members:
        _signal_group(m.proc, signal.SIGTERM)
        _signal_group(m.proc, signal.SIGCONT)  # a stopped process takes its SIGTERM only once continued
    deadline = time.monotonic() + grace_s
    for m in members:
        try:
            m.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log(f"{m.name} did not stop within {grace_s:g} s; killing it")
        # The group may hold children that outlived the leader.
        _signal_group(m.proc, signal.SIGKILL)
        try:
            m.proc.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:  # in uninterruptible sleep: the caller reports the group
            log(f"{m.name} still ran {KILL_WAIT_S:g} s after SIGKILL")


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
