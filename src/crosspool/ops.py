"""`crosspool::ffn_shim`: the torch custom op an engine's decoder layer calls in place of its FFN.

A real custom op with a fake implementation, so torch.compile and graph capture see one opaque
node. The caller owns `out`; eager and compiled execution take the same path. The op talks to
the FFN pool through the process's Transport attachment (one per Instance rank process).
"""

from __future__ import annotations

from typing import Protocol

import torch


class FfnTransport(Protocol):
    def call(self, layer: int, hidden: torch.Tensor, out: torch.Tensor) -> None: ...


_transport: FfnTransport | None = None


def attach(transport: FfnTransport) -> None:
    global _transport
    _transport = transport


def attached() -> bool:
    return _transport is not None


@torch.library.custom_op("crosspool::ffn_shim", mutates_args=("out",))
def ffn_shim(hidden: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    if _transport is None:
        raise RuntimeError("crosspool ffn_shim called in a process with no FFN pool attachment")
    _transport.call(layer, hidden, out)


@ffn_shim.register_fake
def _(hidden: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    return None
