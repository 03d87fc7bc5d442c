"""Elastic KV through `crosspool daemon` (real vLLM and SGLang engines, real madvise, real HTTP):
a vLLM Instance ("a") and an SGLang Instance ("b"; vLLM where CrossPool refuses SGLang's CPU
path) of SmolLM2 share one attention device's KV
budget, too small for both bursts at once; each engine is donor and borrower in turn.

* capacity moves to the busy Instance (unassigned bytes first, then the idle one's), and back when
  the other one gets busy; each donor's worker RSS drops by at least 80% of what it released;
* a donor whose running requests hold its tail blocks keeps them (the transfer waits, then takes
  what was free) and its requests end complete and unchanged;
* prefix-cache hits vanish with the reclaimed blocks and come back once the cache is repopulated;
* two-rank groups (tiny Qwen3: vLLM TP 2, SGLang zigzag prefill CP 2) release their range on both
  ranks, grow with one decision for both ranks (SGLang's CP ranks vote) and serve after it; a
  stopped EngineCore under load is named as a stalled step.

One deployment per test class, alive for that class only: an idle SGLang scheduler polls at 100%
of a CPU.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from conftest import LiveDeployment, assert_nothing_left, frozen, leftover_files, project_processes
from crosspool import host
from crosspool.integrations.sglang.cp import CP_SPLIT
from crosspool.integrations.sglang.launch import host_problems
from crosspool.kv.backing import rss_bytes
from crosspool.qualify.serving import prompts

pytestmark = pytest.mark.engine

MIB = 2**20
# Where CrossPool refuses SGLang's CPU path (an AMX host with a real sgl_kernel), b is vLLM too.
ENGINE = {"a": "vllm", "b": "vllm" if host_problems() else "sglang"}
BLOCK_TOKENS = {"vllm": 128, "sglang": 1}  # a KV block: vLLM's CPU block, SGLang's token slot
CACHE_REPORT = {"vllm": "enable_prompt_tokens_details", "sglang": "enable_cache_report"}
# bf16 where the CPU computes it natively (AVX512-BF16, AMX), else fp32: an AVX2-only EPYC ran bf16
# GEMMs 10x slower than fp32 (7.5 vs 75 GFLOP/s, one idle core), which kept this module busy for over
# 40 minutes. The budget scales with the element size, so both hold the same number of blocks.
NATIVE_BF16 = bool({"avx512_bf16", "amx_bf16"} & set(host.describe()["cpu_flags"]))
DTYPE, ELEMENT_BYTES = ("bfloat16", 2) if NATIVE_BF16 else ("float32", 4)
PROMPT = 400  # tokens: with the answer, 4 vLLM blocks of SmolLM2 (2.8 MiB each in bf16) per request
LONG = 700  # 16 of them want more than the whole budget
BURST = 16
POLL_S = 0.1


def _text(path: str, budget_gib: float, extra: dict[str, str] | None = None, dtype: str | None = None) -> str:
    extra = extra or {}

    def model(id: str) -> str:
        engine = ENGINE[id]
        return f'''[[model]]
id = "{id}"
path = "{path}"
engine = "{engine}"
{f'dtype = "{dtype}"' if dtype else ""}
{"enforce_eager = true" if engine == "vllm" else ""}
max_model_len = 1024
kv_cache_gib = 1
engine_args = {{ {CACHE_REPORT[engine]} = true }}
{extra.get(id, "")}
'''

    return f"""
