"""`crosspool bench elastic-kv`: two models on one attention device, bursty out-of-phase load, a
KV budget an even fixed split cannot serve a burst with.

    crosspool bench elastic-kv [--engine vllm|sglang] [--budget-gib G] [--phase-s S] [--rate R] --out FILE

Models a and b (SmolLM2-135M, both through one engine) share `--budget-gib`. The load has three
phases of `--phase-s` seconds: a busy while b idles, then b busy, then a again (Poisson arrivals
at `--rate` per second to the busy model). The same arrivals go to the native engines with the
budget split evenly and to CrossPool with elastic KV (`crosspool bench serve`, one run).

The defaults are sized for two CPUs, where the KV and not the compute must be what a burst runs
out of: a 64 MiB budget (22 vLLM blocks of 128 tokens in bf16) holds two 448-token requests per
model when split evenly and four when the idle model keeps only its floor (one max_model_len
sequence: max_model_len 512); at 1.2 arrivals/s a request lives about 2 s, so a burst needs about
three at a time. A higher rate makes both sides compute-bound (at 1.4/s both attained under 0.31).

`summary`: slo_attainment_fixed / _elastic / _ratio, donor_rss_drop_fraction (worker RSS given
back over the bytes the donors released), the largest transfer (MiB, and seconds from the
daemon's lower target to the donor's release, as the daemon recorded it). The JSON also holds
the attainment each side would have had at other TTFT SLOs (`slo_attainment_by_ttft_slo_s`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from dataclasses import asdict
from pathlib import Path

from crosspool import host
from crosspool.bench import serve
from crosspool.ipc import bind_port
from crosspool.qualify.serving import prompts

MIB = 2**20
TBT_SLO_S = 2.0
TTFT_SWEEP_S = (0.5, 1.0, 2.0, 5.0)


def deployment_text(
    model: Path,
    engine: str,
    budget_gib: float,
    port: int,
    control_port: int,
    *,
    name: str = "elastic-kv",
    max_model_len: int,
    max_num_seqs: int = 16,
    ttft_slo_s: float | None = None,
) -> str:
    """Models a and b, both `model` through `engine`, sharing one device's `budget_gib`."""
    slos = "" if ttft_slo_s is None else f"ttft_slo_s = {ttft_slo_s}\ntbt_slo_s = {TBT_SLO_S}\n"
    one = f'''path = "{model}"
engine = "{engine}"
{"enforce_eager = true" if engine == "vllm" else ""}
max_model_len = {max_model_len}
max_num_seqs = {max_num_seqs}
kv_cache_gib = 1
{slos}'''
    return f"""name = "{name}"
port = {port}
control_port = {control_port}
[[attention_device]]
id = "atn0"
kv_budget_gib = {budget_gib}
[[model]]
id = "a"
{one}
[[model]]
id = "b"
{one}"""


def out_of_phase(phase_s: float, rate: float, prompt_len: int, output_len: int, seed: int) -> list[serve.Arrival]:
    rng = random.Random(seed)
    arrivals: list[serve.Arrival] = []
    for phase, model in enumerate("aba"):
        t = phase * phase_s
        while True:
            t += rng.expovariate(rate)
            if t >= (phase + 1) * phase_s:
                break
            tokens = prompts(serve.VOCAB, 1, seed=seed * 1_000_003 + len(arrivals), length=prompt_len)[0]
            arrivals.append(serve.Arrival(t, model, tokens, output_len))
    return arrivals


def attainment_by_ttft_slo(outcomes: list[serve.Outcome]) -> dict[str, float]:
    """SLO attainment of one side's outcomes had the TTFT SLO been each of TTFT_SWEEP_S: how much
    the ratio owes to the SLO chosen."""
    return {
        f"{t:g}": round(sum(serve.meets(o, t, TBT_SLO_S) for o in outcomes) / len(outcomes), 4) for t in TTFT_SWEEP_S
    }


def donor_rss_drop(samples: list[dict]) -> dict[str, float]:
    """Over the CrossPool run: bytes the groups released (madvise) and the RSS their workers gave
    back meanwhile (sum of drops between samples), per model and in all."""
    released: dict[str, int] = {}
    dropped: dict[str, int] = {}
    for before, after in itertools.pairwise(samples):
        for pool_before, pool_after in zip(before.get("kv", []), after.get("kv", []), strict=False):
            for g0, g1 in zip(pool_before["groups"], pool_after["groups"], strict=True):
                gave = g1["released_bytes"] - g0["released_bytes"]
                if gave > 0:
                    released[g1["model"]] = released.get(g1["model"], 0) + gave
                    rss_drop = before["rss"].get(g1["model"], 0) - after["rss"].get(g1["model"], 0)
                    dropped[g1["model"]] = dropped.get(g1["model"], 0) + max(rss_drop, 0)
    total = sum(released.values())
    return {
        "released_mib": round(total / MIB, 1),
        "rss_dropped_mib": round(sum(dropped.values()) / MIB, 1),
        "fraction": round(sum(dropped.values()) / total, 3) if total else 0.0,
    }


