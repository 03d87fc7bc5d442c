"""`vllm.general_plugins` entry point: active only in processes launched by CrossPool.

vLLM loads general plugins in the API server, in EngineCore and in every worker. When
CROSSPOOL_PLAN is set, `register` replaces the FFN module class of each supported family
before the model is built (the native FFN constructor never runs, so no FFN weight is
allocated) and drops the FFN tensors from weight loading. Without it, vLLM stays native.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from crosspool import envs, ops
from crosspool.integrations.refusals import runtime_problems
from crosspool.integrations.standin import FfnStandIn, attach_rank, filter_ffn_weights
from crosspool.integrations.vllm.options import UNSUPPORTED
from crosspool.ipc import die_with_supervisor
from crosspool.member import load_membership
from crosspool.models.spec import ModelFfnSpec, load_ffn_spec
from crosspool.plan import ModelPlan, Plan

_state: dict[str, Any] = {}


def _runtime_problems(vllm_config: Any, model: ModelPlan, spec: ModelFfnSpec) -> list[str]:
    parallel = vllm_config.parallel_config
    seen = {
        "pipeline_parallel_size": parallel.pipeline_parallel_size,
        "decode_context_parallel_size": parallel.decode_context_parallel_size,
        "prefill_context_parallel_size": getattr(parallel, "prefill_context_parallel_size", 1),
        "enable_expert_parallel": parallel.enable_expert_parallel,
        "speculative_config": vllm_config.speculative_config,
        "enable_lora": vllm_config.lora_config is not None,
        "quantization": vllm_config.model_config.quantization,
    }
    problems = runtime_problems(seen, UNSUPPORTED)
    if parallel.tensor_parallel_size != model.attention_tp:
        problems.append(f"tensor_parallel_size={parallel.tensor_parallel_size} is not the planned {model.attention_tp}")
    # Dense models' DP ranks run as independent DP=1 engines; data_parallel_index keeps the rank.
    if not 0 <= parallel.data_parallel_index < model.attention_dp:
        problems.append(f"data parallel rank {parallel.data_parallel_index} outside the planned {model.attention_dp}")
    archs = vllm_config.model_config.architectures or []
    if spec.architecture not in archs:
        problems.append(f"model architecture {archs} is not the planned {spec.architecture}")
    if str(vllm_config.model_config.dtype).removeprefix("torch.") != model.dtype:
        problems.append(f"dtype {vllm_config.model_config.dtype} is not the planned {model.dtype}")
    return problems


def _attach() -> None:
    """Once per rank process, at model construction: check the engine mode, attach Transport."""
    if ops.attached():
        return
    from vllm.config import get_current_vllm_config
    from vllm.distributed import get_tensor_model_parallel_rank

    plan: Plan = _state["plan"]
    model: ModelPlan = _state["model"]
    problems = _runtime_problems(get_current_vllm_config(), model, _state["spec"])
    if problems:
        raise RuntimeError("CrossPool cannot serve this vLLM configuration: " + "; ".join(problems))
    # Each DP rank is its own EngineCore with its own workers (TP ranks 0..tp-1).
    rank = get_current_vllm_config().parallel_config.data_parallel_index * model.attention_tp
    rank += get_tensor_model_parallel_rank()
    attach_rank(plan, _state["secret"], model.id, rank)


class CrossPoolFfn(FfnStandIn):
    """Stands in for the family's MLP: no parameters; forward calls the FFN pool."""

    def __init__(self, *args: Any, prefix: str = "", **kwargs: Any) -> None:
        super().__init__(_state["spec"], prefix, moe=isinstance(self, CrossPoolMoe))
        _attach()


class CrossPoolMoe(CrossPoolFfn):
    """Stands in for the family's MoE block (router, routed and shared experts all live in the
    pool). The model class counts experts over its MoE blocks at construction; `experts` is what
    it collects for expert-parallel load balancing, which CrossPool refuses."""

    def __init__(self, *args: Any, prefix: str = "", **kwargs: Any) -> None:
        super().__init__(prefix=prefix)
        moe = _state["spec"].layers[self.layer]
        self.n_routed_experts = self.n_logical_experts = len(moe.experts)
        self.n_physical_experts = self.n_local_physical_experts = len(moe.experts)
        self.n_redundant_experts = 0
        self.n_shared_experts = 1 if moe.shared else 0
        self.experts = None


def _filter_ffn_weights(ffn_keys: frozenset[str]) -> None:
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    filter_ffn_weights(DefaultModelLoader, "get_all_weights", ffn_keys)


def register() -> None:
    plan_path = os.environ.get(envs.PLAN)
    if not plan_path or "plan" in _state:
        return
    die_with_supervisor()  # the API server process; vLLM stops its EngineCore when it goes
    plan, secret = load_membership(Path(plan_path))
    model = plan.model(os.environ[envs.MODEL])
    spec = load_ffn_spec(model.path)
    _state.update(plan=plan, secret=secret, model=model, spec=spec)

    from vllm.model_executor.models import deepseek_v2, llama, qwen2, qwen3, qwen3_moe

    # Module globals, read when the decoder layers are built and by the model classes'
    # isinstance checks over their MoE blocks.
    llama.LlamaMLP = CrossPoolFfn  # type: ignore[misc,assignment]
    qwen2.Qwen2MLP = CrossPoolFfn  # type: ignore[misc,assignment]
    qwen3.Qwen3MLP = CrossPoolFfn  # type: ignore[misc,assignment]
    qwen3_moe.Qwen3MoeMLP = CrossPoolFfn  # type: ignore[misc,assignment]
    qwen3_moe.Qwen3MoeSparseMoeBlock = CrossPoolMoe  # type: ignore[misc,assignment]
    deepseek_v2.DeepseekV2MLP = CrossPoolFfn  # type: ignore[misc,assignment]
    deepseek_v2.DeepseekV2MoE = CrossPoolMoe  # type: ignore[misc,assignment]
    _filter_ffn_weights(spec.ffn_keys)
    if any(g.model == model.id for g in plan.kv_groups):
        from crosspool.integrations.vllm import kv

        kv.install(lambda dp_rank: plan.kv_group(model.id, dp_rank))
