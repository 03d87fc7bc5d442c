"""FFN spec of a checkpoint: per layer the FFN kind, activation, dims and checkpoint keys."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from safetensors import safe_open

DTYPE_BYTES = {"bfloat16": 2, "float32": 4}


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
        return 3 * self.hidden * self.intermediate * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class ModelFfnSpec:
    path: Path
    architecture: str
    hidden: int
    layers: tuple[GatedDenseFfn, ...]
    key_files: dict[str, str]  # checkpoint key -> safetensors file name

    @property
    def ffn_keys(self) -> frozenset[str]:
        return frozenset(key for layer in self.layers for key in layer.keys)

    def weight_bytes(self, dtype: str) -> int:
        return sum(layer.weight_bytes(dtype) for layer in self.layers)


def _families() -> list[ModuleType]:
    from crosspool.models import llama, qwen2, qwen3

    return [llama, qwen2, qwen3]


def supported_architectures() -> list[str]:
    return sorted(arch for family in _families() for arch in family.ARCHITECTURES)


def checkpoint_keys(path: Path) -> dict[str, str]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelSpecError(f"no safetensors weights in {path}")
    keys: dict[str, str] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            keys.update(dict.fromkeys(f.keys(), file.name))
    return keys


def gated_dense_layers(config: dict, key_prefix: str, keys: dict[str, str]) -> tuple[GatedDenseFfn, ...]:
    """Layers of a family whose every decoder layer has a gated dense MLP at `key_prefix`
    (a format string over the layer index, e.g. "model.layers.{}.mlp.")."""
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        raise ModelSpecError(f"hidden_act {activation!r} is not supported (supported: 'silu')")
    if config.get("mlp_bias", False):
        raise ModelSpecError("mlp_bias = true is not supported")
    layers = []
    for i in range(int(config["num_hidden_layers"])):
        prefix = key_prefix.format(i)
        layer = GatedDenseFfn(
            layer=i,
            hidden=int(config["hidden_size"]),
            intermediate=int(config["intermediate_size"]),
            activation=activation,
            gate_key=prefix + "gate_proj.weight",
            up_key=prefix + "up_proj.weight",
            down_key=prefix + "down_proj.weight",
        )
        missing = [key for key in layer.keys if key not in keys]
        if missing:
            raise ModelSpecError(f"checkpoint lacks FFN tensors {missing}")
        layers.append(layer)
    return tuple(layers)


def load_ffn_spec(path: Path) -> ModelFfnSpec:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelSpecError(f"no config.json in {path}")
    config = json.loads(config_file.read_text())
    architectures = config.get("architectures") or []
    for family in _families():
        for arch in architectures:
            if arch in family.ARCHITECTURES:
                keys = checkpoint_keys(path)
                layers = family.ffn_layers(config, keys)
                return ModelFfnSpec(path, arch, int(config["hidden_size"]), layers, keys)
    raise ModelSpecError(
        f"architecture {architectures} is not supported; supported: {', '.join(supported_architectures())}"
    )
