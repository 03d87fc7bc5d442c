"""The Generation plan: members, FFN placement and the shared-memory layout they agree on."""

from __future__ import annotations

import secrets
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from crosspool.agents.ffn.dense import ActivationMath
from crosspool.config import ConfigError, Deployment
from crosspool.integrations import launcher
from crosspool.ipc import SHM_PREFIX
from crosspool.models.spec import ModelFfnSpec, ModelSpecError, load_ffn_spec


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelPlan(_Frozen):
    id: str
    path: Path
    engine: str
    dtype: str
    hidden: int
    num_layers: int
    atn_agent: str
    layer_agents: list[list[str]]
    """Per layer, its execution group: the FfnAgents that compute it, in shard order."""
    activation_math: ActivationMath
    """The FFN activation precision of the Instance's execution mode (engine-specific, see dense.py)."""

    def layers_on(self, agent: str) -> list[int]:
        return [layer for layer, group in enumerate(self.layer_agents) if agent in group]


class MailboxPlan(_Frozen):
    index: int
    name: str
    model: str
    rank: int
    atn_agent: str
    max_rows: int
    hidden: int
    dtype: str


class FfnAgentPlan(_Frozen):
    id: str
    threads: int
    lanes: int
    models: list[str]
    weight_bytes: int


class Plan(_Frozen):
    deployment: str
    digest: str
    token: str
    generation: int
    ffn_timeout_s: float
    models: list[ModelPlan]
    atn_agents: list[str]
    ffn_agents: list[FfnAgentPlan]
    mailboxes: list[MailboxPlan]

    @property
    def shm_prefix(self) -> str:
        return f"{SHM_PREFIX}{self.token}-"

    def inbox_name(self, ffn_agent: str) -> str:
        return f"{self.shm_prefix}inbox-{ffn_agent}"

    def model(self, model_id: str) -> ModelPlan:
        return next(m for m in self.models if m.id == model_id)

    def mailboxes_of(self, model_id: str) -> list[MailboxPlan]:
        return [mb for mb in self.mailboxes if mb.model == model_id]


def resolve_specs(deployment: Deployment, source: str) -> dict[str, ModelFfnSpec]:
    specs, problems = {}, []
    for i, m in enumerate(deployment.model):
        try:
            specs[m.id] = load_ffn_spec(m.path)
        except ModelSpecError as e:
            problems.append(f"model[{i}].path: {e} (got '{m.path}')")
    if problems:
        raise ConfigError(source, problems)
    return specs


def build_plan(deployment: Deployment, specs: dict[str, ModelFfnSpec], source: str, *, generation: int = 1) -> Plan:
    token = secrets.token_hex(4)
    prefix = f"{SHM_PREFIX}{token}-"
    models: list[ModelPlan] = []
    mailboxes: list[MailboxPlan] = []
    problems: list[str] = []
    for m in deployment.model:
        spec = specs[m.id]
        atn, ffn = deployment.attention_of(m), deployment.ffn_of(m)
        models.append(
            ModelPlan(
                id=m.id,
                path=m.path,
                engine=m.engine,
                dtype=m.dtype,
                hidden=spec.hidden,
                num_layers=len(spec.layers),
                atn_agent=atn,
                layer_agents=[[ffn]] * len(spec.layers),
                activation_math=launcher(m.engine).activation_math(m),
            )
        )
        mailboxes.append(
            MailboxPlan(
                index=len(mailboxes),
                name=f"{prefix}mb-{m.id}-r0",
                model=m.id,
                rank=0,
                atn_agent=atn,
                max_rows=deployment.limits.max_batched_tokens,
                hidden=spec.hidden,
                dtype=m.dtype,
            )
        )
    agents = []
    for i, agent in enumerate(deployment.ffn_agent):
        placed = [m for m in deployment.model if deployment.ffn_of(m) == agent.id]
        need = sum(specs[m.id].weight_bytes(m.dtype) for m in placed)
        budget = int(agent.memory_gib * 2**30)
        if need > budget:
            problems.append(
                f"ffn_agent[{i}].memory_gib: FFN weights of {[m.id for m in placed]} need "
                f"{need / 2**30:.2f} GiB, {(need - budget) / 2**30:.2f} GiB over the budget (got {agent.memory_gib})"
            )
        agents.append(
            FfnAgentPlan(
                id=agent.id, threads=agent.threads, lanes=agent.lanes, models=[m.id for m in placed], weight_bytes=need
            )
        )
    if problems:
        raise ConfigError(source, problems)
    return Plan(
        deployment=deployment.name,
        digest=deployment.digest(),
        token=token,
        generation=generation,
        ffn_timeout_s=deployment.limits.ffn_timeout_s,
        models=models,
        atn_agents=[a.id for a in deployment.attention_device],
        ffn_agents=agents,
        mailboxes=mailboxes,
    )


def plan_deployment(path: Path) -> tuple[Deployment, dict[str, ModelFfnSpec], Plan]:
    """Everything that must hold before any process starts: schema, engine options, model
    specs, FFN memory budgets. Raises ConfigError listing every problem found."""
    from crosspool.config import load_deployment

    source = str(path)
    deployment = load_deployment(path)
    problems = []
    for i, m in enumerate(deployment.model):
        problems += [f"model[{i}].{p}" for p in launcher(m.engine).engine_arg_problems(m.engine_args)]
    if problems:
        raise ConfigError(source, problems)
    specs = resolve_specs(deployment, source)
    return deployment, specs, build_plan(deployment, specs, source)
