"""The FfnAgent's dense FFN against the plain-torch formula vLLM-CPU computes (bit for bit)."""

import pytest
import torch
import torch.nn.functional as F

from crosspool.agents.ffn.dense import GatedDenseFfn
from crosspool.kernels import plain_linear as _linear


def _reference(x, gate, up, down, fp32_activation):
    gate_up = F.linear(x, torch.cat([gate, up]))
    if fp32_activation:
        gate_up = gate_up.float()
    g, u = gate_up.split(gate.shape[0], dim=-1)
    return F.linear((F.silu(g) * u).to(x.dtype), down)


@pytest.mark.parametrize("activation_math", ["fp32", "dtype"])
def test_bitwise_equal_to_plain_torch(activation_math):
    torch.manual_seed(0)
    gate, up = (torch.randn(256, 128, dtype=torch.bfloat16) * 0.2 for _ in range(2))
    down = torch.randn(128, 256, dtype=torch.bfloat16) * 0.2
    ffn = GatedDenseFfn(gate, up, down, activation_math, _linear)
    for rows in (1, 7, 64, 300):
        x = torch.randn(rows, 128, dtype=torch.bfloat16) * 3
        assert torch.equal(ffn(x), _reference(x, gate, up, down, activation_math == "fp32"))


def test_activation_precision_matters():
    torch.manual_seed(0)
    gate, up = (torch.randn(256, 128, dtype=torch.bfloat16) * 0.2 for _ in range(2))
    down = torch.randn(128, 256, dtype=torch.bfloat16) * 0.2
    x = torch.randn(64, 128, dtype=torch.bfloat16) * 3
    assert not torch.equal(
        GatedDenseFfn(gate, up, down, "fp32", _linear)(x), GatedDenseFfn(gate, up, down, "dtype", _linear)(x)
    )
