"""`crosspool serve` end to end: real vLLM OpenAI server, real agents, real HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from crosspool.daemon.supervisor import bind_port

pytestmark = pytest.mark.engine


class Served:
    def __init__(self, tmp: Path, model: Path, *, eager: bool = True) -> None:
        self.port = bind_port("127.0.0.1")
        self.file = tmp / "deployment.toml"
        self.file.write_text(f'''
name = "test"
port = {self.port}
[limits]
max_batched_tokens = 512
ffn_timeout_s = 5
[[model]]
id = "smollm2-135m"
path = "{model}"
engine = "vllm"
max_model_len = 1024
enforce_eager = {str(eager).lower()}
''')
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "crosspool", "serve", str(self.file)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        ready = self.proc.stdout.readline()  # the ready line, or EOF if serve failed
        assert ready.startswith("crosspool: ready in"), "".join(self.stderr[-30:])
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _pid_of(pattern: str) -> int:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    assert out, f"no process matches {pattern!r}"
    return int(out[0])


def test_chat_paris_and_clean_stop(tmp_path, smollm2, no_leftovers):
    served = Served(tmp_path, smollm2)
    try:
        models = httpx.get(served.url + "/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["smollm2-135m"]
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
        assert served.stop() == 0
    finally:
        served.kill()


def test_killed_ffn_agent_fails_request_and_deployment(tmp_path, smollm2, no_leftovers):
    served = Served(tmp_path, smollm2)
    try:
        result: dict = {}

        def long_request() -> None:
            start = time.monotonic()
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
            result.update(status=r.status_code, body=r.text, seconds=time.monotonic() - start)

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(3)  # generation under way
        killed_at = time.monotonic()
        os.kill(_pid_of("crosspool.agents.ffn_agent"), signal.SIGKILL)
        t.join(timeout=30)
        assert not t.is_alive(), "request hung after the FfnAgent died"
        assert time.monotonic() - killed_at < 10
        assert result["status"] == 503, result
        assert "FfnAgent 'ffn0'" in result["body"], result
        assert served.proc.wait(timeout=60) != 0
        assert any("failure: FfnAgent 'ffn0' killed by SIGKILL" in line for line in served.stderr)
    finally:
        served.kill()


def test_sigkilled_serve_takes_members_down(tmp_path, smollm2, no_leftovers):
    served = Served(tmp_path, smollm2)
    try:
        served.proc.kill()
        served.proc.wait()
        # Members get SIGTERM through PR_SET_PDEATHSIG and unlink their own segments;
        # no_leftovers then checks that no process or crosspool segment is left.
    finally:
        served.kill()
