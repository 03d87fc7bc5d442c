"""LlamaForCausalLM: a gated dense SiLU MLP in every decoder layer."""

from crosspool.models.spec import GatedDenseFfn, gated_dense_layers

ARCHITECTURES = ("LlamaForCausalLM",)


def ffn_layers(config: dict, keys: dict[str, str]) -> tuple[GatedDenseFfn, ...]:
    return gated_dense_layers(config, "model.layers.{}.mlp.", keys)
