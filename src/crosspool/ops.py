"""`crosspool::ffn_shim`: the torch op an engine's decoder layer calls in place of its FFN.

A real torch operator with a fake (meta) implementation, so torch.compile and graph capture see
one opaque node. The caller owns `out`; eager and compiled execution take the same path. The op
talks to the FFN pool through the process's Transport attachment (one per Instance rank process).

Defined with `torch.library.Library` rather than `torch.library.custom_op`: the latter's Python
dispatch wrapper cost 35 us per call here (3.3 us this way), paid once per layer per step.
"""

from __future__ import annotations

from typing import Protocol

import torch

from crosspool.transport.errors import FfnCallRejected


class FfnTransport(Protocol):
    def call(self, layer: int, hidden: torch.Tensor, out: torch.Tensor) -> None: ...


_transport: FfnTransport | None = None


def attach(transport: FfnTransport) -> None:
    global _transport
    _transport = transport


def detach() -> None:
    global _transport
    _transport = None


def attached() -> bool:
    return _transport is not None


def ffn_shim(hidden: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    if _transport is None:
        raise FfnCallRejected(f"crosspool ffn_shim called for layer {layer} in a process with no FFN pool attachment")
    _transport.call(layer, hidden, out)


def _fake(hidden: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    return None


_lib = torch.library.Library("crosspool", "DEF")
_lib.define("ffn_shim(Tensor hidden, Tensor(a!) out, int layer) -> ()")
_lib.impl("ffn_shim", ffn_shim, "CPU")
_lib.impl("ffn_shim", ffn_shim, "CUDA")
torch.library.register_fake("crosspool::ffn_shim", _fake, lib=_lib)
