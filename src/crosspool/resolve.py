"""A deployment checked against the engines, the checkpoints and this host before any process
starts: engine options, model specs, FFN placement within the agents' budgets, CPU placement. The result builds each
generation's plan (`plan.py`), handing it the engine facts as values."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from crosspool.config import ConfigError, Deployment, load_deployment
from crosspool.cpus import CpuPlan, host_cpus, plan_cpus
from crosspool.cpus import problems as cpu_problems
from crosspool.integrations import launcher, serves
from crosspool.models.spec import ActivationMath, ModelFfnSpec, ModelSpecError, load_ffn_spec
from crosspool.placement import ModelLayers, PlacementError, place_layers
from crosspool.plan import Plan, build_plan


def resolve_specs(deployment: Deployment, source: str) -> dict[str, ModelFfnSpec]:
    specs, problems = {}, []
    for i, m in enumerate(deployment.model):
        try:
            specs[m.id] = load_ffn_spec(m.path)
        except ModelSpecError as e:
            problems.append(f"model[{i}].path: {e} (got '{m.path}')")
            continue
        if not serves(m.engine, specs[m.id].architecture):
            problems.append(
                f"model[{i}].engine: {specs[m.id].architecture} is not served through {m.engine} with CrossPool "
                f"(supported: {', '.join(launcher(m.engine).ARCHITECTURES or ())})"
            )
    if problems:
        raise ConfigError(source, problems)
    return specs


def place(deployment: Deployment, specs: dict[str, ModelFfnSpec], source: str) -> dict[str, list[list[str]]]:
    """Each model's per-layer execution group, within every agent's memory budget (placement.py)."""
    wanted = []
    problems = []
    for i, m in enumerate(deployment.model):
        allowed = deployment.ffn_agents_of(m)
        smallest = min(layer.intermediate for layer in specs[m.id].layers)
        if m.ffn_tp > len(allowed):
            problems.append(f"model[{i}].ffn_tp: {m.ffn_tp} shards need as many FfnAgents, {len(allowed)} allowed")
        elif m.ffn_tp > smallest:
            problems.append(f"model[{i}].ffn_tp: more shards than intermediate rows ({smallest}) (got {m.ffn_tp})")
        wanted.append(
            ModelLayers(m.id, [layer.weight_bytes(m.dtype) for layer in specs[m.id].layers], allowed, m.ffn_tp)
        )
    if problems:
        raise ConfigError(source, problems)
    budgets = {a.id: int(a.memory_gib * 2**30) for a in deployment.ffn_agent}
    try:
        return place_layers(wanted, budgets)
    except PlacementError as e:
        raise ConfigError(source, [f"ffn_agent: {e}"]) from None


@dataclass(frozen=True)
class Resolved:
    """A deployment checked against everything that must hold before any process starts."""

    deployment: Deployment
    specs: dict[str, ModelFfnSpec]
    placement: dict[str, list[list[str]]]
    activation_math: dict[str, ActivationMath]
    """Per model, the FFN activation precision of its engine's execution mode."""
    cpus: CpuPlan

    def plan(self, generation: int = 1) -> Plan:
        return build_plan(
            self.deployment, self.specs, self.placement, self.activation_math, self.cpus, generation=generation
        )


def resolve(deployment: Deployment, source: str = "<deployment>") -> Resolved:
    """Engine options, model specs, FFN placement within memory budgets; raises ConfigError
    listing every problem found."""
    host = host_cpus()
    problems = cpu_problems(deployment, host)
    for i, m in enumerate(deployment.model):
        problems += [f"model[{i}].{p}" for p in launcher(m.engine).model_problems(m)]
    if problems:
        raise ConfigError(source, problems)
    specs = resolve_specs(deployment, source)
    math = {m.id: launcher(m.engine).activation_math(m) for m in deployment.model}
    placement = place(deployment, specs, source)
    return Resolved(deployment, specs, placement, math, plan_cpus(deployment, placement, host))


def resolve_file(path: Path) -> Resolved:
    return resolve(load_deployment(path), str(path))
