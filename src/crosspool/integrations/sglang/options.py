"""SGLang server arguments CrossPool does not support (fail closed), each with the reason. Pure
data: no sglang import. Names and defaults are sglang 0.5.23's (`srt/arg_groups/fields/*.py`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from crosspool.integrations import refusals

# Dense families whose MLP class the plugin replaces (MoE families are not served through SGLang yet).
FAMILIES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

_NO_DECODE_CP = (
    "decode context parallelism is implemented by SGLang's GPU attention backends only (triton, the MLA "
    "backends); its CPU backends have none (docs/context-parallel.md)"
)
_LAYOUT = "changes which rows reach the FFN (the pool computes exactly the rows one rank hands it)"

# server argument -> (value that is fine, reason it is refused otherwise)
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "speculative_algorithm": (None, "speculative decoding runs draft FFNs CrossPool does not place"),
    "enable_lora": (None, "LoRA adapters on the FFN would be applied by nobody (FFN runs in the pool)"),
    "lora_paths": (None, "LoRA adapters on the FFN would be applied by nobody (FFN runs in the pool)"),
    "pp_size": (1, "pipeline parallelism is not qualified with the FFN pool"),
    "quantization": (None, "the FFN pool executes unquantized bf16/fp32 weights only"),
    "modelopt_quant": (None, "the FFN pool executes unquantized bf16/fp32 weights only"),
    "quantize_and_serve": (False, "the FFN pool executes unquantized bf16/fp32 weights only"),
    "attn_dp_size": (1, "DP attention gathers all DP ranks' rows into one TP FFN: not qualified yet"),
    "enable_dp_attention": (False, "DP attention gathers all DP ranks' rows into one TP FFN: not qualified yet"),
    "enable_dp_lm_head": (False, "belongs to DP attention, which is not qualified yet"),
    "enable_dense_mlp_attn_tp": (False, _LAYOUT),
    "moe_dense_tp_size": (None, _LAYOUT),
    "enable_layernorm_sp": (False, _LAYOUT),
    "enable_attn_tp_input_scattered": (False, _LAYOUT),
    "dcp_size": (1, _NO_DECODE_CP),
    "ep_size": (1, "expert parallelism belongs to the FFN pool, not the engine"),
    "moe_a2a_backend": ("none", "expert parallelism belongs to the FFN pool, not the engine"),
    "enable_eplb": (False, "expert parallelism belongs to the FFN pool, not the engine"),
    "disaggregation_mode": ("null", "prefill/decode disaggregation is not supported"),
    "enable_pdmux": (False, "prefill/decode multiplexing is not supported"),
    "page_size": (1, "elastic KV withdraws and releases single token slots (SGLang's CPU page size)"),
    "enable_hierarchical_cache": (False, "the hierarchical KV cache is not qualified with elastic KV"),
    "enable_lmcache": (False, "external KV caches are not supported"),
    "enable_mixed_chunk": (False, "mixed chunked prefill is not qualified with the FFN pool"),
    "enable_torch_compile": (False, "SGLang's CPU torch.compile decode graph is not qualified: CrossPool serves eager"),
    "enable_two_batch_overlap": (False, "batch overlap splits a layer's FFN call in two: not supported"),
    "enable_single_batch_overlap": (False, "batch overlap splits a layer's FFN call in two: not supported"),
    "cpu_offload_gb": (0, "weight offload would move attention weights the plan does not know about"),
    "rl_on_policy_target": (None, "changes the MLP's input dtype and the norms' arithmetic"),
    "model_impl": ("auto", "other model implementations bypass the FFN module replacement"),
    "is_embedding": (False, "embedding models are not supported"),
    "load_format": ("auto", "only safetensors checkpoints are supported (load_format 'auto')"),
    "weight_cache_mode": ("off", "weight caches bypass the FFN weight filter"),
    "custom_weight_loader": (None, "custom weight loaders bypass the FFN weight filter"),
}

# CrossPool sets these itself from the deployment file.
OWNED = {
    "model_path": "model.path",
    "served_model_name": "model.id",
    "dtype": "model.dtype",
    "context_length": "model.max_model_len",
    "max_running_requests": "model.max_num_seqs",
    "max_total_tokens": "model.kv_cache_gib",
    "chunked_prefill_size": "limits.max_batched_tokens",
    "max_prefill_tokens": "limits.max_batched_tokens",
    "tp_size": "model.attention_tp",
    "dp_size": "model.attention_dp",
    "device": "CPU serving",
    "attention_backend": "CPU serving (torch_native)",
    "port": "deployment.port",
    "host": "deployment.host",
}


def engine_arg_problems(engine_args: dict[str, Any]) -> list[str]:
    return refusals.engine_arg_problems(engine_args, UNSUPPORTED, OWNED)


PREFILL_CP_FAMILIES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
"""Dense families whose SGLang attention is sized by the attention TP group (Llama's by the whole
TP group, `models/llama.py`: not wired for attn_cp_size > 1)."""


def prefill_cp_problems(args: Mapping[str, Any], tp_size: int, architecture: str) -> list[str]:
    """The one CP mode CrossPool serves through SGLang: zigzag prefill CP (`attn_cp_size` =
    `tp_size`, `enable_prefill_cp`), torch_native attention with CrossPool's CP hook
    (integrations/sglang/cp.py), dense Qwen2/Qwen3. A line per reason otherwise."""
    cp, enabled = args.get("attn_cp_size", 1), args.get("enable_prefill_cp", False)
    strategy = args.get("cp_strategy", "zigzag")
    if cp == 1 and not enabled:
        return []
    problems = []
    if cp < 2 or not enabled:
        problems.append(
            f"attn_cp_size={cp}, enable_prefill_cp={enabled}: prefill CP needs both (attn_cp_size >= 2 and "
            "enable_prefill_cp = true)"
        )
    if strategy != "zigzag":
        problems.append(
            f"cp_strategy={strategy!r}: only zigzag is served; SGLang's interleave strategy is for DSA "
            "(sparse MLA) attention only"
        )
    if cp != tp_size:
        problems.append(
            f"attn_cp_size={cp}: must equal the attention TP ({tp_size}); CP with attention TP > 1 inside "
            "each CP rank is not qualified"
        )
    if architecture not in PREFILL_CP_FAMILIES:
        problems.append(
            f"{architecture}: SGLang sizes its attention heads by the whole TP group, so prefill CP would "
            f"split heads wrongly (served: {', '.join(PREFILL_CP_FAMILIES)})"
        )
    return problems
