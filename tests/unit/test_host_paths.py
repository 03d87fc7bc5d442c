"""Host-dependent engine paths, with the engines' CPU-feature detection forced to the other kind
of host: what the FFN pool computes with (vLLM's own GEMM and MoE kernel choices) or refuses
(SGLang's AMX path), without running AMX instructions on a CPU that has none."""

from __future__ import annotations

import pytest
import torch

from crosspool.config import ConfigError, parse_deployment
from crosspool.integrations.sglang import launch as sglang_launch
from crosspool.resolve import resolve


def _amx(monkeypatch: pytest.MonkeyPatch, present: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: present)


@pytest.mark.parametrize("amx", [False, True])
def test_pool_moe_kernel_is_the_one_vllm_selects(monkeypatch, amx):
    """Where vLLM runs bf16 MoE with its AMX experts kernel, the pool builds that same kernel
    (vLLM's oracle picks it); fp32, and CPUs without AMX, get the portable "vec" kernel."""
    from crosspool.integrations.vllm.kernels import moe_experts

    _amx(monkeypatch, amx)
    assert moe_experts(8, 128, 64, 2, torch.bfloat16).isa == ("amx" if amx else "vec")
    assert moe_experts(8, 128, 64, 2, torch.float32).isa == "vec"


@pytest.mark.parametrize("amx", [False, True])
def test_pool_linear_kernel_is_the_one_vllm_dispatches(monkeypatch, amx):
    """vLLM packs small bf16 weights for its AMX kernel (`weight_packed_linear`) on AMX CPUs and
    keeps larger ones on oneDNN; the pool's linear follows the same dispatch. The packing and
    packed-GEMM ops are stubbed: they are not run on a CPU without AMX, and vLLM's AVX2 build
    has neither (an AVX-512 build has both)."""
    from crosspool.integrations.vllm.kernels import linear

    _amx(monkeypatch, amx)
    monkeypatch.setattr(torch.ops._C, "convert_weight_packed", lambda w: w, raising=False)
    monkeypatch.setattr(torch.ops._C, "weight_packed_linear", lambda *args: None, raising=False)
    small, large = torch.zeros(64, 128, dtype=torch.bfloat16), torch.zeros(1536, 576, dtype=torch.bfloat16)
    assert (linear(small).__name__ == "run_packed") == amx
    assert linear(large).__name__ != "run_packed"
    assert linear(small.float()).__name__ != "run_packed"


def _sglang_deployment(path: object) -> str:
    return f'[[model]]\nid = "m"\npath = "{path}"\nengine = "sglang"\n'


def test_sglang_native_torch_path_on_every_host(monkeypatch, tiny_models):
    """With CrossPool's sgl_kernel stand-in SGLang takes its native torch path on AMX CPUs too
    (the stand-in registers no `convert_weight_packed`): nothing to refuse."""
    assert sglang_launch._sgl_kernel_is_standin()  # what scripts/sglang-cpu/install.sh installs
    for amx in (False, True):
        _amx(monkeypatch, amx)
        assert sglang_launch.host_problems() == []
        resolve(parse_deployment(_sglang_deployment(tiny_models["qwen3"])))


def test_sglang_amx_path_is_refused_at_config_check(monkeypatch, tiny_models):
    _amx(monkeypatch, True)
    monkeypatch.setattr(sglang_launch, "_sgl_kernel_is_standin", lambda: False)
    with pytest.raises(ConfigError) as e:
        resolve(parse_deployment(_sglang_deployment(tiny_models["qwen3"])))
    assert e.value.problems == [
        "model[0].engine: SGLang on this AMX CPU would compute with sgl_kernel's packed AMX kernels (sgl_kernel is "
        "installed and is not crosspool-sgl-kernel-standin), which the FFN pool does not reproduce; install the "
        'stand-in (scripts/sglang-cpu/install.sh) or use engine = "vllm"'
    ]
    _amx(monkeypatch, False)  # without AMX SGLang's path is the native one whatever sgl_kernel is
    assert sglang_launch.host_problems() == []
