"""`crosspool bench NAME ... --out FILE`: the benchmarks, each a module with `main(argv)` that
writes a JSON report with a `summary` object of its headline figures."""

from __future__ import annotations

import importlib
import sys

from crosspool.ipc import sigterm_unwinds

BENCHES = {
    "overhead": (
        "crosspool.bench.overhead",
        "native engine vs CrossPool serving throughput, per-step breakdown, round trip",
    ),
    "executor": ("crosspool.bench.executor", "one FFN layer through the pool vs the same MLP in process"),
    "serve": ("crosspool.bench.serve", "load runner: Poisson or trace arrivals, CrossPool and the native engines"),
    "elastic-kv": ("crosspool.bench.elastic_kv", "two models, out-of-phase bursts: fixed KV split vs elastic KV"),
    "cuda": ("crosspool.bench.cuda", "CUDA data plane on one GPU: round trip, executor, decode step in/out of process"),
    "kv-transfer": ("crosspool.bench.kv_transfer", "an idle donor's KV capacity moved to a burst: seconds, RSS"),
    "soak": ("crosspool.bench.soak", "a deployment under steady load for a long time: lost requests, RSS growth"),
    "faults": ("crosspool.bench.faults", "randomized faults per role under load: how every request ended, cleanup"),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHES:
        print("usage: crosspool bench {" + ",".join(BENCHES) + "} ... --out FILE\n", file=sys.stderr)
        for name, (_, what) in BENCHES.items():
            print(f"  {name:<10} {what}", file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    sigterm_unwinds()
    module, _ = BENCHES[argv[0]]
    code: int = importlib.import_module(module).main(argv[1:])
    return code
