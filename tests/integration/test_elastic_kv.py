"""Elastic KV through `crosspool daemon` (real vLLM engines, real madvise, real HTTP): two SmolLM2
Instances share one attention device's KV budget, too small for both bursts at once.

* capacity moves to the busy Instance (unassigned bytes first, then the idle one's), and back when
  the other one gets busy; the donor's worker RSS drops by at least 80% of what it released;
* a donor whose running requests hold its tail blocks keeps them (the transfer waits, then takes
  what was free) and its requests end complete and unchanged;
* prefix-cache hits vanish with the reclaimed blocks and come back once the cache is repopulated;
* a TP 2 group (tiny Qwen3) releases its range on both ranks and serves after it.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from conftest import LiveDeployment, assert_nothing_left, leftover_files, project_processes
from crosspool.kv.backing import rss_bytes
from crosspool.qualify.serving import prompts

pytestmark = pytest.mark.engine

MIB = 2**20
BLOCK_TOKENS = 128  # vLLM's CPU block size
PROMPT = 400  # tokens: with the answer, 4 blocks of SmolLM2 (5.6 MiB each) per request
LONG = 700  # 6 blocks: 16 of them want more than the whole budget
BURST = 16
POLL_S = 0.1


def _text(path: str, budget_gib: float, extra: str = "") -> str:
    model = f'''
path = "{path}"
engine = "vllm"
dtype = "float32"
enforce_eager = true
max_model_len = 1024
kv_cache_gib = 1
engine_args = {{ enable_prompt_tokens_details = true }}
{extra}'''
    return f"""
name = "elastic"
port = PORT
control_port = CONTROL
[[attention_device]]
id = "atn0"
kv_budget_gib = {budget_gib}
[[model]]
id = "a"
{model}
[[model]]
id = "b"
{model}"""


def _live(tmp_path_factory: pytest.TempPathFactory, name: str, text: str):
    files, procs = leftover_files(), set(project_processes())

    def deployment(port: int, control: int) -> str:
        return text.replace("PORT", str(port)).replace("CONTROL", str(control))

    live = LiveDeployment(tmp_path_factory.mktemp(name), deployment, name)
    yield live
    live.close()
    assert_nothing_left(files, 30, procs)


@pytest.fixture(scope="module")
def pair(smollm2, tmp_path_factory):
    # 0.5 GiB = 91 blocks: both floors (9 blocks each: one 1024-token sequence) and one burst of 16
    # 4-block requests, not two
    yield from _live(tmp_path_factory, "elastic", _text(str(smollm2), 0.5))


def _groups(d) -> dict[str, dict]:
    (pool,) = httpx.get(d.control + "/v1/kv", timeout=5).json()
    return {g["model"]: g for g in pool["groups"]} | {"pool": pool}


def _worker_pid(d, model: str, rank: int = 0) -> int:
    members = d.status()["members"]
    return next(m["pid"] for m in members if m["role"] == "rank" and m["id"] == model and m["rank"] == rank)


def _peak_rss(pid: int) -> int:
    """VmHWM: the worker's peak RSS, with its whole KV range zero-filled before it attached."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _complete(d, model: str, prompt: list[int], tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(d.url + "/v1/completions", json={**body, "return_token_ids": True}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _burst(d, model: str, work: list[list[int]], tokens: int) -> list[dict]:
    with ThreadPoolExecutor(len(work)) as pool:
        return list(pool.map(lambda p: _complete(d, model, p, tokens), work))


