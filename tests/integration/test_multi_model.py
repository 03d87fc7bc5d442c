"""Two models behind one endpoint, one FFN pool, `restart = true`: outputs equal each model served
alone; then each role is killed under load (FfnAgent, AtnAgent, an Instance rank, the daemon):
every in-flight request completes correctly or ends with an error response within 10 s, the
daemon starts the next generation and serving resumes (the daemon's own death ends everything)."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time

import httpx
import pytest

from conftest import RunningDaemon, assert_nothing_left, crosspool_shm, model_toml

pytestmark = pytest.mark.engine

MODELS = ("smollm2-135m", "tiny-qwen3")
TOKENS = 24
KILL_BOUND_S = 10.0


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1, 49152) for _ in range(rng.randrange(4, 40))] for _ in range(4)]


def _complete(
    url: str, model: str, prompt: list[int], *, stream: bool = False, timeout: float = 120
) -> tuple[int, str]:
    body = {"model": model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
        return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
    text, status = "", 0
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=timeout) as r:
        status = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return 503, json.dumps(event)
            text += event["choices"][0]["text"]
    return status, text


def _body(paths: dict[str, object], ffn_agents: int = 1) -> str:
    agents = "".join(f'[[ffn_agent]]\nid = "ffn{i}"\n' for i in range(ffn_agents))
    return agents + "".join(model_toml(m, p, enforce_eager=True) for m, p in paths.items())


@pytest.fixture(scope="module")
def paths(smollm2, tiny_served) -> dict[str, object]:
    return {"smollm2-135m": smollm2, "tiny-qwen3": tiny_served}


@pytest.fixture(scope="module")
def alone(paths, tmp_path_factory) -> dict[str, list[str]]:
    """Each model served alone, one request at a time: the reference outputs."""
    reference = {}
    for model in MODELS:
        d = RunningDaemon(tmp_path_factory.mktemp(model), _body({model: paths[model]}), name=model)
        try:
            reference[model] = [_complete(d.url, model, p)[1] for p in _prompts()]
            assert d.stop() == 0
        finally:
            d.kill()
    return reference


@pytest.fixture(scope="module")
def pair(paths, alone, tmp_path_factory):
    shm_before = crosspool_shm()
    # Two FfnAgents: placement spreads SmolLM2's layers over both, so calls cross agents.
    d = RunningDaemon(tmp_path_factory.mktemp("pair"), _body(paths, 2), name="pair", top="restart = true\n")
    yield d
    try:
        d.stop()
    finally:
        d.kill()
    assert_nothing_left(shm_before, 30)


def test_two_models_concurrently_equal_alone(pair, alone):
    assert sorted(m["id"] for m in httpx.get(pair.url + "/v1/models").json()["data"]) == sorted(MODELS)
    r = httpx.post(pair.url + "/v1/chat/completions", json={"model": "nope", "messages": []})
    assert r.status_code == 404 and all(m in r.json()["error"]["message"] for m in MODELS)
    got: dict[str, list[str]] = {}

    def serve(model: str) -> None:  # one request at a time per model, both models at once
        got[model] = [_complete(pair.url, model, p, stream=(i == 1))[1] for i, p in enumerate(_prompts())]

    threads = [threading.Thread(target=serve, args=(m,)) for m in MODELS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert got == alone
    status = pair.status()
    assert {m: s["state"] for m, s in status["models"].items()} == dict.fromkeys(MODELS, "serving")
    assert status["models"]["smollm2-135m"]["ffn_agents"] == ["ffn0", "ffn1"]


class Load:
    """Requests on both models in a loop (plain and streaming), each recorded with its end time."""

    def __init__(self, url: str) -> None:
        self.url, self.stop = url, threading.Event()
        self.results: list[tuple[str, int, int, str, float]] = []
        self.threads = [
            threading.Thread(target=self.run, args=(m, s), daemon=True) for m in MODELS for s in (False, True)
        ]
        for t in self.threads:
            t.start()

    def run(self, model: str, stream: bool) -> None:
        prompts = _prompts()
        i = 0
        while not self.stop.is_set():
            try:
                status, text = _complete(self.url, model, prompts[i % 4], stream=stream, timeout=60)
            except httpx.HTTPError as e:
                status, text = 0, f"{type(e).__name__}: {e}"
            self.results.append((model, i % 4, status, text, time.monotonic()))
            i += 1

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)
            assert not t.is_alive(), "a request hung"


def _stop_and_join(load: Load, killed_at: float) -> None:
    """No new requests; every one in flight at the kill must end within KILL_BOUND_S."""
    load.stop.set()
    for t in load.threads:
        t.join(timeout=max(0.0, killed_at + KILL_BOUND_S - time.monotonic()))
        assert not t.is_alive(), f"a request was still open {KILL_BOUND_S:g} s after the kill"


def _check_after_kill(load: Load, killed_at: float, alone: dict[str, list[str]], named: str) -> None:
    _stop_and_join(load, killed_at)
    errors = [r for r in load.results if r[2] != 200]
    assert errors, "killing a member failed no request"
    for model, prompt, status, text, _ in load.results:
        if status == 200:
            assert text == alone[model][prompt], f"{model} answered without the FFN pool's arithmetic"
        else:
            assert status == 503 and "CrossPool deployment failed" in text, (status, text)
    assert any(named in r[3] for r in errors), [r[3][:300] for r in errors]


def _wait_generation(d: RunningDaemon, generation: int, timeout: float = 400) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert d.proc.poll() is None, "".join(d.stderr[-40:])
        try:
            r = httpx.get(d.control + "/ready", timeout=2).json()
            if r["ready"] and r["generation"] == generation:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"generation {generation} not ready: " + "".join(d.stderr[-40:]))


@pytest.mark.parametrize(
    ("victim", "named", "generation"),
    [
        ("FfnAgent 'ffn0'", "FfnAgent 'ffn0'", 2),
        ("AtnAgent 'atn0'", "AtnAgent 'atn0'", 3),
        ("Instance 'tiny-qwen3' rank 0", "Instance 'tiny-qwen3'", 4),
    ],
)
def test_kill_member_under_load_then_restart(pair, alone, victim, named, generation):
    _wait_generation(pair, generation - 1)
    load = Load(pair.url)
    time.sleep(4)  # requests in flight on both models
    killed_at = time.monotonic()
    os.kill(pair.pid_of(victim), signal.SIGKILL)
    _check_after_kill(load, killed_at, alone, named)
    _wait_generation(pair, generation)
    for model in MODELS:
        assert _complete(pair.url, model, _prompts()[0]) == (200, alone[model][0])


def test_killed_daemon_ends_everything(pair, alone):
    _wait_generation(pair, 4)
    load = Load(pair.url)
    time.sleep(4)
    killed_at = time.monotonic()
    pair.proc.kill()
    _stop_and_join(load, killed_at)
    ended = [r for r in load.results if r[4] > killed_at]
    assert ended, "no request was in flight when the daemon died"
    for model, prompt, status, text, _ in ended:
        assert status != 200 or text == alone[model][prompt], text
    # the fixture then checks that no process and no shared-memory segment is left
