"""`sglang.srt.plugins` entry point (allow-listed by SGLANG_PLUGINS): active only in processes
launched by CrossPool.

SGLang runs plugins in its main process, in every scheduler (one per TP rank) and in the
detokenizer, before the model is built. With CROSSPOOL_PLAN set, `register` replaces the MLP
classes of the supported dense families (the native constructor never runs, so no FFN weight is
allocated) and drops the FFN tensors from weight loading. Without it, SGLang stays native.

SGLang logs and swallows any exception a plugin raises (srt/plugins/__init__.py), so a failure
here would leave the engine silently native. `register` therefore never raises: the checks run
in the stand-in's constructor, inside model construction, where an exception stops the
scheduler and with it the server; the daemon also requires every rank to register.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from crosspool import envs, ops
from crosspool.integrations.refusals import runtime_problems
from crosspool.integrations.sglang.options import FAMILIES, UNSUPPORTED, prefill_cp_problems
from crosspool.integrations.standin import FfnStandIn, attach_rank, filter_ffn_weights
from crosspool.ipc import die_with_supervisor
from crosspool.member import load_membership
from crosspool.models.spec import load_ffn_spec
from crosspool.plan import ModelPlan, Plan

_state: dict[str, Any] = {}


def _runtime_problems(model: ModelPlan) -> list[str]:
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.runtime_context import get_server_args

    args = resolved_view(get_server_args())
    seen = {k: getattr(args, k, fine) for k, (fine, _) in UNSUPPORTED.items()}
    # Resolution turns some unset fields into empty values (custom_weight_loader None -> []).
    seen = {k: UNSUPPORTED[k][0] if not v and not UNSUPPORTED[k][0] else v for k, v in seen.items()}
    problems = runtime_problems(seen, UNSUPPORTED)
    cp = {k: getattr(args, k) for k in ("attn_cp_size", "enable_prefill_cp", "cp_strategy")}
    problems += prefill_cp_problems(cp, args.tp_size, _state["spec"].architecture)
    if args.tp_size != model.attention_tp:
        problems.append(f"tp_size={args.tp_size} is not the planned {model.attention_tp}")
    if args.dp_size != model.attention_dp:
        problems.append(f"dp_size={args.dp_size} is not the planned {model.attention_dp}")
    if Path(args.model_path).resolve() != Path(model.path).resolve():
        problems.append(f"model_path {args.model_path} is not the planned {model.path}")
    if args.dtype != model.dtype:
        problems.append(f"dtype {args.dtype} is not the planned {model.dtype}")
    from sglang.srt.layers.quantization import unquant

    if unquant._is_cpu_amx_available:  # the path SGLang's linears took at import
        problems.append("SGLang computes with sgl_kernel's AMX kernels here, which the FFN pool does not reproduce")
    return problems


def _attach() -> int:
    """Once per scheduler (rank) process, at model construction: check the server arguments,
    attach the rank's Transport. Returns the rank's TP rank."""
    from sglang.srt.runtime_context import get_parallel

    tp_rank: int = get_parallel().tp_rank
    if ops.attached():
        return tp_rank
    plan: Plan = _state["plan"]
    model: ModelPlan = _state["model"]
    problems = _runtime_problems(model)
    if problems:
        raise RuntimeError("CrossPool cannot serve this SGLang configuration: " + "; ".join(problems))
    dp_rank = get_parallel().dp_rank or 0  # None without a DP controller
    rank = dp_rank * model.attention_tp + tp_rank
    attach_rank(plan, _state["secret"], model.id, rank)
    group = plan.kv_group(model.id, dp_rank)
    if group is not None:  # the scheduler is being built; its loop starts after
        from crosspool.integrations.sglang import kv

        kv.install(group)
    return tp_rank


class CrossPoolFfn(FfnStandIn):
    """Stands in for Qwen2MLP / Qwen3MLP / LlamaMLP, built with `reduce_results=False`: SGLang
    sums the FFN output over the TP group after the layer (layer_boundary). Every TP rank reads
    the pool's whole result, so rank 0 returns it and the others return zeros: the sum is exact."""

    gate_up_proj = None  # read (and ignored off CUDA) by the Qwen2 / Llama layers' norm fusion

    def __init__(self, *args: Any, prefix: str = "", **kwargs: Any) -> None:
        super().__init__(_state["spec"], prefix, moe=False)
        self.tp_leader = _attach() == 0

    def forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if x.shape[0] == 0:  # an empty batch still runs the layer
            return torch.empty_like(x)
        out = super().forward(x)
        return out if self.tp_leader else out.zero_()


def _filter_ffn_weights(ffn_keys: frozenset[str]) -> None:
    from sglang.srt.model_loader.loader import DefaultModelLoader

    filter_ffn_weights(DefaultModelLoader, "_get_all_weights", ffn_keys)


def _require_stand_ins() -> None:
    """Model construction fails unless it attached this rank to the pool: a plan that could not
    be loaded, or a model none of whose FFN modules was replaced, must not serve natively."""
    from sglang.srt.model_loader import loader

    native = loader._initialize_model

    def _initialize_model(*args: Any, **kwargs: Any) -> Any:
        if "error" in _state:
            raise RuntimeError(f"CrossPool cannot serve through SGLang: {_state['error']}")
        model = native(*args, **kwargs)
        if not ops.attached():
            raise RuntimeError(f"CrossPool replaced no FFN module of {type(model).__name__}")
        return model

    loader._initialize_model = _initialize_model


def register() -> None:
    plan_path = os.environ.get(envs.PLAN)
    if not plan_path or "registered" in _state:
        return
    _state["registered"] = True
    try:
        die_with_supervisor()  # the server's main process; SGLang's children die with it
        _require_stand_ins()
        plan, secret = load_membership(Path(plan_path))
        model = plan.model(os.environ[envs.MODEL])
        spec = load_ffn_spec(model.path)
        if spec.architecture not in FAMILIES:
            raise ValueError(f"{spec.architecture} is not served through SGLang (supported: {', '.join(FAMILIES)})")
        _filter_ffn_weights(spec.ffn_keys)
        from crosspool.integrations.sglang.cp import install_torch_native_prefill_cp

        install_torch_native_prefill_cp()  # only batches SGLang splits for prefill CP take it
        from sglang.srt.models import llama, qwen2, qwen3

        # Module globals, read when the decoder layers are built; qwen3 imports Qwen2MLP as Qwen3MLP.
        llama.LlamaMLP = CrossPoolFfn  # type: ignore[misc,assignment]
        qwen2.Qwen2MLP = CrossPoolFfn  # type: ignore[misc,assignment]
        qwen3.Qwen3MLP = CrossPoolFfn  # type: ignore[misc,assignment]
        _state.update(plan=plan, secret=secret, model=model, spec=spec)
    except Exception as e:  # SGLang would swallow it: model construction raises it instead
        _state["error"] = f"{type(e).__name__}: {e}"
