"""Load exactly the FFN tensors an FfnAgent is assigned, one tensor at a time (never the whole checkpoint)."""

from __future__ import annotations

from safetensors import safe_open

from crosspool.agents.ffn.dense import ActivationMath, GatedDenseFfn, LinearFactory
from crosspool.models.spec import ModelFfnSpec
from crosspool.transport.mailbox import DTYPES


def shard_range(size: int, index: int, count: int) -> tuple[int, int]:
    """Rows [start, end) of shard `index` of `count` over `size` rows; the first size % count
    shards get one more (so any count up to `size` works, e.g. 3 agents on 1536 or 1000 rows)."""
    assert 0 <= index < count <= size, (index, count, size)
    base, extra = divmod(size, count)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


def load_dense_layers(
    spec: ModelFfnSpec,
    dtype: str,
    activation_math: ActivationMath,
    linear: LinearFactory,
    layers: list[int] | None = None,
    shards: dict[int, tuple[int, int]] | None = None,
) -> dict[int, GatedDenseFfn]:
    """The FFNs of `layers` (default: all) with the engine's arithmetic and kernels. With
    `shards[layer] = (index, count)` only that tensor-parallel shard is read from the checkpoint:
    rows of gate and up and columns of down of one slice of the intermediate dimension."""
    chosen = [spec.layers[i] for i in (range(len(spec.layers)) if layers is None else layers)]
    torch_dtype = DTYPES[dtype]
    by_file: dict[str, list[tuple[str, int]]] = {}
    for layer in chosen:
        for key in layer.keys:
            by_file.setdefault(spec.key_files[key], []).append((key, layer.layer))
    tensors = {}
    for file, keys in by_file.items():
        with safe_open(spec.path / file, framework="pt") as f:
            for key, layer_index in sorted(keys):
                index, count = (shards or {}).get(layer_index, (0, 1))
                if count == 1:
                    tensors[key] = f.get_tensor(key).to(torch_dtype)
                    continue
                start, end = shard_range(spec.layers[layer_index].intermediate, index, count)
                part = f.get_slice(key)
                down = key == spec.layers[layer_index].down_key
                tensors[key] = (part[:, start:end] if down else part[start:end]).to(torch_dtype)
    return {
        l.layer: GatedDenseFfn(tensors[l.gate_key], tensors[l.up_key], tensors[l.down_key], activation_math, linear)
        for l in chosen
    }
