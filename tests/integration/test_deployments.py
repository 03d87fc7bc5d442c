"""The shipped example deployments through `crosspool daemon`, as a user runs them (real engines,
real agents, real HTTP; only the ports and the cache root are this test's):

* examples/smollm2.toml, the demo: the demo question is answered ("Paris"), readiness, status
  (API and `crosspool status`), metrics that show the pool computed the layers, a clean stop
  (exit 0, ports free, nothing left behind);
* examples/mixed-engines.toml, SmolLM2 through vLLM and through SGLang on one FFN pool,
  `restart = true`: both answer the demo question and serve concurrently token-identical to their
  native engines; each kind of member killed under load (an FfnAgent, the vLLM rank, the SGLang
  scheduler) ends every in-flight request within 10 s, correctly or with a 503 naming it, the
  Instances it takes down restart alone (503 with Retry-After meanwhile) while the other model
  answers every request, and they serve the same tokens again; the daemon's own death ends
  everything.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import (
    LiveDeployment,
    assert_nothing_left,
    example_text,
    leftover_files,
    project_processes,
    skip_unless_sglang_path,
)
from crosspool.config import parse_deployment
from crosspool.integrations.offline import generate_in_child, side_by_side
from crosspool.ipc import bind_port
from crosspool.qualify.serving import executed_per_model, prompts

pytestmark = pytest.mark.engine

DEMO_QUESTION = {"role": "user", "content": "What is the capital of France?"}
VLLM, SGLANG = "smollm2-vllm", "smollm2-sglang"
MIXED = (VLLM, SGLANG)
TOKENS = 24
KILL_BOUND_S = 10.0
WORK = prompts(49152, 4, seed=1)  # SmolLM2's vocabulary


def _live(name: str, tmp_path_factory: pytest.TempPathFactory, restarts: int | None = None):
    """examples/NAME.toml, with max_restarts = `restarts` where a module fails it more often."""

    def text(port: int, control: int) -> str:
        shipped = example_text(name, port, control)
        if restarts is None:
            return shipped
        return re.sub(r"(?m)^max_restarts = \d+", f"max_restarts = {restarts}", shipped)

    files, procs = leftover_files(), set(project_processes())
    live = LiveDeployment(tmp_path_factory.mktemp(name), text, name)
    yield live
    live.close()
    assert_nothing_left(files, 30, procs)


@pytest.fixture(scope="module")
def demo(smollm2, tmp_path_factory):
    yield from _live("smollm2", tmp_path_factory)


@pytest.fixture(scope="module")
def mixed(smollm2, tmp_path_factory):
    skip_unless_sglang_path()
    yield from _live("mixed-engines", tmp_path_factory, restarts=6)  # killed members, a stopped server


def _chat(url: str, model: str) -> dict:
    body = {"model": model, "temperature": 0, "max_tokens": 24, "messages": [DEMO_QUESTION]}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _answer(chat: dict) -> str:
    return chat["choices"][0]["message"]["content"]


def _metric(text: str, line_start: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


def test_demo_answers_the_demo_question(demo):
    d = demo.get()
    assert [m["id"] for m in httpx.get(d.url + "/v1/models").json()["data"]] == ["smollm2-135m"]
    assert httpx.get(d.control + "/ready").json()["ready"] is True
    chat = _chat(d.url, "smollm2-135m")
    assert "Paris" in _answer(chat), chat
    r = httpx.post(d.url + "/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and "smollm2-135m" in r.json()["error"]["message"]
    status = d.status()
    assert status["phase"] == "ready" and status["models"]["smollm2-135m"]["state"] == "serving"
    assert all(m["registered"] for m in status["members"])
    table = subprocess.run(
        [sys.executable, "-m", "crosspool", "status", str(d.file)], capture_output=True, text=True, timeout=60
    )
    assert table.returncode == 0 and "Instance 'smollm2-135m' rank 0" in table.stdout, table.stderr
    assert "serving" in table.stdout and "ready" in table.stdout, table.stdout
    time.sleep(1.5)  # a heartbeat or two: the front, the rank and the FfnAgent report their counters
    metrics = httpx.get(d.control + "/metrics").text
    assert _metric(metrics, 'crosspool_requests_total{code="2xx",model="smollm2-135m"}') >= 1, metrics
    # 30 layers a step, a step a token: the pool, not the engine, computed the FFN of every one
    steps = chat["usage"]["completion_tokens"]
    assert _metric(metrics, 'crosspool_ffn_call_seconds_count{model="smollm2-135m"}') >= 30 * steps
    assert _metric(metrics, 'crosspool_ffn_executed_total{agent="ffn0",model="smollm2-135m"}') >= 30 * steps


def test_front_and_control_api_refuse_what_is_too_big_and_stay_up(demo):
    """Bodies past limits.max_request_bytes (413, before they are read whole), JSON nested past
    the parser, max_tokens or token prompts past max_model_len (400 with the reason): all counted,
    and both servers still answer."""
    d = demo.get()
    url, model = d.url + "/v1/completions", "smollm2-135m"
    huge = b'{"model": "smollm2-135m", "prompt": "' + b"x" * (5 * 2**20) + b'"}'
    r = httpx.post(url, content=huge, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limits.max_request_bytes" in r.json()["error"]["message"]
    assert httpx.post(d.control + "/v1/failures", content=huge).status_code == 413
    r = httpx.post(url, content=b"[" * 200_000, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    r = httpx.post(url, json={"model": model, "prompt": "x", "max_tokens": 10**9})
    assert r.status_code == 400 and "exceeds smollm2-135m's max_model_len" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": model, "prompt": [1] * 100_000, "max_tokens": 1})
    assert r.status_code == 400 and "100000 prompt tokens + max_tokens 1 exceed" in r.json()["error"]["message"]
    assert httpx.get(d.url + "/v1/models").status_code == 200 and httpx.get(d.control + "/ready").status_code == 200
    time.sleep(1.5)  # the front's next heartbeat carries the counts
    metrics = httpx.get(d.control + "/metrics").text
    assert _metric(metrics, 'crosspool_requests_total{code="4xx",model="unknown"}') >= 2, metrics
    assert _metric(metrics, 'crosspool_requests_total{code="4xx",model="smollm2-135m"}') >= 2, metrics


def test_demo_places_each_role_as_planned(demo):
    """Every role on the CPUs the resolved deployment names: the rank on its own, the FfnAgent on
    the CPUs no rank uses (on a host with one: with its rank, both ends then sleeping instead of
    spinning), the rest (vLLM's API server and busy-polling EngineCore included) on the control CPUs."""
    from crosspool.cpus import descendants

    d = demo.get()
    check = subprocess.run(
        [sys.executable, "-m", "crosspool", "config", "check", str(d.file)], capture_output=True, text=True, timeout=60
    )
    planned = json.loads(check.stdout)["cpus"]
    (rank_cpus,) = planned["ranks"]["smollm2-135m"]

    def cpus(pid: int) -> set[int]:  # of every thread of the process
        return set().union(*(os.sched_getaffinity(int(t)) for t in os.listdir(f"/proc/{pid}/task")))

    rank, ffn = d.pid_of("Instance 'smollm2-135m' rank 0"), d.pid_of("FfnAgent 'ffn0'")
    assert os.sched_getaffinity(rank) == set(rank_cpus)  # the worker's compute thread
    assert cpus(ffn) == set(planned["ffn_agents"]["ffn0"])
    apart = not set(rank_cpus) & set(planned["ffn_agents"]["ffn0"])
    assert planned["spin_us"] == {
        "ranks": {"smollm2-135m": 2000 if apart else 0},
        "ffn_agents": {"ffn0": 2000 if apart else 0},
    }
    control = set(planned["control"])
    engine_core = int(Path(f"/proc/{rank}/stat").read_text().rsplit(")", 1)[1].split()[1])  # the worker's parent
    for name, pid in [
        ("daemon", d.proc.pid),
        ("front", d.pid_of("front endpoint")),
        ("AtnAgent", d.pid_of("AtnAgent 'atn0'")),
        ("EngineCore", engine_core),
    ]:
        assert cpus(pid) == control, name
    assert engine_core in descendants(d.proc.pid)


def test_demo_stops_cleanly(demo):
    d = demo.get()
    ports = [d.port, d.control_port, int(d.status()["models"]["smollm2-135m"]["url"].rsplit(":", 1)[1])]
    assert d.stop() == 0
    for port in ports:
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still listens"
    # the fixture then checks that no process and no shared-memory segment is left


def test_a_sigterm_during_startup_exits_0_and_leaves_nothing(smollm2, tmp_path, no_leftovers):
    port, control = bind_port("127.0.0.1"), bind_port("127.0.0.1")
    file = tmp_path / "startup.toml"
    file.write_text(example_text("smollm2", port, control))
    proc = subprocess.Popen(
        [sys.executable, "-m", "crosspool", "daemon", str(file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:  # until some members of the first generation registered, the rest still starting
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            with contextlib.suppress(httpx.HTTPError):
                status = httpx.get(f"http://127.0.0.1:{control}/status", timeout=2).json()
                if status["phase"] == "starting" and any(m["registered"] for m in status["members"]):
                    break
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=90)
        assert code == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def native(smollm2) -> dict[str, list[list[int]]]:
    """Each engine natively, each prompt generated alone (as the served requests are)."""
    skip_unless_sglang_path()
    d = parse_deployment(example_text("mixed-engines", 8000, 8001))
    batches, limit = [[p] for p in WORK], d.limits.max_batched_tokens
    runs = side_by_side(
        [lambda cpus, m=m: generate_in_child(m, limit, batches, TOKENS, None, cpus=cpus) for m in d.model]
    )
    return {m.id: [r["tokens"][0] for r in run["runs"]] for m, run in zip(d.model, runs, strict=True)}


def _complete(
    url: str, model: str, prompt: list[int], *, stream: bool = False, timeout: float = 120
) -> tuple[int, object]:
    """(status, token ids) of a greedy completion; (503, the error) when it failed."""
    body = {"model": model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    body["return_token_ids"] = True
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
        return r.status_code, r.json()["choices"][0]["token_ids"] if r.status_code == 200 else r.text
    tokens: list[int] = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=timeout) as r:
        if r.status_code != 200:  # refused before the stream began: a plain error body
            return r.status_code, r.read().decode()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return 503, json.dumps(event)
            tokens += event["choices"][0].get("token_ids") or []
        return r.status_code, tokens


def test_mixed_engines_serve_concurrently_like_native(mixed, native):
    d = mixed.get()
    assert sorted(m["id"] for m in httpx.get(d.url + "/v1/models").json()["data"]) == sorted(MIXED)
    got: dict[str, list[object]] = {}

    def serve(model: str) -> None:  # one request at a time per model, both engines at once
        got[model] = [_complete(d.url, model, p, stream=i == 1)[1] for i, p in enumerate(WORK)]

    threads = [threading.Thread(target=serve, args=(m,)) for m in MIXED]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert got == native
    # the pool, not the engines, computed every layer (SmolLM2: 30) of every step of both models
    executed = executed_per_model(httpx.get(d.control + "/metrics").text)
    assert all(executed[model] >= 30 * TOKENS * len(WORK) for model in MIXED), executed
    for model in MIXED:
        assert "Paris" in _answer(_chat(d.url, model))
    status = d.status()
    assert {m: s["state"] for m, s in status["models"].items()} == dict.fromkeys(MIXED, "serving")
    assert {a for m in MIXED for a in status["models"][m]["ffn_agents"]} == {"ffn0", "ffn1"}  # one pool


class Load:
    """Requests on both models in a loop (plain and streaming), each recorded with its end time."""

    def __init__(self, url: str) -> None:
        self.url, self.stop = url, threading.Event()
        self.results: list[tuple[str, int, int, object, float]] = []
        self.threads = [
            threading.Thread(target=self.run, args=(model, stream), daemon=True)
            for model in MIXED
            for stream in (False, True)
        ]
        for t in self.threads:
            t.start()

    def run(self, model: str, stream: bool) -> None:
        i = 0
        while not self.stop.is_set():
            try:
                status, got = _complete(self.url, model, WORK[i % len(WORK)], stream=stream, timeout=60)
            except httpx.HTTPError as e:
                status, got = 0, f"{type(e).__name__}: {e}"
            self.results.append((model, i % len(WORK), status, got, time.monotonic()))
            i += 1

    def join_within(self, killed_at: float) -> None:
        """No new requests; every one in flight at the kill must end within KILL_BOUND_S."""
        self.stop.set()
        for t in self.threads:
            t.join(timeout=max(0.0, killed_at + KILL_BOUND_S - time.monotonic()))
            assert not t.is_alive(), f"a request was still open {KILL_BOUND_S:g} s after the kill"


def _restarts(d) -> dict[str, int]:
    return {m: s["restarts"] for m, s in d.status()["models"].items()}


def _serving_again(d, before: dict[str, int], models: list[str], timeout: float = 400) -> None:
    """The `models` restarted alone (each once more than `before`) and the deployment is ready."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert d.proc.poll() is None, "".join(d.stderr[-40:])
        with contextlib.suppress(httpx.HTTPError):
            status = d.status()
            restarted = all(status["models"][m]["restarts"] > before[m] for m in models)
            if restarted and httpx.get(d.control + "/ready", timeout=2).json()["ready"]:
                restarted_alone = status["generation"] == 1 and status["phase"] == "ready"  # nothing else restarted
                assert restarted_alone, "".join(line for line in d.stderr if line.startswith("crosspool:"))
                time.sleep(1.0)  # the front learns it from its next heartbeat (heartbeat_interval_s 0.5)
                return
        time.sleep(1)
    raise AssertionError(f"{models} did not serve again: " + "".join(d.stderr[-40:]))


def _affected(d, victim: str) -> list[str]:
    """The models a member's failure takes down: its Instance's, or those with layers on an FfnAgent."""
    if victim.startswith("FfnAgent"):
        agent = victim.split("'")[1]
        return [m for m, s in d.status()["models"].items() if agent in s["ffn_agents"]]
    return [victim.split("'")[1]]


def _restarting_answer(d, model: str) -> httpx.Response:
    """What a request for `model` gets once its Instance restarts (before it serves again)."""
    end = time.monotonic() + 15
    while d.status()["models"][model]["state"] != "restarting":
        assert time.monotonic() < end, "the failed Instance was never reported restarting"
        time.sleep(0.1)
    return httpx.post(d.url + "/v1/completions", json={"model": model, "prompt": WORK[0], "max_tokens": 1})


@pytest.mark.parametrize(
    "victim",
    [
        "FfnAgent 'ffn0'",
        f"Instance '{VLLM}' rank 0",  # its Worker process
        f"Instance '{SGLANG}' rank 0",  # its scheduler process
    ],
)
def test_killed_member_fails_only_its_models_which_restart_alone(mixed, native, victim):
    """Every request in flight ends within 10 s; those of the models the member serves are
    answered correctly or with 503 naming it, and while their Instances restart with 503 and
    Retry-After; the other model's requests all answer 200, token-identical; the failed models
    serve the same tokens again, in the same generation."""
    d = mixed.get()
    _serving_again(d, dict.fromkeys(MIXED, -1), [])
    affected = _affected(d, victim)
    named = victim if victim.startswith("FfnAgent") else f"Instance '{affected[0]}'"
    before = _restarts(d)
    load = Load(d.url)
    time.sleep(4)  # requests in flight on both models
    killed_at = time.monotonic()
    os.kill(d.pid_of(victim), signal.SIGKILL)
    load.join_within(killed_at)
    refused = _restarting_answer(d, affected[0])
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1, refused.text
    assert named in refused.json()["error"]["message"], refused.text
    errors = [r for r in load.results if r[2] != 200]
    assert errors, "killing a member failed no request"
    for model, prompt, status, got, _ in load.results:
        if status == 200:
            assert got == native[model][prompt], f"{model} answered without the FFN pool's arithmetic"
        else:
            assert model in affected, f"{model} does not depend on {victim}, yet: {status} {got}"
            assert status == 503 and f"CrossPool Instance '{model}' failed" in str(got), (status, got)
    assert any(named in str(r[3]) for r in errors), [str(r[3])[:300] for r in errors]
    _serving_again(d, before, affected)
    for model in MIXED:
        assert _complete(d.url, model, WORK[0]) == (200, native[model][0])


def test_a_stopped_engine_server_restarts_its_instance_within_its_bound(mixed, native):
    """SIGSTOP on the vLLM Instance's API server: the process exists but answers nothing. The
    daemon's liveness probe names it within limits.engine_health_timeout_s (default 10 s); the
    request it holds ends with 503 naming it; that Instance alone restarts and serves."""
    from concurrent.futures import ThreadPoolExecutor

    from crosspool.bench.procs import role_of

    d = mixed.get()
    _serving_again(d, dict.fromkeys(MIXED, -1), [])
    before = _restarts(d)
    server = d.pid_of(f"Instance '{VLLM}' rank 0")
    while role_of(server) != "API server":
        server = int(Path(f"/proc/{server}/stat").read_text().rsplit(")", 1)[1].split()[1])
    stopped_at = time.monotonic()
    os.kill(server, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(_complete, d.url, VLLM, WORK[0], timeout=60)
            while (failure := d.status()["models"][VLLM]["failure"]) is None:
                assert time.monotonic() - stopped_at < 10 + 3, "the stopped engine server was not noticed"
                time.sleep(0.2)
            assert f"Instance '{VLLM}' engine server did not answer for" in failure, failure
            status, got = held.result(timeout=5)  # the front ends it when it learns the failure
            assert status == 503 and "engine server did not answer for" in str(got), (status, got)
            assert _complete(d.url, SGLANG, WORK[0]) == (200, native[SGLANG][0])  # the other model serves
    finally:
        with contextlib.suppress(ProcessLookupError):  # the restart kills it
            os.kill(server, signal.SIGCONT)
    _serving_again(d, before, [VLLM])
    assert _complete(d.url, VLLM, WORK[0]) == (200, native[VLLM][0])


def test_killed_daemon_ends_everything(mixed, native):
    d = mixed.get()
    _serving_again(d, dict.fromkeys(MIXED, -1), [])
    load = Load(d.url)
    time.sleep(4)
    killed_at = time.monotonic()
    d.proc.kill()
    load.join_within(killed_at)
    ended = [r for r in load.results if r[4] > killed_at]
    assert ended, "no request was in flight when the daemon died"
    for model, prompt, status, got, _ in ended:
        assert status != 200 or got == native[model][prompt], got
    # the fixture then checks that no process and no shared-memory segment is left