def transfers(samples: list[dict]) -> list[dict]:
    """Every transfer the daemon recorded during the run (each sample holds the last few)."""
    seen: dict[tuple, dict] = {}
    for s in samples:
        for pool in s.get("kv", []):
            for t in pool["recent_transfers"]:
                seen[(t["model"], t["dp_rank"], t["started"])] = {
                    "model": t["model"],
                    "mib": round(t["bytes"] / MIB, 1),
                    "seconds": t["seconds"],
                    "complete": t["complete"],
                }
    return [seen[k] for k in sorted(seen, key=lambda k: k[2])]


def demand_trace(samples: list[dict]) -> dict:
    """The CrossPool run's demand as the arbiter saw it, for replaying the policy in unit tests:
    per sample (every SAMPLE_S) and group, the blocks demanded, seconds to the deadline and the
    blocks held by requests."""
    attached = [s["kv"][0] for s in samples if s.get("kv") and all(g["attached"] for g in s["kv"][0]["groups"])]
    assert attached, "no sample with every group attached"
    first = attached[0]
    return {
        "sample_s": serve.SAMPLE_S,
        "budget_bytes": first["budget_bytes"],
        "groups": {
            g["model"]: {
                "block_bytes": g["block_bytes"],
                "floor_blocks": g["floor_bytes"] // g["block_bytes"],
                "ceiling_blocks": g["ceiling_bytes"] // g["block_bytes"],
            }
            for g in first["groups"]
        },
        "ticks": [
            {
                g["model"]: [
                    g["demand_bytes"] // g["block_bytes"],
                    g["deadline_in_s"],
                    g["used_bytes"] // g["block_bytes"],
                ]
                for g in pool["groups"]
            }
            for pool in attached
        ],
    }


def main(argv: list[str] | None = None) -> int:
    from crosspool.models.prepare import prepare_smollm2

    p = argparse.ArgumentParser(
        prog="crosspool bench elastic-kv", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: SmolLM2-135M)")
    p.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    p.add_argument("--budget-gib", type=float, default=0.0625)
    p.add_argument("--phase-s", type=float, default=40.0)
    p.add_argument("--rate", type=float, default=1.2, help="arrivals per second to the busy model")
    p.add_argument("--prompt-len", type=int, default=384)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--ttft-slo-s", type=float, default=2.0)
    p.add_argument("--max-model-len", type=int, default=512, help="also sets each group's least floor")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", type=Path, required=True, help="the JSON report (report .md, plots and engine log next to it)"
    )
    args = p.parse_args(argv)
    model = (args.model or prepare_smollm2()).resolve()
    ports = bind_port("127.0.0.1"), bind_port("127.0.0.1")
    text = deployment_text(
        model, args.engine, args.budget_gib, *ports, max_model_len=args.max_model_len, ttft_slo_s=args.ttft_slo_s
    )
    arrivals = out_of_phase(args.phase_s, args.rate, args.prompt_len, args.output_len, args.seed)
    sides, outcomes, samples, _ = serve.run(text, arrivals, 2, args.out.with_suffix(".log"))
    fixed, elastic = sides["native"]["slo_attainment"], sides["crosspool"]["slo_attainment"]
    rss = donor_rss_drop(samples["crosspool"])
    moved = transfers(samples["crosspool"])
    largest = max(moved, key=lambda m: m["mib"], default=None)
    result = {
        "bench": "elastic-kv",
        "host": host.describe(),
        "argv": sys.argv[1:] if argv is None else argv,
        "deployment": text,
        "arrivals": len(arrivals),
        "summary": {
            "slo_attainment_fixed": fixed,
            "slo_attainment_elastic": elastic,
            "slo_attainment_ratio": round(elastic / fixed, 3) if fixed else None,
            "donor_rss_drop_fraction": rss["fraction"],
            "largest_transfer_mib": largest["mib"] if largest else 0.0,
            "largest_transfer_s": largest["seconds"] if largest else None,
            "ttft_p90_ms_fixed": sides["native"]["ttft_ms"]["p90"],
            "ttft_p90_ms_elastic": sides["crosspool"]["ttft_ms"]["p90"],
        },
        "slo_attainment_by_ttft_slo_s": {side: attainment_by_ttft_slo(rows) for side, rows in outcomes.items()},
        "donor_rss": rss,
        "transfers": moved,
        "demand_trace": demand_trace(samples["crosspool"]),
        "sides": sides,
        "outcomes": {side: [asdict(o) for o in rows] for side, rows in outcomes.items()},
        "samples": samples,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    serve.write_report(args.out, result, outcomes, samples)
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
