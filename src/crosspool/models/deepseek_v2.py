"""DeepseekV2ForCausalLM: the first `first_k_dense_replace` layers are dense, the rest MoE with
grouped top-k routing, shared experts and a routed scaling factor (attention is MLA, which stays
in the engine)."""

from crosspool.models.spec import LayerFfn, ModelSpecError, MoeRouting, dense_layer, moe_layer

ARCHITECTURES = ("DeepseekV2ForCausalLM",)
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def ffn_layers(config: dict, keys: dict[str, str]) -> tuple[LayerFfn, ...]:
    method = config.get("topk_method") or "greedy"
    if method not in TOPK_METHODS:
        raise ModelSpecError(f"topk_method {method!r} is not supported (supported: {', '.join(TOPK_METHODS)})")
    experts = int(config.get("n_routed_experts") or 0)
    routing = MoeRouting(
        top_k=int(config.get("num_experts_per_tok") or 0),
        scoring=str(config.get("scoring_func", "softmax")),
        renormalize=bool(config.get("norm_topk_prob", False)),
        grouped=True,
        n_group=int(config.get("n_group") or 1),
        topk_group=int(config.get("topk_group") or 1),
        routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
    )
    if routing.scoring not in ("softmax", "sigmoid"):
        raise ModelSpecError(f"scoring_func {routing.scoring!r} is not supported (supported: softmax, sigmoid)")
    shared = int(config.get("n_shared_experts") or 0) * int(config.get("moe_intermediate_size") or 0)
    first_moe, freq = int(config.get("first_k_dense_replace", 0)), int(config.get("moe_layer_freq", 1))
    layers: list[LayerFfn] = []
    for i in range(int(config["num_hidden_layers"])):
        prefix = f"model.layers.{i}.mlp."
        if experts and i >= first_moe and i % freq == 0:
            layers.append(
                moe_layer(
                    config,
                    i,
                    prefix,
                    keys,
                    experts=experts,
                    routing=routing,
                    shared_intermediate=shared,
                    bias=method == "noaux_tc",
                )
            )
        else:
            layers.append(dense_layer(config, i, prefix, keys))
    return tuple(layers)
