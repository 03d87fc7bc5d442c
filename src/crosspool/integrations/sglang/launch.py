"""How CrossPool starts SGLang: the server command and its environment. Imports no sglang."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from crosspool import envs
from crosspool.config import ModelConfig
from crosspool.integrations import command_flags, threads_bind
from crosspool.integrations.sglang.options import FAMILIES, engine_arg_problems, prefill_cp_problems
from crosspool.models.spec import ActivationMath, dtype_bytes

ENGINE = "sglang"
VERSION = "0.5.23"
# SGLang's /health runs a one-token generation through the scheduler and answers after at least
# 1 s (entrypoints/http_server.py health_generate): asked every second it would load the scheduler
# and time out under load. /v1/models is answered by the HTTP server alone.
LIVENESS_PATH = "/v1/models"
ARCHITECTURES: tuple[str, ...] | None = FAMILIES


STANDIN = "crosspool-sgl-kernel-standin"
"""CrossPool's `sgl_kernel` module without kernels (scripts/sglang-cpu/install.sh)."""


def _sgl_kernel_is_standin() -> bool:
    """Whether `import sgl_kernel` would load CrossPool's stand-in (checked without importing it)."""
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or spec.origin is None:
        return False
    try:
        standin = importlib.metadata.distribution(STANDIN).locate_file("sgl_kernel/__init__.py")
    except importlib.metadata.PackageNotFoundError:
        return False
    return Path(str(standin)).resolve() == Path(spec.origin).resolve()


def host_problems() -> list[str]:
    """Why SGLang's CPU path on this host is not the one the FFN pool reproduces, if it is not.

    SGLang computes linears (and activations and norms) with `sgl_kernel`'s AMX kernels when
    `cpu_has_amx_support()` holds: an AMX CPU and a `torch.ops.sgl_kernel` library registering
    `convert_weight_packed` (srt/utils/common.py). CrossPool's stand-in registers no operator, so
    SGLang takes its native torch path (`F.linear`, `forward_native`) on every CPU, and so does
    the pool. A real sgl_kernel on an AMX CPU would switch SGLang to the packed path."""
    if not torch.cpu._is_amx_tile_supported() or _sgl_kernel_is_standin():
        return []
    return [
        "engine: SGLang on this AMX CPU would compute with sgl_kernel's packed AMX kernels (sgl_kernel is "
        f"installed and is not {STANDIN}), which the FFN pool does not reproduce; install the stand-in "
        '(scripts/sglang-cpu/install.sh) or use engine = "vllm"'
    ]


def model_problems(model: ModelConfig) -> list[str]:
    """What of this model's configuration SGLang cannot serve with CrossPool (field named)."""
    problems = host_problems() + engine_arg_problems(model.engine_args)
    if any(k.replace("-", "_") in ("attn_cp_size", "enable_prefill_cp") for k in model.engine_args):
        args = {k.replace("-", "_"): v for k, v in model.engine_args.items()}
        architecture = json.loads((model.path / "config.json").read_text())["architectures"][0]
        problems += [f"engine_args.{p}" for p in prefill_cp_problems(args, model.attention_tp, architecture)]
    if model.attention_dp != 1:
        # Its DP controller's replicas would attach as ranks dp * tp + tp_rank, but no run has
        # checked them against native SGLang DP: refused until qualified (vLLM serves DP).
        problems.append(
            f"attention_dp: SGLang data parallelism is not qualified with CrossPool; "
            f'use engine = "vllm" for attention DP (got {model.attention_dp})'
        )
    return problems


def activation_math(model: ModelConfig) -> ActivationMath:
    """SGLang on x86 CPU without AMX runs SiluAndMul.forward_native in the model dtype (two
    roundings; srt/layers/activation.py) and serves eager only (torch.compile is refused)."""
    return "dtype"


def kv_cache_tokens(model: ModelConfig, kv_bytes: int | None = None) -> int:
    """`max_total_tokens` that fits `kv_bytes` (default: `kv_cache_gib`): SGLang's CPU default
    sizes the KV pool from the host's free memory, which several Instances on one host cannot all
    have."""
    config = json.loads((model.path / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    per_token = config["num_hidden_layers"] * 2 * config.get("num_key_value_heads", heads) * head_dim
    kv_bytes = model.kv_cache_gib * 2**30 if kv_bytes is None else kv_bytes
    return kv_bytes // (per_token * dtype_bytes(model.dtype))


def engine_env(model: ModelConfig, plan_path: Path | None, rank_cpus: list[list[int]]) -> dict[str, str]:
    """Environment of an engine process; `plan_path` None means native SGLang (no CrossPool). Its
    schedulers bind to `rank_cpus` (SGLANG_CPU_OMP_THREADS_BIND, one group per rank). SGLang
    applies that variable only with its AMX kernels (`distributed/bootstrap.py`), which CrossPool's
    SGLang path does not use; torch would then run as many threads as the process may use CPUs
    (a native scheduler on 2 cores: 2), so the rank's thread count is set (OMP_NUM_THREADS)."""
    env = envs.sharing_cores(os.environ)
    assert len(rank_cpus) == model.ranks, rank_cpus
    assert len({len(cpus) for cpus in rank_cpus}) == 1, rank_cpus
    env.update(
        SGLANG_USE_CPU_ENGINE="1",
        SGLANG_PLUGINS="crosspool",
        PYTHONUNBUFFERED="1",
        SGLANG_CPU_OMP_THREADS_BIND=threads_bind(rank_cpus),
        OMP_NUM_THREADS=str(len(rank_cpus[0])),
    )
    env.pop(envs.PLAN, None)
    if plan_path is not None:
        env.update({envs.PLAN: str(plan_path), envs.MODEL: model.id})
    return env


def engine_kwargs(model: ModelConfig, max_batched_tokens: int) -> dict[str, Any]:
    """SGLang server arguments of a model; the same for native and CrossPool runs."""
    return {
        "model_path": str(model.path),
        "served_model_name": model.id,
        "dtype": model.dtype,
        "context_length": model.max_model_len,
        "max_running_requests": model.max_num_seqs,
        "max_total_tokens": kv_cache_tokens(model),
        "chunked_prefill_size": max_batched_tokens,
        "max_prefill_tokens": max_batched_tokens,
        "tp_size": model.attention_tp,
        "dp_size": model.attention_dp,
        "device": "cpu",
        "attention_backend": "torch_native",
        **model.engine_args,
    }


def server_command(model: ModelConfig, max_batched_tokens: int, host: str, port: int) -> list[str]:
    argv = [sys.executable, "-m", "sglang.launch_server", "--host", host, "--port", str(port)]
    argv += command_flags(engine_kwargs(model, max_batched_tokens))
    return argv
