"""The daemon's control API over real HTTP (uvicorn on a loopback port): member authentication,
registration refusals, heartbeats and metrics, and a schemathesis fuzz from the API's own OpenAPI
schema. The test process plays the daemon: the members it registers are itself."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

from crosspool.config import parse_deployment
from crosspool.daemon.control import ControlState, create_control_app
from crosspool.ipc import bind_port
from crosspool.resolve import resolve


@pytest.fixture
def control(tiny_models):
    """A fresh control API per test (its registry starts empty), on a real loopback port."""
    d = parse_deployment(f'''
[[model]]
id = "q"
path = "{tiny_models["qwen3"]}"
engine = "vllm"
''')
    state = ControlState(resolve(d).plan(), "http://127.0.0.1:8000/v1", heartbeat_timeout_s=5)
    port = bind_port("127.0.0.1")
    server = uvicorn.Server(uvicorn.Config(create_control_app(state), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield state, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def _member(state: ControlState, role: str, ident: str, **extra) -> dict:
    body = {
        "role": role,
        "id": ident,
        "rank": 0,
        "generation": 1,
        "pid": os.getpid(),
        "fingerprint": state.plan.fingerprint(),
    }
    return {**body, **extra}


def _post(state: ControlState, url: str, json: dict, secret: str | None = None) -> httpx.Response:
    """A member's request: it holds the generation's member secret."""
    return httpx.post(url, json=json, headers={"Authorization": f"Bearer {secret or state.secret}"})


def _beat(seq: int, **metrics) -> dict:
    return {"role": "front", "id": "front", "rank": 0, "generation": 1, "seq": seq, "metrics": metrics}


def test_ready_lists_what_is_missing(control):
    _, url = control
    r = httpx.get(url + "/ready")
    assert r.status_code == 503
    assert "FfnAgent 'ffn0'" in r.json()["waiting_for"] and "Instance 'q' rank 0" in r.json()["waiting_for"]


def test_member_not_in_the_config_is_refused(control):
    state, url = control
    r = _post(state, url + "/v1/members", _member(state, "FfnAgent", "ffn9"))
    assert r.status_code == 409 and "FfnAgent 'ffn9' is not a member of this deployment" in r.json()["detail"]
    assert state.registry.members == {}


def test_config_digest_mismatch_is_refused(control):
    state, url = control
    r = _post(state, url + "/v1/members", _member(state, "FfnAgent", "ffn0", fingerprint="0" * 16))
    assert r.status_code == 409 and "not the same deployment" in r.json()["detail"], r.text
    r = _post(state, url + "/v1/members", _member(state, "FfnAgent", "ffn0", generation=7))
    assert r.status_code == 409 and "belongs to generation 7" in r.json()["detail"]
    assert state.registry.members == {}


def test_second_registration_for_a_slot_is_refused(control):
    state, url = control
    r = _post(state, url + "/v1/members", _member(state, "FfnAgent", "ffn0"))
    assert r.status_code == 200 and r.json()["generation"] == 1
    r = _post(state, url + "/v1/members", _member(state, "FfnAgent", "ffn0", pid=2))
    assert r.status_code == 409 and f"FfnAgent 'ffn0' is already registered by pid {os.getpid()}" in r.json()["detail"]
    assert "FfnAgent 'ffn0'" not in httpx.get(url + "/ready").json()["waiting_for"]


def test_heartbeat_watermark_and_metrics(control):
    state, url = control
    assert _post(state, url + "/v1/members", _member(state, "front", "front")).status_code == 200
    hb = _beat(1, requests={"q": {"2xx": 3}})
    assert _post(state, url + "/v1/heartbeats", hb).status_code == 200
    r = _post(state, url + "/v1/heartbeats", hb)
    assert r.status_code == 409 and "heartbeat 1 is not after 1" in r.json()["detail"]
    hb2 = _beat(2, requests={"q": {"2xx": 5, "5xx": 1}})
    assert _post(state, url + "/v1/heartbeats", hb2).status_code == 200
    text = httpx.get(url + "/metrics").text
    assert 'crosspool_requests_total{code="2xx",model="q"} 5.0' in text
    assert 'crosspool_requests_total{code="5xx",model="q"} 1.0' in text
    assert "crosspool_generation 1.0" in text
    status = httpx.get(url + "/status").json()
    assert status["generation"] == 1 and status["phase"] == "starting"


def test_without_the_member_secret_nothing_changes(control):
    """A spoofed registration, heartbeat (with a sequence number that would freeze the watermark)
    and failure report, with no or a wrong secret: 401, and the state is as before."""
    state, url = control
    assert _post(state, url + "/v1/members", _member(state, "front", "front")).status_code == 200
    failure = {"role": "front", "id": "front", "rank": 0, "generation": 1, "reason": "spoofed"}
    for secret in (None, "wrong"):
        headers = {} if secret is None else {"Authorization": f"Bearer {secret}"}
        for path, body in (
            ("/v1/members", _member(state, "FfnAgent", "ffn0")),
            ("/v1/heartbeats", _beat(2**62)),
            ("/v1/failures", failure),
        ):
            r = httpx.post(url + path, json=body, headers=headers)
            assert r.status_code == 401 and "member secret" in r.json()["detail"], (path, r.text)
    assert state.failure is None and list(state.registry.members) == [("front", "front", 0)]
    assert _post(state, url + "/v1/heartbeats", _beat(1)).status_code == 200  # the watermark did not move


def test_a_secret_of_an_earlier_generation_is_refused(control):
    state, url = control
    old = state.secret
    state.new_generation(state.plan)
    r = _post(state, url + "/v1/members", _member(state, "front", "front"), secret=old)
    assert r.status_code == 401 and state.registry.members == {}


def test_a_pid_this_daemon_did_not_start_is_refused(control):
    state, url = control
    r = _post(state, url + "/v1/members", _member(state, "front", "front", pid=1))
    assert r.status_code == 409 and "pid 1 was not started by this daemon" in r.json()["detail"]
    assert state.registry.members == {}


def test_unregistered_failure_report_is_refused(control):
    state, url = control
    body = {"role": "AtnAgent", "id": "atn0", "rank": 0, "generation": 1, "reason": "x"}
    r = _post(state, url + "/v1/failures", body)
    assert r.status_code == 409 and state.failure is None


def test_fuzz_control_api(control):
    """Every operation, generated from the published schema: no 5xx, documented status codes,
    responses that match the schema (/ready answers 503 until ready, as documented), and only a
    well-formed failure report of a registered member may fail the generation."""
    state, url = control
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/members", "/v1/heartbeats", "/v1/failures", "/ready", "/status"}
    for op in operations:
        checks = [status_code_conformance, response_schema_conformance] + [not_a_server_error] * (op.path != "/ready")
        _fuzz(op, checks, state.secret)
    assert state.failure_kind in (None, "reported")  # only a well-formed report of a member may fail it


def _fuzz(op, checks, secret: str) -> None:
    @given(op.as_strategy())
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(case) -> None:
        case.call_and_validate(checks=checks, headers={"Authorization": f"Bearer {secret}"})

    run()
