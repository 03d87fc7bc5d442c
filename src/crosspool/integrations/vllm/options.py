"""vLLM modes CrossPool does not support (fail closed), each with the reason. Pure data: no vllm import."""

from __future__ import annotations

from typing import Any

from crosspool.integrations import refusals

# engine argument -> (value that is fine, reason it is refused otherwise)
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "speculative_config": (None, "speculative decoding runs draft FFNs CrossPool does not place"),
    "enable_lora": (False, "LoRA adapters on the FFN would be applied by nobody (FFN runs in the pool)"),
    "quantization": (None, "the FFN pool executes unquantized bf16/fp32 weights only"),
    "pipeline_parallel_size": (1, "pipeline parallelism is not qualified with the FFN pool"),
    "decode_context_parallel_size": (
        1,
        "decode context parallelism needs an attention backend that returns the softmax LSE to merge "
        "partial outputs; vLLM's CPU attention does not, and its CPU slot mapping accepts CP size 1 only "
        "(docs/context-parallel.md)",
    ),
    "prefill_context_parallel_size": (
        1,
        "prefill context parallelism runs only in vLLM's Model Runner V2, which needs Triton (absent on "
        "CPU), and only for MLA models (docs/context-parallel.md)",
    ),
    "enable_expert_parallel": (False, "expert parallelism belongs to the FFN pool, not the engine"),
    "cpu_offload_gb": (0, "weight offload would move attention weights the plan does not know about"),
    "kv_transfer_config": (None, "KV transfer / disaggregated serving is not supported"),
    "load_format": ("auto", "only safetensors checkpoints are supported (load_format 'auto')"),
}

# CrossPool sets these itself from the deployment file.
OWNED = {
    "model": "model.path",
    "dtype": "model.dtype",
    "max_model_len": "model.max_model_len",
    "max_num_seqs": "model.max_num_seqs",
    "max_num_batched_tokens": "limits.max_batched_tokens",
    "enforce_eager": "model.enforce_eager",
    "tensor_parallel_size": "model.attention_tp",
    "data_parallel_size": "model.attention_dp",
    "port": "deployment.port",
    "host": "deployment.host",
}


def engine_arg_problems(engine_args: dict[str, Any]) -> list[str]:
    return refusals.engine_arg_problems(engine_args, UNSUPPORTED, OWNED)
