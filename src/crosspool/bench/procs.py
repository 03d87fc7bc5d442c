"""The processes of a deployment under measurement, by role, and what the scheduler gave them:
CPU time and run-queue wait from `/proc/PID/task/TID/schedstat` and context switches from
`/proc/PID/task/TID/status`, summed over threads; the kernel's share of the CPU time from
`/proc/PID/stat`; the CPUs each process may run on."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from crosspool.cpus import descendants

# A process's role, from its command line (or the title the engine gave it); the first match wins.
ROLES = (
    ("-m crosspool daemon", "daemon"),
    ("crosspool.front.server", "front"),
    ("crosspool.agents.atn_agent", "AtnAgent"),
    ("crosspool.agents.ffn_agent", "FfnAgent"),
    ("vllm.entrypoints.openai.api_server", "API server"),
    ("VLLM::EngineCore", "EngineCore"),
    ("VLLM::Worker", "Worker"),
    ("sglang.launch_server", "API server"),
    ("sglang::scheduler", "scheduler"),
    ("sglang::detokenizer", "detokenizer"),
)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def role_of(pid: int) -> str:
    cmdline = _cmdline(pid)
    return next((role for pattern, role in ROLES if pattern in cmdline), "other")


def roles(root: int) -> dict[int, str]:
    """pid -> role of `root`'s process tree."""
    return {pid: role_of(pid) for pid in descendants(root)}


@dataclass(frozen=True)
class SchedTimes:
    cpu_ns: int
    """Time on a CPU."""
    wait_ns: int
    """Time runnable but waiting for a CPU (run-queue wait)."""
    kernel_ns: int
    """The part of the CPU time spent in the kernel (clock-tick resolution)."""
    switches: int
    """Voluntary context switches (the thread blocked)."""
    preempted: int
    """Involuntary context switches (the thread was preempted)."""


_TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def sched_times(pid: int) -> SchedTimes | None:
    """Summed over the process's threads; None once it is gone."""
    cpu = wait = switches = preempted = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        kernel = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[12]) * _TICK_NS
    except OSError:
        return None
    for tid in tasks:
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue  # the thread ended
        cpu += int(fields[0])
        wait += int(fields[1])
        switches += int(status.split("\nvoluntary_ctxt_switches:", 1)[1].split()[0])
        preempted += int(status.split("nonvoluntary_ctxt_switches:", 1)[1].split()[0])
    return SchedTimes(cpu, wait, kernel, switches, preempted)


def affinity(pid: int) -> list[int]:
    try:
        return sorted(os.sched_getaffinity(pid))
    except OSError:
        return []


def snapshot(pids: dict[int, str]) -> dict[int, SchedTimes]:
    return {pid: t for pid in pids if (t := sched_times(pid)) is not None}


def by_role(pids: dict[int, str], before: dict[int, SchedTimes], after: dict[int, SchedTimes]) -> dict[str, dict]:
    """Per role over a window: CPU time (and its kernel part), run-queue wait, context switches
    (processes that lived through it)."""
    out: dict[str, dict] = {}
    for pid, role in pids.items():
        if pid in before and pid in after:
            a, b = after[pid], before[pid]
            zero = {"processes": 0, "cpu_ms": 0.0, "kernel_ms": 0.0, "runqueue_wait_ms": 0.0, "switches": 0}
            r = out.setdefault(role, {**zero, "preempted": 0})
            r["processes"] += 1
            r["cpu_ms"] += (a.cpu_ns - b.cpu_ns) / 1e6
            r["kernel_ms"] += (a.kernel_ns - b.kernel_ns) / 1e6
            r["runqueue_wait_ms"] += (a.wait_ns - b.wait_ns) / 1e6
            r["switches"] += a.switches - b.switches
            r["preempted"] += a.preempted - b.preempted
    return {role: {k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()} for role, r in out.items()}
