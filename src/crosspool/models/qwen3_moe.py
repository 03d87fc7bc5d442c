"""Qwen3MoeForCausalLM: softmax top-k routing over 128-ish experts, no shared expert; the layers
in `mlp_only_layers` (and those off the `decoder_sparse_step` grid) have a dense MLP."""

from crosspool.models.spec import LayerFfn, MoeRouting, dense_layer, moe_layer

ARCHITECTURES = ("Qwen3MoeForCausalLM",)


def ffn_layers(config: dict, keys: dict[str, str]) -> tuple[LayerFfn, ...]:
    experts = int(config.get("num_experts", config.get("num_local_experts", 128)))
    dense_only = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step", 1))
    routing = MoeRouting(
        top_k=int(config["num_experts_per_tok"]),
        scoring="softmax",
        renormalize=bool(config.get("norm_topk_prob", False)),
        grouped=False,
    )
    layers: list[LayerFfn] = []
    for i in range(int(config["num_hidden_layers"])):
        prefix = f"model.layers.{i}.mlp."
        if i not in dense_only and experts > 0 and (i + 1) % step == 0:
            layers.append(moe_layer(config, i, prefix, keys, experts=experts, routing=routing))
        else:
            layers.append(dense_layer(config, i, prefix, keys))
    return tuple(layers)
