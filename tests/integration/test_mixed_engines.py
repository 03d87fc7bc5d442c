"""One vLLM Instance and one SGLang Instance share one FFN pool behind the one OpenAI endpoint:
both serve concurrently, each token-identical to its native engine; killing the SGLang Instance
fails its in-flight request with an error naming it and stops the deployment (restart = false)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import httpx
import pytest

from conftest import RunningDaemon, assert_nothing_left, crosspool_shm, model_toml
from crosspool.config import parse_deployment
from crosspool.integrations.offline import generate_in_child

pytestmark = pytest.mark.engine

MODELS = {"vllm-qwen3": "vllm", "sglang-qwen3": "sglang"}
TOKENS = 24


def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(1, 49152) for _ in range(rng.randrange(4, 40))] for _ in range(4)]


def _models(path: object) -> str:
    return "".join(model_toml(m, path, engine, enforce_eager=True) for m, engine in MODELS.items())


@pytest.fixture(scope="module")
def native(tiny_served) -> dict[str, list[list[int]]]:
    """Each engine alone, natively, each prompt generated alone (as the served requests are)."""
    d = parse_deployment(f"[limits]\nmax_batched_tokens = 512\n{_models(tiny_served)}")
    batches = [[p] for p in _prompts()]
    return {
        m.id: [run["tokens"][0] for run in generate_in_child(m, 512, batches, TOKENS, None)["runs"]] for m in d.model
    }


@pytest.fixture(scope="module")
def mixed(tiny_served, tmp_path_factory):
    shm_before = crosspool_shm()
    agents = '[[ffn_agent]]\nid = "ffn0"\nlanes = 2\n[[ffn_agent]]\nid = "ffn1"\nlanes = 2\n'
    d = RunningDaemon(tmp_path_factory.mktemp("mixed"), agents + _models(tiny_served), name="mixed")
    yield d
    try:
        d.stop()
    finally:
        d.kill()
    assert_nothing_left(shm_before, 30)


def _tokens(url: str, model: str, prompt: list[int]) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json={**body, "return_token_ids": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_both_engines_serve_concurrently_token_identical(mixed, native):
    assert sorted(m["id"] for m in httpx.get(mixed.url + "/v1/models").json()["data"]) == sorted(MODELS)
    got: dict[str, list[list[int]]] = {}

    def serve(model: str) -> None:  # one request at a time per model, both engines at once
        got[model] = [_tokens(mixed.url, model, p) for p in _prompts()]

    threads = [threading.Thread(target=serve, args=(m,)) for m in MODELS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert got == native
    for model in MODELS:
        chat = {"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}
        r = httpx.post(mixed.url + "/v1/chat/completions", json=chat, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model and r.json()["choices"][0]["message"]["content"]
    status = mixed.status()
    assert {m: s["state"] for m, s in status["models"].items()} == dict.fromkeys(MODELS, "serving")


def test_killed_sglang_instance_fails_in_flight_request(mixed):
    result: dict = {}

    def long_request() -> None:
        body = {"model": "sglang-qwen3", "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True}
        r = httpx.post(mixed.url + "/v1/completions", json=body, timeout=60)
        result.update(status=r.status_code, body=r.text)

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(3)  # generation under way
    killed_at = time.monotonic()
    os.kill(mixed.pid_of("Instance 'sglang-qwen3' rank 0"), signal.SIGKILL)  # its scheduler process
    t.join(timeout=30)
    assert not t.is_alive(), "request hung after the SGLang Instance died"
    assert time.monotonic() - killed_at < 10
    assert result["status"] == 503 and "Instance 'sglang-qwen3'" in result["body"], result
    assert mixed.proc.wait(timeout=90) != 0  # restart = false: the deployment stops, naming the failure
    assert any("failure: Instance 'sglang-qwen3'" in line for line in mixed.stderr), mixed.stderr[-20:]