name = "elastic"
port = PORT
control_port = CONTROL
[[attention_device]]
id = "atn0"
kv_budget_gib = {budget_gib}
{model("a")}
{model("b")}"""


def _live(tmp_path_factory: pytest.TempPathFactory, name: str, text: str):
    files, procs = leftover_files(), set(project_processes())

    def deployment(port: int, control: int) -> str:
        return text.replace("PORT", str(port)).replace("CONTROL", str(control))

    live = LiveDeployment(tmp_path_factory.mktemp(name), deployment, name)
    yield live
    live.close()
    assert_nothing_left(files, 30, procs)


@pytest.fixture(scope="class")
def pair(smollm2, tmp_path_factory):
    # bf16: 0.25 GiB = 91 vLLM blocks or 11,650 SGLang slots: both floors (one 1024-token sequence
    # each) and one burst of 16 400-token requests, not two
    yield from _live(tmp_path_factory, "elastic", _text(str(smollm2), 0.25 * ELEMENT_BYTES / 2, dtype=DTYPE))


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
    r = httpx.post(d.url + "/v1/completions", json=body, timeout=300)
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


def _donates(d, donor: str, borrower: str, seed: int, before: dict) -> dict:
    """A burst on `borrower` while `donor` (funded by `before`) idles: capacity moves, and the
    donor's worker RSS drops by at least 80% of what it released."""
    rss, released = rss_bytes(_worker_pid(d, donor)), before[donor]["released_bytes"]
    _burst(d, borrower, prompts(49152, BURST, seed=seed, length=PROMPT), 64)
    after = _settle(d)
    given = after[donor]["released_bytes"] - released
    assert after[donor]["backed_bytes"] < before[donor]["backed_bytes"] and given >= 50 * MIB, (before, after)
    assert after[borrower]["backed_bytes"] > before[borrower]["backed_bytes"] + given // 2
    dropped = rss - rss_bytes(_worker_pid(d, donor))
    assert dropped >= 0.8 * given, f"{donor}: RSS dropped {dropped / MIB:.0f} MiB of {given / MIB:.0f} MiB released"
    pool = after["pool"]
    # The daemon's record: the burst's demand may reach it over more than one tick, one transfer each.
    moved = [t for t in pool["recent_transfers"] if t not in before["pool"]["recent_transfers"]]
    gave = [t for t in moved if t["model"] == donor]
    assert gave and sum(t["bytes"] for t in gave) >= given, moved
    assert all(t["complete"] and t["seconds"] > 0 for t in gave), gave  # an idle donor reaches its target
    backed = sum(after[m]["backed_bytes"] for m in "ab")
    assert backed <= pool["budget_bytes"] and pool["unassigned_bytes"] == pool["budget_bytes"] - backed
    return after


