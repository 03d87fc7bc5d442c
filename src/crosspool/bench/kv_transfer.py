"""`crosspool bench kv-transfer`: how long an idle donor takes to give KV capacity to a busy
Instance, and how much of it its RSS gives back.

    crosspool bench kv-transfer [--engine vllm|sglang] [--budget-gib G] [--repeats N] --out FILE

Models a and b (SmolLM2-135M, one engine) share `--budget-gib`; a burst wants more than the
budget, so the bursting model takes all of it but the other's floor and the other can only grow
from it. Bursts go to a, b, a, ... in turn (`--repeats` + 1 bursts of max_num_seqs long prompts,
one token out each; a burst starts once the one before it finished, so the donor is idle): every
burst after the first makes the daemon move the idle model's capacity down to its floor, less
what unassigned bytes cover. A transfer's time is the daemon's record: from the lower target to
the donor's report of its release (prefix-cache eviction and madvise included). `summary`: the
largest transfer (MiB, seconds), the median and slowest seconds, whether every transfer reached
its target, and the donor RSS given back over the bytes its backing dropped. A donor may give
in more than one transfer when the burst's demand reaches the daemon over more than one tick;
each is reported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from crosspool import host
from crosspool.bench.elastic_kv import deployment_text
from crosspool.bench.overhead import crosspool_daemon, wait_ready
from crosspool.bench.serve import START_TIMEOUT_S, VOCAB, worker_pids
from crosspool.ipc import bind_port
from crosspool.kv.backing import rss_bytes
from crosspool.qualify.serving import prompts

MIB = 2**20
MAX_NUM_SEQS = 32
PROMPT_LEN = 1000  # a burst's KV: 32 x 1001 tokens of SmolLM2 in bf16, 704 MiB
SETTLE_TIMEOUT_S = 60.0


def _burst(url: str, model: str, seed: int) -> None:
    def one(prompt: list[int]) -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=600)
        r.raise_for_status()

    with ThreadPoolExecutor(MAX_NUM_SEQS) as pool:
        list(pool.map(one, prompts(VOCAB, MAX_NUM_SEQS, seed=seed, length=PROMPT_LEN)))


def _pool(control: str) -> dict:
    (pool,) = httpx.get(control + "/v1/kv", timeout=5).json()
    return pool


def _settled(control: str) -> dict:
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while (pool := _pool(control))["transfers_in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return pool


def main(argv: list[str] | None = None) -> int:
    from crosspool.models.prepare import prepare_smollm2

    p = argparse.ArgumentParser(
        prog="crosspool bench kv-transfer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: SmolLM2-135M)")
    p.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    p.add_argument("--budget-gib", type=float, default=0.375)
    p.add_argument("--repeats", type=int, default=4, help="transfers to measure")
    p.add_argument("--out", type=Path, required=True, help="the JSON report (engine log next to it)")
    args = p.parse_args(argv)
    model = (args.model or prepare_smollm2()).resolve()
    ports = bind_port("127.0.0.1"), bind_port("127.0.0.1")
    text = deployment_text(
        model, args.engine, args.budget_gib, *ports, name="kv-transfer", max_model_len=1024, max_num_seqs=MAX_NUM_SEQS
    )
    log_path = args.out.with_suffix(".log")
    rows: list[dict[str, Any]] = []
    with (
        log_path.open("w") as log,
        tempfile.TemporaryDirectory(prefix="crosspool-bench-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        side = stack.enter_context(crosspool_daemon("crosspool", text, Path(tmp), log))
        wait_ready([side], log_path, time.monotonic() + START_TIMEOUT_S)
        assert side.metrics_url is not None
        control = side.metrics_url
        workers = worker_pids(side, control, ["a", "b"])
        for i in range(args.repeats + 1):
            borrower, donor = ("a", "b") if i % 2 == 0 else ("b", "a")
            before = _settled(control)
            rss = sum(rss_bytes(pid) for pid in workers[donor])
            _burst(side.url, borrower, seed=i)
            after = _settled(control)
            moved = [t for t in after["recent_transfers"] if t not in before["recent_transfers"]]
            backed = {g["model"]: g["backed_bytes"] for g in after["groups"]}
            print(f"burst {i} on {borrower}: backed {backed}, transfers {moved}", file=sys.stderr, flush=True)
            if i == 0:
                continue  # the first burst grows from unassigned bytes
            gave = [t for t in moved if t["model"] == donor]
            assert gave, f"burst {i}: {donor} gave nothing to {borrower}"
            dropped = rss - sum(rss_bytes(pid) for pid in workers[donor])
            rows.append({"burst": i, "donor": donor, "rss_dropped_bytes": dropped, "transfers": gave})
    largest = max((t for r in rows for t in r["transfers"]), key=lambda t: t["bytes"])
    per_burst = [sum(t["bytes"] for t in r["transfers"]) for r in rows]
    result = {
        "bench": "kv-transfer",
        "host": host.describe(),
        "argv": sys.argv[1:] if argv is None else argv,
        "deployment": text,
        "summary": {
            "bursts_measured": len(rows),
            "transfers_per_burst_max": max(len(r["transfers"]) for r in rows),
            "largest_transfer_mib": round(largest["bytes"] / MIB, 1),
            "largest_transfer_s": largest["seconds"],
            "transfer_s_median": statistics.median(t["seconds"] for r in rows for t in r["transfers"]),
            "transfer_s_max": max(t["seconds"] for r in rows for t in r["transfers"]),
            "all_complete": all(t["complete"] for r in rows for t in r["transfers"]),
            "donor_rss_drop_fraction": round(sum(r["rss_dropped_bytes"] for r in rows) / sum(per_burst), 3),
        },
        "bursts": rows,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
