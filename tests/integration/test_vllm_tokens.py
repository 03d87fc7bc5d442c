"""Greedy generation through CrossPool is token-identical to native vLLM: compile mode (dense),
eager MoE (Qwen3-MoE) and eager MLA + MoE (DeepSeek-V2, attention on vLLM's CPU_MLA backend),
and the pool executed every layer call of it. Eager dense rows are `crosspool qualify --serving`'s
(test_qualify.py); SmolLM2 through vLLM is checked against native in test_deployments.py."""

from __future__ import annotations

import pytest

from conftest import native_and_pooled
from crosspool.models.spec import load_ffn_spec
from crosspool.qualify.serving import prompts

pytestmark = pytest.mark.engine
MAX_BATCHED, TOKENS = 512, 32


@pytest.mark.parametrize(
    ("family", "mode"),
    [("qwen3", "compile"), ("qwen3_moe", "eager"), ("deepseek_v2", "eager")],
)
def test_token_identical_to_native(family, mode, tiny_models, no_leftovers):
    path = tiny_models[family]
    native, pooled, calls = native_and_pooled(
        f'''
[limits]
max_batched_tokens = {MAX_BATCHED}
[[model]]
id = "tiny-{family}"
path = "{path}"
engine = "vllm"
max_model_len = 512
enforce_eager = {str(mode == "eager").lower()}
''',
        prompts(512),
        TOKENS,
    )
    assert all(len(t) == TOKENS for t in native)
    # every step calls every layer: a plugin that did not activate would compare native with native
    assert calls >= TOKENS * len(load_ffn_spec(path).layers), calls
    assert pooled == native
