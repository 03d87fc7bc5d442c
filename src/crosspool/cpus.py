"""Which CPUs each role of a deployment runs on, whether the ends of its layer calls spin, and
pinning a process there.

A layer call is a serial chain: the rank publishes its rows and waits, an FfnAgent computes, the
rank goes on. Two ways to run it well (measured on a 2-core host, docs/design.md "CPU
placement"): the FfnAgent on CPUs no rank uses, both ends watching the mailbox instead of
sleeping, so that a call crosses CPUs without a wake-up and each side keeps its caches; or, where
every CPU runs a rank, the FfnAgent on the CPUs of the ranks it serves, both ends sleeping (while
it computes, the rank sleeps). Sharing a CPU costs ~80 us a call against an FFN in process (the
two processes evict each other's caches and switch twice); a spinning end on the other CPU ~20 us.

Default, over the CPUs this process may use: the last one is the control CPU (vLLM's own CPU
binding reserves the last CPU for its EngineCore too), the others are cut into contiguous slices,
one per engine rank in deployment order; when there are no more CPUs than ranks, the ranks spread
over all of them (shared round-robin when there are more ranks than CPUs) and the control CPU is
shared. FfnAgents run on the CPUs no rank uses if there are any (the control CPU: vLLM's EngineCore
there busy-polls its workers only while they run a step, when the FfnAgent needs the CPU, and
works between steps, when the FfnAgent sleeps), else on their ranks' CPUs. Each placement may be
set in the deployment file; an end spins (`limits.spin_us`) only where its peers run on other CPUs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from crosspool.config import Deployment


def host_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity, which a container or `taskset` may narrow)."""
    return sorted(os.sched_getaffinity(0))


def rank_cpus(ranks: int, cpus: list[int]) -> list[list[int]]:
    """The default CPUs of `ranks` engine ranks on `cpus`: contiguous slices of all but the last
    CPU (left to control roles) when there are more CPUs than ranks, else of all of them; single
    CPUs shared round-robin when there are more ranks than CPUs."""
    assert ranks >= 1 and cpus, (ranks, cpus)
    if len(cpus) > ranks:
        cpus = cpus[:-1]
    if ranks >= len(cpus):
        return [[cpus[i % len(cpus)]] for i in range(ranks)]
    return [cpus[i * len(cpus) // ranks : (i + 1) * len(cpus) // ranks] for i in range(ranks)]


@dataclass(frozen=True)
class CpuPlan:
    control: list[int]
    """The daemon, the front, the AtnAgents and the engines' processes other than their ranks."""
    ranks: dict[str, list[list[int]]]
    """Per model, per engine rank (dp_rank * attention_tp + tp_rank): its CPUs."""
    ffn_agents: dict[str, list[int]]
    rank_spin_us: dict[str, int]
    """Per model: how long its ranks watch for a reply before they sleep (0: never watch)."""
    ffn_spin_us: dict[str, int]
    """Per FfnAgent: how long it watches for a call before it sleeps, inside a forward pass."""


def plan_cpus(deployment: Deployment, layer_agents: dict[str, list[list[str]]], host: list[int]) -> CpuPlan:
    """Each role's CPUs: the deployment's where it sets them, else the default (module docstring).
    `layer_agents`: per model, each layer's execution group (the FFN placement)."""
    assert host, "no CPU to run on"
    control = list(deployment.control_cpus or host[-1:])
    default = iter(rank_cpus(sum(m.ranks for m in deployment.model), host))
    ranks = {}
    for m in deployment.model:
        planned = [next(default) for _ in range(m.ranks)]
        ranks[m.id] = [list(c) for c in m.rank_cpus] if m.rank_cpus else planned
    on_ranks = {m.id: {cpu for cpus in ranks[m.id] for cpu in cpus} for m in deployment.model}
    agents_of = {m.id: {a for group in layer_agents[m.id] for a in group} for m in deployment.model}
    served = {a.id: set().union(*(on_ranks[m] for m in on_ranks if a.id in agents_of[m])) for a in deployment.ffn_agent}
    spare = [cpu for cpu in host if not any(cpu in cpus for cpus in on_ranks.values())]
    agents = {a.id: list(a.cpus) if a.cpus else spare or sorted(served[a.id]) or host for a in deployment.ffn_agent}
    spin = deployment.limits.spin_us
    rank_spin = {m: 0 if any(on_ranks[m] & set(agents[a]) for a in agents_of[m]) else spin for m in on_ranks}
    ffn_spin = {a: 0 if served[a] & set(cpus) else spin for a, cpus in agents.items()}
    return CpuPlan(control, ranks, agents, rank_spin, ffn_spin)


def problems(deployment: Deployment, host: list[int]) -> list[str]:
    """CPUs the deployment file names that this host does not let it use, a line each."""
    allowed = set(host)
    found = []

    def check(field: str, cpus: list[int] | None) -> None:
        outside = sorted(set(cpus or ()) - allowed)
        if outside:
            found.append(f"{field}: CPU {outside[0]} is not one this host allows (allowed: {host}) (got {cpus})")

    check("control_cpus", deployment.control_cpus)
    for i, a in enumerate(deployment.ffn_agent):
        check(f"ffn_agent[{i}].cpus", a.cpus)
    for i, m in enumerate(deployment.model):
        for r, cpus in enumerate(m.rank_cpus or ()):
            check(f"model[{i}].rank_cpus[{r}]", cpus)
    return found


@contextlib.contextmanager
def running_on(cpus: list[int]) -> Iterator[None]:
    """While inside, the calling thread runs on `cpus`, and so does every process it starts (a child
    inherits the affinity of the thread that forks it, so it starts there before any of its code runs)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _ppid(pid: int) -> int:
    """The parent of `pid` (OSError if it does not exist)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def descends_from(pid: int, ancestor: int) -> bool | None:
    """Whether `pid` is `ancestor` or below it; None where /proc cannot tell (no /proc)."""
    if not Path("/proc/self/stat").exists():
        return None
    try:
        while pid > 1 and pid != ancestor:
            pid = _ppid(pid)
    except (OSError, IndexError, ValueError):
        return False  # gone, or not a process
    return pid == ancestor


def descendants(root: int) -> list[int]:
    """`root` and every process below it (read from /proc: members live in their own sessions)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = _ppid(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return sorted(found)


def pin_process(pid: int, cpus: list[int]) -> None:
    """Every thread of process `pid` (its threads keep their own affinity; new ones inherit their
    creator's) on `cpus`. A thread that ends meanwhile is skipped."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return
    for tid in tasks:
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, FileNotFoundError):
            continue


def place_tree(root: int, placed: dict[int, list[int]], rest: list[int]) -> None:
    """Every process of `root`'s tree on its CPUs: `placed[pid]`, else `rest`."""
    for pid in descendants(root):
        pin_process(pid, placed.get(pid, rest))
