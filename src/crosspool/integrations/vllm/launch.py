"""How CrossPool starts vLLM: the OpenAI server command and its environment. Imports no vllm."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from crosspool import envs
from crosspool.config import ModelConfig
from crosspool.integrations import command_flags, threads_bind
from crosspool.integrations.vllm.options import engine_arg_problems
from crosspool.models.spec import ActivationMath

ENGINE = "vllm"
VERSION = "0.32.0"
LIVENESS_PATH = "/health"  # answered by the API server: 200 unless the engine has errored
ARCHITECTURES: tuple[str, ...] | None = None  # every family in crosspool.models


def host_problems() -> list[str]:
    """None: the pool builds every kernel through vLLM's own CPU dispatch, on any host vLLM runs on."""
    return []


def model_problems(model: ModelConfig) -> list[str]:
    """What of this model's configuration vLLM cannot serve with CrossPool (field named)."""
    return engine_arg_problems(model.engine_args)


def activation_math(model: ModelConfig) -> ActivationMath:
    """vLLM on x86 CPU: eager runs SiluAndMul.forward_native in the model dtype (two roundings);
    compile mode lets inductor fuse it in fp32 (model_executor/layers/activation.py, forward_cpu)."""
    return "dtype" if model.enforce_eager else "fp32"


def cache_root(crosspool_enabled: bool) -> Path:
    # vLLM's compile cache key ignores model source code: patched and native runs must not share it.
    return envs.cache_root() / ("vllm-crosspool" if crosspool_enabled else "vllm-native")


def engine_env(model: ModelConfig, plan_path: Path | None, rank_cpus: list[list[int]]) -> dict[str, str]:
    """Environment of an engine process; `plan_path` None means native vLLM (no CrossPool). Its
    workers bind to `rank_cpus` (VLLM_CPU_OMP_THREADS_BIND; vLLM's "auto" wants a NUMA node per
    worker and reserves CPUs for its EngineCore, which CrossPool places itself)."""
    env = envs.sharing_cores(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(model.kv_cache_gib),
        VLLM_CACHE_ROOT=str(cache_root(plan_path is not None)),
        VLLM_PLUGINS="crosspool",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PYTHONUNBUFFERED="1",
    )
    assert len(rank_cpus) == model.ranks, rank_cpus
    env["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind(rank_cpus)
    env.pop(envs.PLAN, None)
    if plan_path is not None:
        env.update({envs.PLAN: str(plan_path), envs.MODEL: model.id})
    return env


def engine_kwargs(model: ModelConfig, max_batched_tokens: int) -> dict[str, Any]:
    """vLLM engine arguments of a model; the same for native and CrossPool runs."""
    return {
        "model": str(model.path),
        "served_model_name": [model.id],
        "dtype": model.dtype,
        "max_model_len": model.max_model_len,
        "max_num_seqs": model.max_num_seqs,
        "max_num_batched_tokens": max_batched_tokens,
        "enforce_eager": model.enforce_eager,
        "tensor_parallel_size": model.attention_tp,
        "data_parallel_size": model.attention_dp,
        **model.engine_args,
    }


def server_command(model: ModelConfig, max_batched_tokens: int, host: str, port: int) -> list[str]:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", host, "--port", str(port)]
    argv += command_flags(engine_kwargs(model, max_batched_tokens))
    argv.append("--disable-uvicorn-access-log")
    return argv
