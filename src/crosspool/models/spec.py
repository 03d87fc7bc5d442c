"""FFN spec of a checkpoint: per layer the FFN kind (gated dense or MoE), dims, routing and keys."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import torch
from safetensors import SafetensorError, safe_open

DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}
"""The model dtypes CrossPool serves, by their deployment-file names."""

ActivationMath = Literal["fp32", "dtype"]
"""How an engine rounds a gated FFN's activation: `dtype` rounds SiLU and the product to the
model dtype (eager vLLM, SGLang), `fp32` computes both in fp32 and rounds once (inductor's fusion
in vLLM's compile mode)."""


def dtype_bytes(dtype: str) -> int:
    return DTYPES[dtype].itemsize


class ModelSpecError(ValueError):
    pass


@dataclass(frozen=True)
class GatedDenseFfn:
    """out = down(act(gate(x)) * up(x)); weights in checkpoint (out, in) layout."""

    layer: int
    hidden: int
    intermediate: int
    activation: str
    gate_key: str
    up_key: str
    down_key: str

    @property
    def keys(self) -> tuple[str, str, str]:
        return (self.gate_key, self.up_key, self.down_key)

    def weight_bytes(self, dtype: str) -> int:
        return 3 * self.hidden * self.intermediate * dtype_bytes(dtype)


@dataclass(frozen=True)
class MoeRouting:
    """How a token picks its experts; field names follow vLLM's router arguments."""

    top_k: int
    scoring: str  # "softmax" | "sigmoid"
    renormalize: bool  # divide the top-k weights by their sum
    grouped: bool  # DeepSeek's grouped top-k; otherwise top-k over the router logits
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0


@dataclass(frozen=True)
class MoeFfn:
    """out = routed_scaling_factor * sum_k w_k * expert_k(x) [+ shared(x)]; every expert (and the
    shared expert) is a gated dense SiLU FFN. `intermediate` is one routed expert's."""

    layer: int
    hidden: int
    intermediate: int
    router_key: str
    bias_key: str | None  # the routing correction bias (DeepSeek-V3's noaux_tc), fp32
    experts: tuple[GatedDenseFfn, ...]
    shared: GatedDenseFfn | None
    routing: MoeRouting

    @property
    def activation(self) -> str:
        return self.experts[0].activation

    @property
    def denses(self) -> tuple[GatedDenseFfn, ...]:
        """The routed experts, then the shared expert if any."""
        return self.experts + ((self.shared,) if self.shared else ())

    @property
    def keys(self) -> tuple[str, ...]:
        extra = (self.router_key, *([self.bias_key] if self.bias_key else []))
        return extra + tuple(key for d in self.denses for key in d.keys)

    def weight_bytes(self, dtype: str) -> int:
        router = len(self.experts) * self.hidden * dtype_bytes(dtype)
        shared = self.shared.weight_bytes(dtype) if self.shared else 0
        return router + sum(e.weight_bytes(dtype) for e in self.experts) + shared


LayerFfn = GatedDenseFfn | MoeFfn


@dataclass(frozen=True)
class ModelFfnSpec:
    path: Path
    architecture: str
    hidden: int
    layers: tuple[LayerFfn, ...]
    key_files: dict[str, str]  # checkpoint key -> safetensors file name

    @property
    def ffn_keys(self) -> frozenset[str]:
        return frozenset(key for layer in self.layers for key in layer.keys)

    def weight_bytes(self, dtype: str) -> int:
        return sum(layer.weight_bytes(dtype) for layer in self.layers)


def _families() -> list[ModuleType]:
    from crosspool.models import deepseek_v2, llama, qwen2, qwen3, qwen3_moe

    return [llama, qwen2, qwen3, qwen3_moe, deepseek_v2]


def supported_architectures() -> list[str]:
    return sorted(arch for family in _families() for arch in family.ARCHITECTURES)


def _json(file: Path) -> dict[str, Any]:
    try:
        value = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelSpecError(f"{file} is not readable JSON: {e}") from None
    if not isinstance(value, dict):
        raise ModelSpecError(f"{file} holds {type(value).__name__}, not a JSON object")
    return value


def checkpoint_keys(path: Path) -> dict[str, str]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = _json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelSpecError(f"{index} has no weight_map object")
        return {str(k): str(v) for k, v in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelSpecError(f"no safetensors weights in {path}")
    keys: dict[str, str] = {}
    for file in files:
        try:  # safetensors checks at open that the data covers every tensor: a truncated file fails here
            with safe_open(file, framework="pt") as f:
                keys.update(dict.fromkeys(f.keys(), file.name))
        except (SafetensorError, OSError) as e:
            raise ModelSpecError(f"{file} is not a complete safetensors file: {e}") from None
    return keys


def _activation(config: dict) -> str:
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        raise ModelSpecError(f"hidden_act {activation!r} is not supported (supported: 'silu')")
    if config.get("mlp_bias", False):
        raise ModelSpecError("mlp_bias = true is not supported")
    return str(activation)


def _present(layer: LayerFfn, keys: dict[str, str]) -> LayerFfn:
    missing = [key for key in layer.keys if key not in keys]
    if missing:
        raise ModelSpecError(f"checkpoint lacks FFN tensors {missing[:6]}" + (" ..." if len(missing) > 6 else ""))
    return layer


def gated_dense(config: dict, layer: int, prefix: str, intermediate: int) -> GatedDenseFfn:
    """The gated dense SiLU FFN whose tensors are `{prefix}{gate,up,down}_proj.weight`."""
    return GatedDenseFfn(
        layer=layer,
        hidden=int(config["hidden_size"]),
        intermediate=intermediate,
        activation=_activation(config),
        gate_key=prefix + "gate_proj.weight",
        up_key=prefix + "up_proj.weight",
        down_key=prefix + "down_proj.weight",
    )


def dense_layer(config: dict, layer: int, prefix: str, keys: dict[str, str]) -> GatedDenseFfn:
    dense = gated_dense(config, layer, prefix, int(config["intermediate_size"]))
    _present(dense, keys)
    return dense


def moe_layer(
    config: dict,
    layer: int,
    prefix: str,
    keys: dict[str, str],
    *,
    experts: int,
    routing: MoeRouting,
    shared_intermediate: int = 0,
    bias: bool = False,
) -> MoeFfn:
    """A MoE layer with HF's per-expert keys: `{prefix}gate.weight` (router),
    `{prefix}experts.{e}.*_proj.weight` and `{prefix}shared_experts.*_proj.weight`."""
    intermediate = int(config["moe_intermediate_size"])
    if not 1 <= routing.top_k <= experts or experts % routing.n_group:
        raise ModelSpecError(f"{experts} experts cannot route top-{routing.top_k} over {routing.n_group} groups")
    moe = MoeFfn(
        layer=layer,
        hidden=int(config["hidden_size"]),
        intermediate=intermediate,
        router_key=prefix + "gate.weight",
        bias_key=prefix + "gate.e_score_correction_bias" if bias else None,
        experts=tuple(gated_dense(config, layer, f"{prefix}experts.{e}.", intermediate) for e in range(experts)),
        shared=gated_dense(config, layer, prefix + "shared_experts.", shared_intermediate)
        if shared_intermediate
        else None,
        routing=routing,
    )
    _present(moe, keys)
    return moe


def gated_dense_layers(config: dict, key_prefix: str, keys: dict[str, str]) -> tuple[GatedDenseFfn, ...]:
    """Layers of a family whose every decoder layer has a gated dense MLP at `key_prefix`
    (a format string over the layer index, e.g. "model.layers.{}.mlp.")."""
    return tuple(dense_layer(config, i, key_prefix.format(i), keys) for i in range(int(config["num_hidden_layers"])))


def load_ffn_spec(path: Path) -> ModelFfnSpec:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelSpecError(f"no config.json in {path}")
    config = _json(config_file)
    architectures = config.get("architectures") or []
    for family in _families():
        for arch in architectures:
            if arch in family.ARCHITECTURES:
                keys = checkpoint_keys(path)
                try:
                    layers = family.ffn_layers(config, keys)
                    return ModelFfnSpec(path, arch, int(config["hidden_size"]), layers, keys)
                except ModelSpecError:
                    raise
                except (KeyError, TypeError, ValueError) as e:
                    raise ModelSpecError(f"{config_file} does not describe a {arch}: {type(e).__name__} {e}") from None
    raise ModelSpecError(
        f"architecture {architectures} is not supported; supported: {', '.join(supported_architectures())}"
    )
