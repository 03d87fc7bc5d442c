"""Which CPUs each role of a deployment runs on, and pinning a process there.

A layer call is a serial chain: the rank publishes its rows and sleeps, an FfnAgent computes, the
rank goes on. Planned so that the chain never waits for a CPU: each FfnAgent runs on the CPUs of
the ranks whose layers it computes (while it computes, the rank sleeps), and the roles that are not
on the chain (the daemon, the front, the AtnAgents, and each engine's server and scheduler
processes, such as vLLM's EngineCore, which busy-polls its workers) run on control CPUs of their
own. Measured on a 2-core host (docs/design.md, "CPU placement"): an FfnAgent left to the
scheduler shared a CPU with vLLM's busy-polling EngineCore and computed the same FFN up to 2x
slower; one on the rank's CPU made a one-row call ~170 us cheaper than one on the other CPU.

Default, over the CPUs this process may use: the last one is the control CPU (vLLM's own CPU
binding reserves the last CPU for its EngineCore too), the others are cut into contiguous slices,
one per engine rank in deployment order; when there are no more CPUs than ranks, the ranks spread
over all of them (shared round-robin when there are more ranks than CPUs) and the control CPU is
shared. Each field may be set in the deployment file.
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


def plan_cpus(deployment: Deployment, layer_agents: dict[str, list[list[str]]], host: list[int]) -> CpuPlan:
    """Each role's CPUs: the deployment's where it sets them, else the default (module docstring).
    `layer_agents`: per model, each layer's execution group (the FFN placement)."""
    assert host, "no CPU to run on"
    control = list(deployment.control_cpus or host[-1:])
    default = iter(rank_cpus(sum(m.attention_tp * m.attention_dp for m in deployment.model), host))
    ranks = {}
    for m in deployment.model:
        planned = [next(default) for _ in range(m.attention_tp * m.attention_dp)]
        ranks[m.id] = [list(c) for c in m.rank_cpus] if m.rank_cpus else planned
    agents = {}
    for a in deployment.ffn_agent:
        served = sorted(
            {
                cpu
                for m in deployment.model
                if any(a.id in g for g in layer_agents[m.id])
                for r in ranks[m.id]
                for cpu in r
            }
        )
        agents[a.id] = list(a.cpus) if a.cpus else served or host
    return CpuPlan(control, ranks, agents)


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


def descendants(root: int) -> list[int]:
    """`root` and every process below it (read from /proc: members live in their own sessions)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
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
