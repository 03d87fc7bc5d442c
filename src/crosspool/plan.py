"""The Generation plan: members, FFN placement and the shared-memory layout they agree on."""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from crosspool.config import Deployment
from crosspool.cpus import CpuPlan
from crosspool.ipc import SHM_PREFIX, bind_port
from crosspool.models.spec import ActivationMath, ModelFfnSpec
from crosspool.transport.mailbox import RankLayout


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
    url: str
    """The Instance's own HTTP server (the front endpoint routes to it)."""
    activation_math: ActivationMath
    """The FFN activation precision of the Instance's execution mode (engine-specific, see dense.py)."""
    attention_tp: int
    attention_dp: int
    rank_cpus: list[list[int]]
    """Per engine rank, the CPUs it runs on (the engine binds its workers there)."""
    spin_us: int
    """How long a rank watches its mailbox for the reply before it sleeps (crosspool/cpus.py)."""
    max_model_len: int
    """Prompt plus output tokens of one request at most (the front refuses more)."""

    @property
    def ranks(self) -> int:
        """Engine ranks (workers): rank = dp_rank * attention_tp + tp_rank."""
        return self.attention_tp * self.attention_dp

    def agents(self) -> list[str]:
        """The FfnAgents that compute any of the model's layers."""
        return sorted({a for group in self.layer_agents for a in group})

    def layers_on(self, agent: str) -> list[int]:
        return [layer for layer, group in enumerate(self.layer_agents) if agent in group]


class MailboxPlan(_Frozen):
    """One per Instance DP rank; its attention_tp ranks share it (the first one publishes)."""

    index: int
    name: str
    model: str
    dp_rank: int
    tp: int
    atn_agent: str
    max_rows: int
    hidden: int
    dtype: str
    shards: int
    """Output planes: the largest execution group of the model's layers (FFN tensor parallelism)."""
    local_rows: bool = False
    """Its ranks hand the pool different rows of each call (transport/mailbox.py); no admitted engine
    mode does yet, the context-parallel harness does."""


class KvGroupPlan(_Frozen):
    """Elastic KV: one KV Capacity Group, an Instance's DP rank with all its TP ranks (one engine
    scheduler decides for them); its control channel is a shared-memory segment (kv/channel.py)."""

    name: str
    model: str
    dp_rank: int
    device: str
    floor_bytes: int
    ceiling_bytes: int
    """Over the group's ranks: kv_floor_gib and kv_cache_gib times attention_tp."""
    ttft_slo_s: float
    tbt_slo_s: float


class KvPoolPlan(_Frozen):
    """Elastic KV: the KV byte budget of one attention device, shared by its groups."""

    device: str
    budget_bytes: int


class FfnAgentPlan(_Frozen):
    id: str
    threads: int
    lanes: int
    models: list[str]
    weight_bytes: int
    cpus: list[int]
    spin_us: int
    """How long the agent watches for a call inside a forward pass before it sleeps (crosspool/cpus.py)."""


