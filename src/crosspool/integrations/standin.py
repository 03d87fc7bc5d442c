"""The parameterless module an engine builds in place of a decoder layer's FFN, the rank's
attachment to the pool and the FFN weight filter: engine-neutral.

Each integration subclasses the module to attach its rank to the pool at construction (where
the engine's parallel state is known) and to match its engine's module contract."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from crosspool import ops
from crosspool.member import ControlClient
from crosspool.models.spec import ModelFfnSpec, MoeFfn
from crosspool.plan import Plan
from crosspool.transport.mailbox import RankTransport


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


def attach_rank(plan: Plan, secret: str, model_id: str, rank: int) -> None:
    """This rank process's Transport, registered with the daemon and heartbeating; `ffn_shim` uses it.
    Heartbeats are a timestamp in the rank's mailbox (the daemon reads it there with the rank's
    counters): nothing but that store runs in the engine's process for liveness."""
    transport = RankTransport(plan.rank_layout(model_id, rank))
    ControlClient(plan, secret, "rank", model_id, rank).register()

    def beat() -> None:
        while True:
            time.sleep(plan.heartbeat_interval_s)
            transport.heartbeat()

    threading.Thread(target=beat, name="crosspool-heartbeat", daemon=True).start()
    ops.attach(transport)


def filter_ffn_weights(loader: type, method: str, ffn_keys: frozenset[str]) -> None:
    """Wrap `loader.method`, the engine's (name, tensor) iterator over the checkpoint, so it skips
    the FFN tensors, and fail the load unless it skipped every one of them."""
    native: Callable[..., Iterator[tuple[str, torch.Tensor]]] = getattr(loader, method)

    def without_ffn(self: Any, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        dropped = 0
        for name, tensor in native(self, *args, **kwargs):
            if name in ffn_keys:
                dropped += 1
                continue
            yield name, tensor
        if dropped != len(ffn_keys):
            raise RuntimeError(f"CrossPool weight filter dropped {dropped} of {len(ffn_keys)} FFN tensors")

    setattr(loader, method, without_ffn)
