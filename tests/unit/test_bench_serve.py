"""The load runner's pure parts: length distributions, arrivals, SLO attainment, and the elastic-KV
bench's reading of its samples (RSS given back per byte released, transfers)."""

from __future__ import annotations

import argparse
import random

import pytest

from crosspool.bench.elastic_kv import donor_rss_drop, out_of_phase, transfers
from crosspool.bench.serve import Lengths, Outcome, native_env, poisson, summarize
from crosspool.config import parse_deployment

MIB = 2**20


def test_lengths_parse_and_sample():
    rng = random.Random(0)
    assert Lengths.parse("fixed:128").sample(rng) == 128
    assert all(64 <= Lengths.parse("uniform:64:72").sample(rng) <= 72 for _ in range(100))
    logn = [Lengths.parse("lognormal:200:0.5").sample(rng) for _ in range(2000)]
    assert 180 <= sorted(logn)[1000] <= 220  # the median
    with pytest.raises(argparse.ArgumentTypeError, match="uniform:A:B"):
        Lengths.parse("uniform:3")


def test_arrivals_are_seeded_and_poisson():
    a = poisson(["x", "y"], 4.0, 400, Lengths("fixed", 8), Lengths("fixed", 4), seed=1)
    assert a == poisson(["x", "y"], 4.0, 400, Lengths("fixed", 8), Lengths("fixed", 4), seed=1)
    assert 80 <= a[-1].t <= 120 and {r.model for r in a} == {"x", "y"} and all(len(r.prompt) == 8 for r in a)
    phases = out_of_phase(10.0, 2.0, 16, 4, seed=0)
    assert {r.model for r in phases if r.t < 10} == {"a"} and {r.model for r in phases if 10 <= r.t < 20} == {"b"}


def test_slo_attainment_counts_ttft_and_tpot(tiny_models):
    d = parse_deployment(f'[[model]]\nid = "m"\npath = "{tiny_models["llama"]}"\nengine = "vllm"\nttft_slo_s = 1.0\n')
    outcomes = [
        Outcome("m", 0.0, ok=True, ttft_s=0.5, itl_s=[0.1, 0.2], output_tokens=3),  # met
        Outcome("m", 0.0, ok=True, ttft_s=1.5, itl_s=[0.1], output_tokens=2),  # TTFT over
        Outcome("m", 0.0, ok=True, ttft_s=0.2, itl_s=[2.0], output_tokens=2),  # TPOT over tbt_slo_s (1.0)
        Outcome("m", 0.0, error="HTTP 503"),
    ]
    s = summarize(outcomes, d, seconds=2.0)
    assert s["slo_attainment"] == 0.25 and s["failed"] == 1 and s["output_tok_s"] == 3.5
    assert s["per_model"]["m"]["requests"] == 4 and s["errors"] == ["HTTP 503"]


def _sample(t: float, backed: int, target: int, released: int, rss: int, recent: list[dict]) -> dict:
    group = {"model": "a", "backed_bytes": backed * MIB, "target_bytes": target * MIB, "released_bytes": released * MIB}
    return {"t": t, "rss": {"a": rss * MIB}, "kv": [{"groups": [group], "recent_transfers": recent}]}


def test_donor_rss_drop_and_transfers_from_samples():
    first = {"model": "a", "dp_rank": 0, "started": 100.25, "bytes": 256 * MIB, "seconds": 0.03, "complete": True}
    second = first | {"started": 100.8, "bytes": 10 * MIB, "seconds": 2.1, "complete": False}
    samples = [
        _sample(0.0, 300, 300, 0, 1000, []),
        _sample(0.25, 300, 44, 0, 1000, []),  # asked to shrink
        _sample(0.5, 44, 44, 256, 760, [first]),  # released 256 MiB, RSS down 240
        _sample(0.75, 100, 100, 256, 800, [first]),  # grew again: RSS up, nothing released
        _sample(1.0, 100, 100, 256, 800, [first, second]),
    ]
    assert donor_rss_drop(samples) == {"released_mib": 256.0, "rss_dropped_mib": 240.0, "fraction": 0.938}
    assert transfers(samples) == [
        {"model": "a", "mib": 256.0, "seconds": 0.03, "complete": True},
        {"model": "a", "mib": 10.0, "seconds": 2.1, "complete": False},
    ]


def test_native_engines_split_the_budget_evenly_in_whole_units(tiny_models):
    """The natives' fixed split: vLLM gets bytes, SGLang tokens, both integers (SGLang's parser
    refuses '1456.0')."""
    text = '[[attention_device]]\nid = "atn0"\nkv_budget_gib = 0.0625\n' + "".join(
        f'[[model]]\nid = "{m}"\npath = "{tiny_models["llama"]}"\nengine = "{engine}"\n'
        for m, engine in (("v", "vllm"), ("s", "sglang"))
    )
    d = parse_deployment(text)
    assert native_env(d, "v") == ({"kv_cache_memory_bytes": 2**25}, {"VLLM_CPU_KVCACHE_SPACE": None})
    (tokens,) = native_env(d, "s")[0].values()
    assert type(tokens) is int and tokens > 0


def test_fault_campaign_judges_every_request_of_the_window():
    """A fault passes only if each request ended in time, the failed member's models answered 200
    or a 503 naming it, and the other models answered 200; a short stop fails nothing."""
    from crosspool.bench.faults import Fault, Request, judge

    def fault(kind: str = "SIGKILL", detected: str | None = "Instance 'a' rank 0 (pid 7) exited") -> Fault:
        return Fault(
            "Worker", kind, "a", "Instance 'a'", 7, at=100.0, detected_s=1.0, detected=detected, affected=["a"]
        )

    named = "CrossPool Instance 'a' failed: Instance 'a' rank 0 (pid 7) exited"
    ok = fault()
    judge(
        ok, [Request("a", 99.0, 101.5, 503, named), Request("b", 99.0, 102.0, 200), Request("a", 99.5, 100.5, 200)], 100
    )
    assert ok.problems == [] and ok.requests == {"200": 2, "503": 1}
    other = fault()
    judge(other, [Request("b", 99.0, 101.0, 503, named)], 100)
    assert other.unaffected_errors == 1 and other.problems
    unnamed = fault()
    judge(unnamed, [Request("a", 99.0, 101.0, 503, "CrossPool deployment failed: something")], 100)
    assert unnamed.problems and unnamed.unaffected_errors == 0
    hung = fault()
    judge(hung, [Request("a", 99.0, 112.5, 503, named)], 100)  # 11.5 s after the detection
    assert hung.problems
    short = fault("SIGSTOP-short", detected=None)
    judge(short, [Request("a", 99.0, 103.0, 200), Request("b", 99.0, 101.0, 200)], 102.0)
    assert short.problems == []
    assert (
        fault("SIGSTOP-short").problems == [] and judge(s := fault("SIGSTOP-short"), [], 102.0) is None and s.problems
    )
