"""The parameterless module an engine builds in place of a decoder layer's FFN: engine-neutral.

Each integration subclasses it to attach its rank to the pool at construction (where the
engine's parallel state is known) and to match its engine's module contract."""

from __future__ import annotations

import re

import torch
from torch import nn

from crosspool.models.spec import ModelFfnSpec, MoeFfn


class FfnStandIn(nn.Module):
    """Holds no weight; forward sends the rows to the FFN pool through `crosspool::ffn_shim`."""

    def __init__(self, spec: ModelFfnSpec, prefix: str, *, moe: bool) -> None:
        super().__init__()
        match = re.search(r"layers\.(\d+)\.", prefix + ".")
        assert match, f"cannot tell the layer index from module prefix {prefix!r}"
        self.layer = int(match.group(1))
        self.hidden_size = spec.hidden
        kind = isinstance(spec.layers[self.layer], MoeFfn)
        assert kind == moe, f"the engine and the FFN spec disagree on layer {self.layer}'s kind (MoE: {kind})"

    def forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        flat = x.reshape(-1, self.hidden_size)
        out = torch.empty_like(flat)  # a fresh tensor: engines may overwrite the FFN output in place
        torch.ops.crosspool.ffn_shim(flat, out, self.layer)
        return out.view(x.shape)
