"""Greedy generation through CrossPool is token-identical to native vLLM: compile mode (dense),
eager MoE (Qwen3-MoE) and eager MLA + MoE (DeepSeek-V2, attention on vLLM's CPU_MLA backend),
and the pool executed every layer call of it. Eager dense rows are `crosspool qualify --serving`'s
(test_qualify.py); SmolLM2 through vLLM is checked against native in test_deployments.py."""

from __future__ import annotations

import pytest

from crosspool.config import parse_deployment
from crosspool.daemon.daemon import running_pool
from crosspool.integrations.offline import generate_in_child
from crosspool.models.spec import load_ffn_spec
from crosspool.qualify.serving import prompts
from crosspool.resolve import resolve
from crosspool.transport.mailbox import W_REQ_SEQ, Mailbox

pytestmark = pytest.mark.engine
MAX_BATCHED, TOKENS = 512, 32


@pytest.mark.parametrize(
    ("family", "mode"),
    [("qwen3", "compile"), ("qwen3_moe", "eager"), ("deepseek_v2", "eager")],
)
def test_token_identical_to_native(family, mode, tiny_models, no_leftovers):
    path = tiny_models[family]
    d = parse_deployment(f'''
[limits]
max_batched_tokens = {MAX_BATCHED}
[[model]]
id = "tiny-{family}"
path = "{path}"
engine = "vllm"
max_model_len = 512
enforce_eager = {str(mode == "eager").lower()}
''')
    m, work = d.model[0], prompts(512)
    native = generate_in_child(m, MAX_BATCHED, [work], TOKENS, None)["runs"][0]["tokens"]
    with running_pool(resolve(d)) as gen:
        (mailbox_plan,) = gen.plan.mailboxes_of(m.id)
        pooled = generate_in_child(m, MAX_BATCHED, [work], TOKENS, gen.plan_path)["runs"][0]["tokens"]
        calls = Mailbox.open(mailbox_plan.name).words[W_REQ_SEQ]
    assert all(len(t) == TOKENS for t in native)
    # every step calls every layer: a plugin that did not activate would compare native with native
    assert calls >= TOKENS * len(load_ffn_spec(path).layers), calls
    assert pooled == native
