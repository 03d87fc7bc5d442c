"""Greedy generation through CrossPool is token-identical to native SGLang on the same machine
and settings, all prompts in one batch: tiny Qwen3 at attention TP 2 and SmolLM2-135M (LlamaForCausalLM) at
TP 1 (FFN TP equal to attention TP: SGLang's own TP splits the MLP the same way). Tiny Qwen3 at TP 1 is
token-identical to native SGLang in test_mixed_engines.py (there one prompt at a time, beside a vLLM
Instance on the same pool)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from crosspool.config import parse_deployment
from crosspool.daemon.daemon import running_pool
from crosspool.integrations.offline import generate_in_child
from crosspool.models.spec import load_ffn_spec
from crosspool.resolve import resolve
from crosspool.transport.mailbox import W_REQ_SEQ, Mailbox

pytestmark = pytest.mark.engine
MAX_BATCHED, PROMPTS, TOKENS = 512, 6, 24


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1, vocab) for _ in range(rng.randrange(4, 40))] for _ in range(PROMPTS)]


@pytest.mark.parametrize(
    ("model", "tp"),
    [("tiny-qwen3", 2), ("smollm2-135m", 1)],  # SmolLM2 is a Llama
)
def test_token_identical_to_native_sglang(model, tp, tiny_models, smollm2, no_leftovers):
    path: Path = smollm2 if model == "smollm2-135m" else tiny_models[model.removeprefix("tiny-")]
    d = parse_deployment(f'''
[limits]
max_batched_tokens = {MAX_BATCHED}
[[ffn_agent]]
id = "ffn0"
[[ffn_agent]]
id = "ffn1"
[[model]]
id = "{model}"
path = "{path}"
engine = "sglang"
max_model_len = 512
attention_tp = {tp}
ffn_tp = {tp}
''')
    m = d.model[0]
    prompts = _prompts(49152 if model == "smollm2-135m" else 512)
    native = generate_in_child(m, MAX_BATCHED, [prompts], TOKENS, None)["runs"][0]["tokens"]
    with running_pool(resolve(d)) as gen:
        (mailbox_plan,) = gen.plan.mailboxes_of(model)
        mailbox = Mailbox.open(mailbox_plan.name)
        pooled = generate_in_child(m, MAX_BATCHED, [prompts], TOKENS, gen.plan_path)["runs"][0]["tokens"]
        calls = mailbox.words[W_REQ_SEQ]
    assert all(len(t) == TOKENS for t in native)
    # every decode step calls every layer (SGLang swallows plugin errors: this shows the plugin ran)
    assert calls >= TOKENS * len(load_ffn_spec(path).layers), calls
    assert pooled == native
