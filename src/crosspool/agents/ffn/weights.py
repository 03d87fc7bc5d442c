"""Load exactly the FFN tensors an FfnAgent is assigned, one tensor at a time (never the whole checkpoint)."""

from __future__ import annotations

from safetensors import safe_open

from crosspool.agents.ffn.dense import ActivationMath, GatedDenseFfn
from crosspool.models.spec import ModelFfnSpec
from crosspool.transport.mailbox import DTYPES


def load_dense_layers(spec: ModelFfnSpec, dtype: str, activation_math: ActivationMath) -> list[GatedDenseFfn]:
    torch_dtype = DTYPES[dtype]
    by_file: dict[str, list[str]] = {}
    for key in sorted(spec.ffn_keys):
        by_file.setdefault(spec.key_files[key], []).append(key)
    tensors = {}
    for file, keys in by_file.items():
        with safe_open(spec.path / file, framework="pt") as f:
            for key in keys:
                tensors[key] = f.get_tensor(key).to(torch_dtype)
    return [
        GatedDenseFfn(tensors[l.gate_key], tensors[l.up_key], tensors[l.down_key], activation_math) for l in spec.layers
    ]