class TestPair:
    def test_capacity_moves_to_the_busy_instance_and_back(self, pair):
        d = pair.get()
        start = _settle(d)
        for m in "ab":  # each engine released its zero-filled range down to its floor at attach
            g = start[m]
            assert g["attached"] and g["backed_bytes"] == g["floor_bytes"] >= 1024 * 22 * 1024, g
            assert g["released_bytes"] >= 0.9 * (g["ceiling_bytes"] - g["floor_bytes"]), g
            pid = _worker_pid(d, m)
            assert _peak_rss(pid) - rss_bytes(pid) >= 0.8 * g["released_bytes"], (m, _peak_rss(pid), rss_bytes(pid))

        _burst(d, "a", prompts(49152, BURST, seed=1, length=PROMPT), 64)
        a_busy = _settle(d)
        assert a_busy["a"]["backed_bytes"] >= 0.4 * a_busy["pool"]["budget_bytes"], a_busy["a"]  # funded
        assert a_busy["b"]["backed_bytes"] == a_busy["b"]["floor_bytes"]
        b_busy = _donates(d, "a", "b", 2, a_busy)  # vLLM gives to SGLang
        _donates(d, "b", "a", 3, b_busy)  # and SGLang back to vLLM

    @pytest.mark.parametrize("donor", ["a", "b"], ids=["vllm", ENGINE["b"]])
    def test_a_donor_keeps_the_blocks_its_running_requests_hold(self, pair, donor):
        d, borrower = pair.get(), "b" if donor == "a" else "a"
        work = prompts(49152, BURST, seed=4, length=PROMPT)
        reference = [a["choices"][0]["text"] for a in _burst(d, donor, work, 96)]
        budget = _settle(d)["pool"]["budget_bytes"]
        answers: list[dict] = []
        running = threading.Thread(target=lambda: answers.extend(_burst(d, donor, work, 96)))
        running.start()
        deadline = time.monotonic() + 60
        while _groups(d)[donor]["used_bytes"] < 0.4 * budget:  # its requests hold most of what it backs
            assert time.monotonic() < deadline and running.is_alive(), _groups(d)[donor]
            time.sleep(POLL_S)
        watch = Watch(d)
        _burst(d, borrower, prompts(49152, BURST, seed=5, length=PROMPT), 16)
        running.join(timeout=300)
        seen = watch.stop()
        shrinking = [s[donor] for s in seen if s[donor]["target_bytes"] is not None]
        assert any(g["backed_bytes"] > g["target_bytes"] for g in shrinking), (
            "the donor never held blocks past its target"
        )
        # None lost: every request ran to its length. None changed: a block released under a running
        # request would corrupt the answers of every request holding the tail; bf16 greedy decoding
        # may also drift late in an answer when the engine batches the burst differently (seen on a
        # loaded host), so most, not all, must match the run without a transfer.
        assert [a["usage"]["completion_tokens"] for a in answers] == [96] * len(work)
        same = sum(a["choices"][0]["text"] == r for a, r in zip(answers, reference, strict=True))
        assert same >= 0.75 * len(work), f"{same} of {len(work)} answers as without the transfer"

    @pytest.mark.parametrize("donor", ["a", "b"], ids=["vllm", ENGINE["b"]])
    def test_prefix_cache_hits_vanish_with_reclaimed_blocks_and_return(self, pair, donor):
        d, borrower = pair.get(), "b" if donor == "a" else "a"
        work = prompts(49152, BURST, seed=6, length=PROMPT)
        _burst(d, donor, work, 8)  # cached in the donor's blocks
        hits = [_cached(_complete(d, donor, p, 1)) for p in work[:4]]
        assert min(hits) >= 384, hits  # each prompt's full blocks hit
        _burst(d, borrower, prompts(49152, BURST, seed=7, length=LONG), 32)  # wants it all: the cache is reclaimed
        after = _settle(d)[donor]
        assert after["backed_bytes"] == after["floor_bytes"], after
        hits = [_cached(_complete(d, donor, p, 1)) for p in work[4:]]
        floor_tokens = after["backed_bytes"] // after["block_bytes"] * BLOCK_TOKENS[ENGINE[donor]]
        assert sum(hits) <= floor_tokens, hits  # what the floor holds at most
        again = _cached(_complete(d, donor, work[-1], 1))
        assert again >= 384  # repopulated by the request before

    def test_top_shows_the_pool_live_in_a_terminal(self, pair):
        import contextlib
        import os
        import pty
        import select
        import signal
        import subprocess
        import sys

        d = pair.get()
        before = _settle(d)  # an earlier test's transfer may still run
        master, slave = pty.openpty()
        argv = [sys.executable, "-m", "crosspool", "top", "--url", d.control, "--interval", "0.2"]
        proc = subprocess.Popen(
            argv,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env={**os.environ, "COLUMNS": "160"},
            # A shell without job control starts background commands with SIGINT ignored, and
            # children inherit that: Ctrl-C must reach top however the suite was started.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        os.close(slave)
        screen = b""
        try:
            deadline = time.monotonic() + 30
            while screen.count(b"crosspool top") < 3 and time.monotonic() < deadline:
                screen += os.read(master, 65536)
            proc.send_signal(signal.SIGINT)
            deadline = time.monotonic() + 10
            while proc.poll() is None and time.monotonic() < deadline:  # drain: top's exit writes to the terminal
                if select.select([master], [], [], 0.1)[0]:
                    with contextlib.suppress(OSError):  # EIO once top has exited
                        screen += os.read(master, 65536)
            assert proc.wait(timeout=1) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            os.close(master)
        text = screen.decode(errors="replace")
        assert text.count("crosspool top") >= 3, text[-2000:]  # refreshed in place, like top
        assert f"atn0: budget {128 * ELEMENT_BYTES} MiB" in text and "\x1b[" in text
        after = _groups(d)
        for m in "ab":
            shown = {f"{g[m]['backed_bytes'] / MIB:,.0f}" for g in (before, after)}
            assert any(mib in text for mib in shown), (m, shown, text[-2000:])


@pytest.fixture(scope="class")
def tp2(tiny_served, tmp_path_factory):
    # 4 ranks on the host's CPUs: b's idle schedulers sleep instead of polling (SGLang's sleep_on_idle)
    # b under SGLang: prefill CP 2 (its tp_size 2 is the two CP ranks, each with all KV heads)
    cp = 'attn_cp_size = 2, enable_prefill_cp = true, cp_strategy = "zigzag"'
    sglang = f"attention_tp = 2\nengine_args = {{ sleep_on_idle = true, {cp} }}"
    sglang = sglang if ENGINE["b"] == "sglang" else "attention_tp = 2"
    text = _text(str(tiny_served), 0.25, {"a": "attention_tp = 2", "b": sglang})
    yield from _live(tmp_path_factory, "elastic-tp2", text.replace("engine_args = { enable_cache_report = true }", ""))


class TestTp2:
    def test_tp2_groups_release_on_both_ranks_and_grow_together(self, tp2):
        """Both groups release on both ranks at attach; the one whose ranks vote (SGLang: a scheduler
        per CP rank) grows with a burst its CP ranks split; vLLM's one EngineCore decides for both
        ranks."""
        d = tp2.get()
        start = _settle(d)
        for m in "ab":
            g = start[m]
            assert g["backed_bytes"] == g["floor_bytes"]
            assert g["released_bytes"] >= 0.9 * (g["ceiling_bytes"] - g["floor_bytes"])
            for rank in (0, 1):  # each rank released its half
                pid = _worker_pid(d, m, rank)
                assert _peak_rss(pid) - rss_bytes(pid) >= 0.8 * g["released_bytes"] / 2, (m, rank, _peak_rss(pid))
        answers = _burst(d, "b", prompts(49152, BURST, seed=8, length=PROMPT), 16)
        assert all(a["usage"]["completion_tokens"] == 16 for a in answers)
        grown = _settle(d)["b"]  # both ranks took the new capacity (else the Instance fails)
        assert grown["backed_bytes"] > start["b"]["backed_bytes"] and grown["backed_bytes"] == grown["target_bytes"], (
            grown
        )
        assert all(m["state"] == "serving" for m in d.status()["models"].values())
        if ENGINE["b"] == "sglang":  # each CP rank split a prefill
            assert "".join(d.stderr).count(CP_SPLIT) == 2, d.stderr[-20:]  # two ranks' lines may share one

    def test_a_stalled_engine_step_is_named_within_its_bound(self, tp2):
        """vLLM's EngineCore stopped while its API server answers and both TP workers beat: a
        request sits at the engine and no layer call comes. The daemon names the stall within
        limits.engine_health_timeout_s (default 10 s) and the request ends with 503 naming it.
        Last in its class: the deployment ends (restart = false)."""
        from crosspool.bench.procs import role_of

        d = tp2.get()
        core = _worker_pid(d, "a")
        while role_of(core) != "EngineCore":  # the workers are the EngineCore's children
            core = int(Path(f"/proc/{core}/stat").read_text().rsplit(")", 1)[1].split()[1])
        with contextlib.suppress(ProcessLookupError), frozen(core), ThreadPoolExecutor(1) as pool:  # the stop kills it
            sent_at = time.monotonic()
            held = pool.submit(
                httpx.post, d.url + "/v1/completions", json={"model": "a", "prompt": [1, 2, 3]}, timeout=60
            )
            while (failure := d.status()["failure"]) is None:
                assert time.monotonic() - sent_at < 10 + 3, "the stalled step was not noticed"
                time.sleep(0.2)
            assert "Instance 'a' made no layer call for" in failure and "its step stalled" in failure, failure
            answer = held.result(timeout=5)  # the front ends it when it learns the failure
        assert answer.status_code == 503 and "its step stalled" in answer.text, answer.text
