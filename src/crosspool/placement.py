"""FFN layer placement: the execution group (FfnAgents) of each layer of each model, under
memory budgets.

A small mixed-integer program, solved with HiGHS (scipy.optimize.milp): every layer on exactly
`group` distinct eligible agents (the model's pinned agent, or any; group > 1 is FFN tensor
parallelism, each agent holding 1/group of the layer), each agent's weight bytes within its
budget, minimising the largest budget fraction used (so weights and FFN work spread evenly).
HiGHS is deterministic for a given input; afterwards equal-sized layers of a model are reordered
so each agent holds contiguous layer ranges, which makes the placement readable and stable.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import LinearConstraint, milp
from scipy.sparse import lil_matrix

SOLVER_TIME_LIMIT_S = 20.0


@dataclass(frozen=True)
class ModelLayers:
    id: str
    layer_bytes: list[int]
    agents: list[str]  # the agents allowed to hold this model's layers
    group: int = 1  # agents per layer (FFN tensor parallelism)


class PlacementError(ValueError):
    pass


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB"


def _shortfall(models: list[ModelLayers], budgets: dict[str, int]) -> str | None:
    """The clearest reason a placement cannot exist: total weights over the eligible budgets."""
    for agents in sorted({tuple(sorted(m.agents)) for m in models}):
        # Every model restricted to a subset of `agents` competes for the same budgets.
        competing = [m for m in models if set(m.agents) <= set(agents)]
        need = sum(sum(m.layer_bytes) for m in competing)
        have = sum(budgets[a] for a in agents)
        if need > have:
            return (
                f"FFN weights of {sorted(m.id for m in competing)} need {_gib(need)} on ffn_agent "
                f"{list(agents)} with {_gib(have)} of memory_gib: {_gib(need - have)} over the budget"
            )
    return None


def place_layers(models: list[ModelLayers], budgets: dict[str, int]) -> dict[str, list[list[str]]]:
    """model id -> the execution group of each layer, in agent order. Raises PlacementError
    saying by how much it does not fit."""
    reason = _shortfall(models, budgets)
    if reason is not None:
        raise PlacementError(reason)
    agents = list(budgets)
    pairs = [(mi, li, a) for mi, m in enumerate(models) for li in range(len(m.layer_bytes)) for a in m.agents]
    n = len(pairs) + 1  # the last variable is z, the largest budget fraction used
    items = [(mi, li) for mi, m in enumerate(models) for li in range(len(m.layer_bytes))]
    item_row = {item: r for r, item in enumerate(items)}
    a_rows = lil_matrix((len(items) + len(agents), n))
    for col, (mi, li, a) in enumerate(pairs):
        a_rows[item_row[(mi, li)], col] = 1
        # load(a) - z * budget(a) <= 0, scaled to GiB to keep the coefficients well conditioned
        a_rows[len(items) + agents.index(a), col] = -(-models[mi].layer_bytes[li] // models[mi].group) / 2**30
    for ai, a in enumerate(agents):
        a_rows[len(items) + ai, n - 1] = -budgets[a] / 2**30
    groups = np.array([models[mi].group for mi, _ in items], dtype=float)
    lower = np.concatenate([groups, np.full(len(agents), -np.inf)])
    upper = np.concatenate([groups, np.zeros(len(agents))])
    cost = np.zeros(n)
    cost[-1] = 1.0
    integrality = np.ones(n)
    integrality[-1] = 0
    bounds_hi = np.ones(n)
    bounds_hi[-1] = 1.0
    result = milp(
        cost,
        integrality=integrality,
        bounds=(np.zeros(n), bounds_hi),
        constraints=LinearConstraint(a_rows.tocsr(), lower, upper),
        options={"time_limit": SOLVER_TIME_LIMIT_S},
    )
    if result.x is None:
        largest = max(b for m in models for b in m.layer_bytes)
        raise PlacementError(
            f"FFN layers do not pack into the ffn_agent budgets ({result.message.strip()}); the largest "
            f"layer needs {_gib(largest)}, free budgets: { ({a: _gib(b) for a, b in budgets.items()}) }"
        )
    chosen: dict[tuple[int, int], list[str]] = {item: [] for item in items}
    for col, (mi, li, a) in enumerate(pairs):
        if result.x[col] > 0.5:
            chosen[(mi, li)].append(a)
    order = {a: i for i, a in enumerate(agents)}
    placement = {}
    for mi, m in enumerate(models):
        layer_group = [sorted(chosen[(mi, li)], key=order.__getitem__) for li in range(len(m.layer_bytes))]
        assert all(len(g) == m.group for g in layer_group)
        for size in sorted(set(m.layer_bytes)):
            same = [li for li, b in enumerate(m.layer_bytes) if b == size]
            ranked = sorted((layer_group[li] for li in same), key=lambda g: [order[a] for a in g])
            for li, group in zip(same, ranked, strict=True):
                layer_group[li] = group
        placement[m.id] = layer_group
    return placement