class Plan(_Frozen):
    deployment: str
    digest: str
    token: str
    generation: int
    host: str
    port: int
    """The front endpoint."""
    control_url: str
    """The daemon's control API: members register and send heartbeats there."""
    ffn_timeout_s: float
    heartbeat_interval_s: float
    max_request_bytes: int
    control_cpus: list[int]
    """Where the daemon, the front, the AtnAgents and the engines' non-rank processes run."""
    models: list[ModelPlan]
    atn_agents: list[str]
    ffn_agents: list[FfnAgentPlan]
    mailboxes: list[MailboxPlan]
    kv_pools: list[KvPoolPlan]
    kv_groups: list[KvGroupPlan]

    def fingerprint(self) -> str:
        """What a member proves it resolved: the whole plan, hashed (config digest included)."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]

    @property
    def shm_prefix(self) -> str:
        return f"{SHM_PREFIX}{self.token}-"

    def inbox_name(self, ffn_agent: str) -> str:
        return f"{self.shm_prefix}inbox-{ffn_agent}"

    def model(self, model_id: str) -> ModelPlan:
        return next(m for m in self.models if m.id == model_id)

    def mailboxes_of(self, model_id: str) -> list[MailboxPlan]:
        return [mb for mb in self.mailboxes if mb.model == model_id]

    def kv_group(self, model_id: str, dp_rank: int) -> KvGroupPlan | None:
        """The model's DP rank's KV Capacity Group; None where its device has no elastic KV."""
        return next((g for g in self.kv_groups if g.model == model_id and g.dp_rank == dp_rank), None)

    def rank_slots(self) -> list[tuple[str, int]]:
        """(model, rank) of every engine rank that attaches to the FFN pool."""
        return [(m.id, rank) for m in self.models for rank in range(m.ranks)]

    def rank_layout(self, model_id: str, rank: int) -> RankLayout:
        """What Instance rank `rank` (dp_rank * attention_tp + tp_rank) of `model_id` attaches
        to: its DP rank's mailbox and the FfnAgents of its layers."""
        model = self.model(model_id)
        assert 0 <= rank < model.ranks, (rank, model.ranks)
        agents = model.agents()
        return RankLayout(
            model=model_id,
            mailbox=self.mailboxes_of(model_id)[rank // model.attention_tp].name,
            layer_agents=model.layer_agents,
            inboxes={a: self.inbox_name(a) for a in agents},
            timeout_s=self.ffn_timeout_s,
            tp_rank=rank % model.attention_tp,
            tp=model.attention_tp,
            spin_us=model.spin_us,
        )


def build_plan(
    deployment: Deployment,
    specs: dict[str, ModelFfnSpec],
    placement: dict[str, list[list[str]]],
    activation_math: dict[str, ActivationMath],
    cpus: CpuPlan,
    *,
    generation: int = 1,
) -> Plan:
    """The immutable plan of one generation; each generation gets fresh segment names.
    `placement` and `activation_math` are per model id, `cpus` the CPU placement (from
    `crosspool.resolve`)."""
    token = secrets.token_hex(4)
    prefix = f"{SHM_PREFIX}{token}-"
    models: list[ModelPlan] = []
    mailboxes: list[MailboxPlan] = []
    for m in deployment.model:
        spec = specs[m.id]
        atn = deployment.attention_of(m)
        models.append(
            ModelPlan(
                id=m.id,
                path=m.path,
                max_model_len=m.max_model_len,
                engine=m.engine,
                dtype=m.dtype,
                hidden=spec.hidden,
                num_layers=len(spec.layers),
                atn_agent=atn,
                layer_agents=placement[m.id],
                url=f"http://{deployment.host}:{bind_port(deployment.host)}",
                activation_math=activation_math[m.id],
                attention_tp=m.attention_tp,
                attention_dp=m.attention_dp,
                rank_cpus=cpus.ranks[m.id],
                spin_us=cpus.rank_spin_us[m.id],
            )
        )
        mailboxes += [
            MailboxPlan(
                index=len(mailboxes) + dp_rank,
                name=f"{prefix}mb-{m.id}-dp{dp_rank}",
                model=m.id,
                dp_rank=dp_rank,
                tp=m.attention_tp,
                atn_agent=atn,
                max_rows=deployment.limits.max_batched_tokens,
                hidden=spec.hidden,
                dtype=m.dtype,
                shards=m.ffn_tp,
            )
            for dp_rank in range(m.attention_dp)
        ]
    budgets = {a.id: a.kv_budget_gib for a in deployment.attention_device if a.kv_budget_gib is not None}
    kv_groups = [
        KvGroupPlan(
            name=f"{prefix}kv-{m.id}-dp{dp_rank}",
            model=m.id,
            dp_rank=dp_rank,
            device=deployment.attention_of(m),
            floor_bytes=int(m.kv_floor_gib * 2**30) * m.attention_tp,
            ceiling_bytes=m.kv_cache_gib * 2**30 * m.attention_tp,
            ttft_slo_s=m.ttft_slo_s,
            tbt_slo_s=m.tbt_slo_s,
        )
        for m in deployment.model
        if deployment.attention_of(m) in budgets
        for dp_rank in range(m.attention_dp)
    ]
    agents = []
    for agent in deployment.ffn_agent:
        held = {m.id: [li for li, group in enumerate(placement[m.id]) if agent.id in group] for m in deployment.model}
        weight_bytes = sum(
            specs[m.id].layers[li].weight_bytes(m.dtype) // len(placement[m.id][li])
            for m in deployment.model
            for li in held[m.id]
        )
        agents.append(
            FfnAgentPlan(
                id=agent.id,
                threads=agent.threads,
                lanes=agent.lanes,
                models=[model for model, layers in held.items() if layers],
                weight_bytes=weight_bytes,
                cpus=cpus.ffn_agents[agent.id],
                spin_us=cpus.ffn_spin_us[agent.id],
            )
        )
    limits = deployment.limits
    return Plan(
        deployment=deployment.name,
        digest=deployment.digest(),
        token=token,
        generation=generation,
        host=deployment.host,
        port=deployment.port,
        control_url=f"http://{deployment.host}:{deployment.control}",
        ffn_timeout_s=limits.ffn_timeout_s,
        heartbeat_interval_s=limits.heartbeat_interval_s,
        max_request_bytes=limits.max_request_bytes,
        control_cpus=cpus.control,
        models=models,
        atn_agents=[a.id for a in deployment.attention_device],
        ffn_agents=agents,
        mailboxes=mailboxes,
        kv_pools=[KvPoolPlan(device=d, budget_bytes=int(gib * 2**30)) for d, gib in budgets.items()],
        kv_groups=kv_groups,
    )
