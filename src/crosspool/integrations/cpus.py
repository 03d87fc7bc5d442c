"""CPU sets for an engine's workers, in the "a|b|c" form both engines' bind variables take."""

from __future__ import annotations


def cpu_binding(workers: int, cpus: list[int]) -> str:
    """Binding for `workers` CPU workers ([DP, TP] order) on `cpus`: the engines' defaults want a
    NUMA node per worker; here workers get contiguous slices of the allowed CPUs, sharing them
    round-robin when there are more workers than CPUs."""
    if workers >= len(cpus):
        return "|".join(str(cpus[i % len(cpus)]) for i in range(workers))
    slices = [cpus[i * len(cpus) // workers : (i + 1) * len(cpus) // workers] for i in range(workers)]
    return "|".join(",".join(map(str, s)) for s in slices)
