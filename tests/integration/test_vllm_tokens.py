"""Greedy generation through CrossPool is token-identical to native vLLM (eager and compile)."""

from __future__ import annotations

import random

import pytest

from crosspool.config import parse_deployment
from crosspool.daemon.daemon import running_pool
from crosspool.integrations.vllm.offline import generate_in_child
from crosspool.plan import resolve

pytestmark = pytest.mark.engine
MAX_BATCHED = 512


def _prompts(vocab: int, n: int = 8) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1, vocab) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


@pytest.mark.parametrize("mode", ["eager", "compile"])
@pytest.mark.parametrize("model", ["tiny-qwen3", "smollm2-135m"])
def test_token_identical_to_native(model, mode, tiny_models, smollm2, no_leftovers):
    path, vocab = (tiny_models["qwen3"], 512) if model == "tiny-qwen3" else (smollm2, 49152)
    d = parse_deployment(f'''
[limits]
max_batched_tokens = {MAX_BATCHED}
[[model]]
id = "{model}"
path = "{path}"
engine = "vllm"
max_model_len = 512
enforce_eager = {str(mode == "eager").lower()}
''')
    m = d.model[0]
    prompts = _prompts(vocab)
    native = generate_in_child(m, MAX_BATCHED, [prompts], 32, None)["runs"][0]["tokens"]
    with running_pool(resolve(d)) as gen:
        pooled = generate_in_child(m, MAX_BATCHED, [prompts], 32, gen.plan_path)["runs"][0]["tokens"]
    assert all(len(t) == 32 for t in pooled)
    assert pooled == native
