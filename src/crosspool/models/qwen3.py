"""Qwen3ForCausalLM: its MLP has Llama's layout and checkpoint keys."""

from crosspool.models.llama import ffn_layers

ARCHITECTURES = ("Qwen3ForCausalLM",)
__all__ = ["ARCHITECTURES", "ffn_layers"]
