"""Load exactly the FFN tensors an FfnAgent is assigned, one tensor at a time (never the whole checkpoint)."""

from __future__ import annotations

from safetensors import safe_open

from crosspool.agents.ffn.dense import ActivationMath, GatedDenseFfn, LinearFactory
from crosspool.models.spec import ModelFfnSpec
from crosspool.transport.mailbox import DTYPES


def load_dense_layers(
    spec: ModelFfnSpec,
    dtype: str,
    activation_math: ActivationMath,
    linear: LinearFactory,
    layers: list[int] | None = None,
) -> dict[int, GatedDenseFfn]:
    """The FFNs of `layers` (default: all) with the engine's arithmetic and kernels."""
    chosen = [spec.layers[i] for i in (range(len(spec.layers)) if layers is None else layers)]
    torch_dtype = DTYPES[dtype]
    by_file: dict[str, list[str]] = {}
    for key in sorted(key for layer in chosen for key in layer.keys):
        by_file.setdefault(spec.key_files[key], []).append(key)
    tensors = {}
    for file, keys in by_file.items():
        with safe_open(spec.path / file, framework="pt") as f:
            for key in keys:
                tensors[key] = f.get_tensor(key).to(torch_dtype)
    return {
        l.layer: GatedDenseFfn(tensors[l.gate_key], tensors[l.up_key], tensors[l.down_key], activation_math, linear)
        for l in chosen
    }
