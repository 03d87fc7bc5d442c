"""`crosspool daemon` with one model, end to end: real vLLM OpenAI server, real agents, real HTTP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import RunningDaemon, model_toml

pytestmark = pytest.mark.engine


def test_chat_paris_status_and_clean_stop(tmp_path, smollm2, no_leftovers):
    served = RunningDaemon(tmp_path, model_toml("smollm2-135m", smollm2, enforce_eager=True))
    try:
        models = httpx.get(served.url + "/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["smollm2-135m"]
        assert httpx.get(served.control + "/ready").json()["ready"] is True
        r = httpx.post(
            served.url + "/v1/chat/completions",
            timeout=120,
            json={
                "model": "smollm2-135m",
                "temperature": 0,
                "max_tokens": 24,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
            },
        )
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
        r = httpx.post(served.url + "/v1/completions", json={"model": "nope", "prompt": "x"})
        assert r.status_code == 404 and "smollm2-135m" in r.json()["error"]["message"]
        status = served.status()
        assert status["phase"] == "ready" and status["models"]["smollm2-135m"]["state"] == "serving"
        assert all(m["registered"] for m in status["members"])
        table = subprocess.run(
            [sys.executable, "-m", "crosspool", "status", str(served.file)], capture_output=True, text=True, timeout=60
        )
        assert table.returncode == 0 and "Instance 'smollm2-135m' rank 0" in table.stdout, table.stderr
        assert "serving" in table.stdout and "generation 1 ready" in table.stdout, table.stdout
        ports = [served.port, served.control_port, int(status["models"]["smollm2-135m"]["url"].rsplit(":", 1)[1])]
        time.sleep(1)  # one heartbeat interval: the front and the rank report their counters
        metrics = httpx.get(served.control + "/metrics").text
        assert 'crosspool_requests_total{code="2xx",model="smollm2-135m"} 1.0' in metrics, metrics
        assert 'crosspool_ffn_call_seconds_count{model="smollm2-135m"}' in metrics
        assert served.stop() == 0
        for port in ports:
            with socket.socket() as probe:
                assert probe.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still listens"
    finally:
        served.kill()


def test_killed_ffn_agent_fails_request_and_deployment(tmp_path, smollm2, no_leftovers):
    served = RunningDaemon(tmp_path, model_toml("smollm2-135m", smollm2, enforce_eager=True))
    try:
        result: dict = {}

        def long_request() -> None:
            r = httpx.post(
                served.url + "/v1/completions",
                timeout=60,
                json={
                    "model": "smollm2-135m",
                    "prompt": "Once upon a time",
                    "max_tokens": 900,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            result.update(status=r.status_code, body=r.text)

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(3)  # generation under way
        killed_at = time.monotonic()
        os.kill(served.pid_of("FfnAgent 'ffn0'"), signal.SIGKILL)
        t.join(timeout=30)
        assert not t.is_alive(), "request hung after the FfnAgent died"
        assert time.monotonic() - killed_at < 10
        assert result["status"] == 503, result
        assert "FfnAgent 'ffn0'" in result["body"], result
        assert served.proc.wait(timeout=90) != 0
        assert any("failure: FfnAgent 'ffn0' killed by SIGKILL" in line for line in served.stderr), served.stderr[-20:]
    finally:
        served.kill()
