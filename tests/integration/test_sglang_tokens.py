"""Greedy generation through CrossPool is token-identical to native SGLang at attention TP 2 + FFN
TP 2 (SGLang's own TP splits the MLP the same way), all prompts in one batch, and the pool made
every layer call. SGLang at TP 1 is checked against native SGLang in test_deployments.py (SmolLM2,
a Llama, one prompt at a time beside a vLLM Instance on the same pool)."""

from __future__ import annotations

import pytest

from conftest import native_and_pooled, skip_unless_sglang_path
from crosspool.models.spec import load_ffn_spec
from crosspool.qualify.serving import prompts

pytestmark = pytest.mark.engine
MAX_BATCHED, TOKENS = 512, 24


def test_token_identical_to_native_sglang_tp2(tiny_models, no_leftovers):
    skip_unless_sglang_path()
    path = tiny_models["qwen3"]
    native, pooled, calls = native_and_pooled(
        f'''
[limits]
max_batched_tokens = {MAX_BATCHED}
[[ffn_agent]]
id = "ffn0"
[[ffn_agent]]
id = "ffn1"
[[model]]
id = "tiny-qwen3"
path = "{path}"
engine = "sglang"
max_model_len = 512
attention_tp = 2
ffn_tp = 2
''',
        prompts(512, 6),
        TOKENS,
    )
    assert all(len(t) == TOKENS for t in native)
    # every step calls every layer (SGLang swallows plugin errors: this shows the plugin ran)
    assert calls >= TOKENS * len(load_ffn_spec(path).layers), calls
    assert pooled == native
