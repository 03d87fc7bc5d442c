"""Load exactly the FFN tensors an FfnAgent is assigned, one tensor at a time (never the whole checkpoint)."""

from __future__ import annotations

from typing import Protocol

import torch
from safetensors import safe_open

from crosspool.agents.ffn.dense import GatedDenseFfn
from crosspool.agents.ffn.moe import RoutedMoeFfn
from crosspool.kernels import EngineKernels
from crosspool.models import spec as ffn_spec
from crosspool.models.spec import DTYPES, ActivationMath, LayerFfn, ModelFfnSpec


class LayerExecutor(Protocol):
    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's FFN of `x` [rows, hidden], written into `out` when given."""
        ...


def shard_range(size: int, index: int, count: int) -> tuple[int, int]:
    """Rows [start, end) of shard `index` of `count` over `size` rows; the first size % count
    shards get one more (so any count up to `size` works, e.g. 3 agents on 1536 or 1000 rows)."""
    assert 0 <= index < count <= size, (index, count, size)
    base, extra = divmod(size, count)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


def _sliced(layer: LayerFfn) -> dict[str, tuple[int, int]]:
    """Key -> (dimension a tensor-parallel shard slices, its size): the intermediate dimension of
    every gated dense part (rows of gate and up, columns of down). Router tensors are whole."""
    out = {}
    for d in (layer,) if isinstance(layer, ffn_spec.GatedDenseFfn) else layer.denses:
        out.update({d.gate_key: (0, d.intermediate), d.up_key: (0, d.intermediate), d.down_key: (1, d.intermediate)})
    return out


def load_layers(
    spec: ModelFfnSpec,
    dtype: str,
    activation_math: ActivationMath,
    kernels: EngineKernels,
    layers: list[int] | None = None,
    shards: dict[int, tuple[int, int]] | None = None,
    *,
    device: torch.device | str = "cpu",
    fuse_gate_up: bool = True,
) -> dict[int, LayerExecutor]:
    """The FFNs of `layers` (default: all) with the engine's arithmetic and kernels, on `device`.
    With `shards[layer] = (index, count)` only that tensor-parallel shard is read from the
    checkpoint: one slice of the intermediate dimension of every dense FFN and routed or shared
    expert. `fuse_gate_up=False` keeps a dense FFN's gate and up GEMMs apart (see GatedDenseFfn)."""
    chosen = [spec.layers[i] for i in (range(len(spec.layers)) if layers is None else layers)]
    wanted: dict[str, list[tuple[str, LayerFfn]]] = {}
    sliced = {layer.layer: _sliced(layer) for layer in chosen}
    for layer in chosen:
        for key in layer.keys:
            wanted.setdefault(spec.key_files[key], []).append((key, layer))
    t: dict[str, torch.Tensor] = {}
    for file, keys in wanted.items():
        with safe_open(spec.path / file, framework="pt") as f:
            for key, layer in keys:
                index, count = (shards or {}).get(layer.layer, (0, 1))
                if key not in sliced[layer.layer] or count == 1:
                    tensor = f.get_tensor(key)
                else:
                    dim, size = sliced[layer.layer][key]
                    start, end = shard_range(size, index, count)
                    tensor = f.get_slice(key)[:, start:end] if dim else f.get_slice(key)[start:end]
                # The routing correction bias stays fp32, as engines keep it.
                bias = isinstance(layer, ffn_spec.MoeFfn) and key == layer.bias_key
                t[key] = tensor.to(device, torch.float32 if bias else DTYPES[dtype])
    return {layer.layer: _executor(layer, t, activation_math, kernels, fuse_gate_up) for layer in chosen}


def _executor(
    layer: LayerFfn, t: dict[str, torch.Tensor], math: ActivationMath, kernels: EngineKernels, fuse_gate_up: bool
) -> LayerExecutor:
    def dense(d: ffn_spec.GatedDenseFfn) -> GatedDenseFfn:
        return GatedDenseFfn(t[d.gate_key], t[d.up_key], t[d.down_key], math, kernels.linear, fuse_gate_up)

    if isinstance(layer, ffn_spec.GatedDenseFfn):
        return dense(layer)
    w13 = torch.stack([torch.cat([t[e.gate_key], t[e.up_key]]) for e in layer.experts])
    w2 = torch.stack([t[e.down_key] for e in layer.experts])
    bias = t[layer.bias_key] if layer.bias_key else None
    kernel = kernels.moe(t[layer.router_key], bias, w13, w2, layer.routing)
    shared = dense(layer.shared) if layer.shared else None
    return RoutedMoeFfn(kernel, shared, layer.routing.routed_scaling_factor, math)