def _cached(answer: dict) -> int:
    return (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


class Watch:
    """Polls /v1/kv in the background: the largest and smallest backing each group reached, and
    whether a group was seen shrinking."""

    def __init__(self, d) -> None:
        self.d = d
        self.seen: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.seen.append(_groups(self.d))

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        return self.seen


def _settle(d, timeout_s: float = 30) -> dict[str, dict]:
    """/v1/kv once no group shrinks and no transfer is open."""
    deadline = time.monotonic() + timeout_s
    while True:
        groups = _groups(d)
        if groups["pool"]["transfers_in_flight"] == 0 or time.monotonic() > deadline:
            return groups
        time.sleep(POLL_S)


def test_capacity_moves_to_the_busy_instance_and_back(pair, smollm2):
    d = pair.get()
    start = _settle(d)
    for m in "ab":  # each engine released its zero-filled range down to its floor at attach
        g = start[m]
        assert g["attached"] and g["backed_bytes"] == g["floor_bytes"] == 9 * g["block_bytes"], g
        assert g["released_bytes"] >= 0.9 * (g["ceiling_bytes"] - g["floor_bytes"]), g
        pid = _worker_pid(d, m)
        assert _peak_rss(pid) - rss_bytes(pid) >= 0.8 * g["released_bytes"], (m, _peak_rss(pid), rss_bytes(pid))

    _burst(d, "a", prompts(49152, BURST, seed=1, length=PROMPT), 64)
    a_busy = _settle(d)
    assert a_busy["a"]["backed_bytes"] >= 40 * a_busy["a"]["block_bytes"], a_busy["a"]  # funded: >= 40 blocks
    assert a_busy["b"]["backed_bytes"] == a_busy["b"]["floor_bytes"]

    rss_before, released_before = rss_bytes(_worker_pid(d, "a")), a_busy["a"]["released_bytes"]
    _burst(d, "b", prompts(49152, BURST, seed=2, length=PROMPT), 64)
    b_busy = _settle(d)
    given = b_busy["a"]["released_bytes"] - released_before
    assert b_busy["a"]["backed_bytes"] < a_busy["a"]["backed_bytes"] and given >= 100 * MIB, (a_busy, b_busy)
    assert b_busy["b"]["backed_bytes"] > a_busy["b"]["backed_bytes"] + given // 2
    dropped = rss_before - rss_bytes(_worker_pid(d, "a"))
    assert dropped >= 0.8 * given, f"donor RSS dropped {dropped / MIB:.0f} MiB of {given / MIB:.0f} MiB released"
    pool = b_busy["pool"]
    backed = sum(b_busy[m]["backed_bytes"] for m in "ab")
    assert backed <= pool["budget_bytes"] and pool["unassigned_bytes"] == pool["budget_bytes"] - backed

    _burst(d, "a", prompts(49152, BURST, seed=3, length=PROMPT), 64)
    back = _settle(d)
    assert back["a"]["backed_bytes"] > b_busy["a"]["backed_bytes"]
    assert back["b"]["backed_bytes"] < b_busy["b"]["backed_bytes"]


def test_a_donor_keeps_the_blocks_its_running_requests_hold(pair):
    d = pair.get()
    work = prompts(49152, BURST, seed=4, length=PROMPT)
    reference = [a["choices"][0]["token_ids"] for a in _burst(d, "a", work, 96)]
    _settle(d)
    answers: list[dict] = []
    running = threading.Thread(target=lambda: answers.extend(_burst(d, "a", work, 96)))
    running.start()
    deadline = time.monotonic() + 60
    while _groups(d)["a"]["used_bytes"] < 40 * 5 * MIB:  # a's requests hold most of what it backs
        assert time.monotonic() < deadline and running.is_alive(), _groups(d)["a"]
        time.sleep(POLL_S)
    watch = Watch(d)
    _burst(d, "b", prompts(49152, BURST, seed=5, length=PROMPT), 32)
    running.join(timeout=300)
    seen = watch.stop()
    assert any(s["a"]["target_bytes"] is not None and s["a"]["backed_bytes"] > s["a"]["target_bytes"] for s in seen)
    assert [a["choices"][0]["token_ids"] for a in answers] == reference  # none lost, none changed


def test_prefix_cache_hits_vanish_with_reclaimed_blocks_and_return(pair):
    d = pair.get()
    work = prompts(49152, BURST, seed=6, length=PROMPT)
    _burst(d, "a", work, 8)  # cached in a's blocks
    hits = [_cached(_complete(d, "a", p, 1)) for p in work[:4]]
    assert min(hits) >= 3 * BLOCK_TOKENS, hits  # full blocks of each prompt hit
    _burst(d, "b", prompts(49152, BURST, seed=7, length=LONG), 64)  # b wants it all: a's cache is reclaimed
    after = _settle(d)["a"]
    assert after["backed_bytes"] == after["floor_bytes"], after
    hits = [_cached(_complete(d, "a", p, 1)) for p in work[4:]]
    assert sum(hits) <= (after["backed_bytes"] // after["block_bytes"] - 1) * BLOCK_TOKENS, hits  # the floor's at most
    again = _cached(_complete(d, "a", work[-1], 1))
    assert again >= 3 * BLOCK_TOKENS  # repopulated by the request before


@pytest.fixture(scope="module")
def tp2(tiny_served, tmp_path_factory):
    text = _text(str(tiny_served), 1.0, "attention_tp = 2").replace('dtype = "float32"', "")
    text = text.split('[[model]]\nid = "b"')[0]
    yield from _live(tmp_path_factory, "elastic-tp2", text)


def test_tp2_group_releases_on_both_ranks_and_serves(tp2):
    d = tp2.get()
    g = _settle(d)["a"]
    assert g["backed_bytes"] == g["floor_bytes"]
    assert g["released_bytes"] >= 0.9 * (g["ceiling_bytes"] - g["floor_bytes"])
    for rank in (0, 1):  # each rank released its half
        pid = _worker_pid(d, "a", rank)
        assert _peak_rss(pid) - rss_bytes(pid) >= 0.8 * g["released_bytes"] / 2, (rank, _peak_rss(pid), rss_bytes(pid))
    answers = _burst(d, "a", prompts(49152, 8, seed=8, length=PROMPT), 16)
    assert all(a["usage"]["completion_tokens"] == 16 for a in answers)


def test_top_shows_the_pool_live_in_a_terminal(pair):
    import os
    import pty
    import signal
    import subprocess
    import sys

    d = pair.get()
    master, slave = pty.openpty()
    argv = [sys.executable, "-m", "crosspool", "top", "--url", d.control, "--interval", "0.2"]
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env={**os.environ, "COLUMNS": "160"})
    os.close(slave)
    screen = b""
    deadline = time.monotonic() + 30
    while screen.count(b"crosspool top") < 3 and time.monotonic() < deadline:
        screen += os.read(master, 65536)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=10) == 0
    os.close(master)
    text = screen.decode(errors="replace")
    assert text.count("crosspool top") >= 3, text[-2000:]  # refreshed in place, like top
    assert "atn0: budget 512 MiB" in text and "\x1b[" in text
    groups = _groups(d)
    for m in "ab":
        assert f"{groups[m]['backed_bytes'] / MIB:,.0f}" in text, (m, text[-2000:])
