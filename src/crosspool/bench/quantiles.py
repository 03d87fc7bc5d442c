"""How every benchmark reads a quantile off its samples."""

from __future__ import annotations


def quantile(ordered: list[float], q: float) -> float:
    """The sample at index int(q * n) of `ordered` (sorted, not empty), the last one at most."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
