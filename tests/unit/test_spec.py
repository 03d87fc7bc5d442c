import json

import pytest

from crosspool.models.spec import ModelSpecError, MoeFfn, MoeRouting, load_ffn_spec


def test_tiny_qwen3_spec(tiny_models):
    spec = load_ffn_spec(tiny_models["qwen3"])
    assert spec.architecture == "Qwen3ForCausalLM"
    assert len(spec.layers) == 2 and spec.hidden == 128
    layer = spec.layers[1]
    assert (layer.intermediate, layer.activation) == (256, "silu")
    assert layer.keys == tuple(f"model.layers.1.mlp.{n}_proj.weight" for n in ("gate", "up", "down"))
    assert spec.weight_bytes("bfloat16") == 2 * 3 * 128 * 256 * 2


def test_smollm2_spec(smollm2):
    spec = load_ffn_spec(smollm2)
    assert (spec.architecture, spec.hidden, len(spec.layers), spec.layers[0].intermediate) == (
        "LlamaForCausalLM",
        576,
        30,
        1536,
    )


def test_missing_tensor_is_named(tmp_path, tiny_models):
    src = tiny_models["llama"]
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    from safetensors.torch import load_file, save_file

    state = load_file(src / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ModelSpecError, match=r"lacks FFN tensors \['model.layers.1.mlp.up_proj.weight'\]"):
        load_ffn_spec(tmp_path)


def test_unsupported_activation(tmp_path, tiny_models):
    config = json.loads((tiny_models["llama"] / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(tiny_models["llama"] / "model.safetensors")
    with pytest.raises(ModelSpecError, match="hidden_act 'gelu' is not supported"):
        load_ffn_spec(tmp_path)


def test_qwen3_moe_spec(tiny_models):
    spec = load_ffn_spec(tiny_models["qwen3_moe"])
    assert [type(layer).__name__ for layer in spec.layers] == ["GatedDenseFfn", "MoeFfn", "GatedDenseFfn"]
    moe = spec.layers[1]
    assert isinstance(moe, MoeFfn)
    assert (len(moe.experts), moe.intermediate, moe.shared, moe.bias_key) == (8, 64, None, None)
    assert moe.routing == MoeRouting(top_k=2, scoring="softmax", renormalize=True, grouped=False)
    assert moe.router_key == "model.layers.1.mlp.gate.weight"
    assert moe.experts[7].down_key == "model.layers.1.mlp.experts.7.down_proj.weight"
    assert moe.weight_bytes("bfloat16") == (8 * 128 + 8 * 3 * 128 * 64) * 2


def test_deepseek_v2_spec(tiny_models):
    spec = load_ffn_spec(tiny_models["deepseek_v2"])
    assert [type(layer).__name__ for layer in spec.layers] == ["GatedDenseFfn", "MoeFfn", "MoeFfn"]
    moe = spec.layers[2]
    assert isinstance(moe, MoeFfn) and moe.shared is not None
    assert moe.shared.keys[0] == "model.layers.2.mlp.shared_experts.gate_proj.weight"
    assert moe.routing == MoeRouting(
        top_k=2,
        scoring="softmax",
        renormalize=False,
        grouped=True,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
    )


def test_unsupported_topk_method(tmp_path, tiny_models):
    config = json.loads((tiny_models["deepseek_v2"] / "config.json").read_text())
    config["topk_method"] = "sinkhorn"
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(tiny_models["deepseek_v2"] / "model.safetensors")
    with pytest.raises(ModelSpecError, match="topk_method 'sinkhorn' is not supported"):
        load_ffn_spec(tmp_path)
