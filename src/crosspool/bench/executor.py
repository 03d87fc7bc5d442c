"""FFN executor throughput: one layer through a real FFN pool (FFN TP 1 and 2) vs the same MLP in
plain torch in this process.

    crosspool bench executor [--model DIR] [--dtype bfloat16] [--threads 1] [--repeats 3] --out FILE

Each FfnAgent computes with `--threads` torch threads on a CPU of its own (agent i on the i-th CPU
this process may use), this process calls as the rank on the first; the in-process baseline runs
with the same total thread count as the pool row it is compared with (TP k: k x threads), on the
same CPUs and the same seeded input. Two baselines: plain `F.linear` (the target's), and the engine's own linear
kernels in this process (what the pool computes with, so that ratio is the executor's cost
alone: transport, sharding, the fp32 reduction). Pool and baselines alternate within each
repeat; the report gives median rows/s and the ratios per (rows, TP).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from crosspool import host
from crosspool.agents.ffn.weights import load_layers
from crosspool.bench.overhead import timed_us
from crosspool.config import parse_deployment
from crosspool.cpus import host_cpus, running_on
from crosspool.daemon.daemon import running_pool
from crosspool.integrations import kernels
from crosspool.kernels import Linear, MoeKernel, plain_linear
from crosspool.models.spec import DTYPES, load_ffn_spec
from crosspool.resolve import resolve
from crosspool.transport.mailbox import RankTransport

ROWS = (1, 16, 256, 2048)
TP_DEGREES = (1, 2)
CALLS = {1: 300, 16: 150, 256: 20, 2048: 4}


def _deployment(model: Path, dtype: str, threads: int, cpus: list[int]) -> str:
    """Agent i on `cpus[i]`, both models' ranks (this process) on `cpus[0]`: at TP 1 the rank and
    its agent share a CPU, as a deployment places them."""
    text = f"[limits]\nmax_batched_tokens = {max(ROWS)}\n"
    text += "".join(
        f'[[ffn_agent]]\nid = "ffn{i}"\nthreads = {threads}\ncpus = [{cpus[i]}]\n' for i in range(max(TP_DEGREES))
    )
    for k in TP_DEGREES:
        text += f'[[model]]\nid = "tp{k}"\npath = "{model}"\nengine = "vllm"\ndtype = "{dtype}"\nffn_tp = {k}\n'
        text += f"rank_cpus = [[{cpus[0]}]]\n"
    return text


class PlainTorch:
    """The same MLP in plain torch: `F.linear` GEMMs (dense layers only)."""

    def linear(self, weight: torch.Tensor, /) -> Linear:
        return plain_linear(weight)

    def moe(self, *args: object) -> MoeKernel:
        raise NotImplementedError("the executor benchmark times dense layers")


def main(argv: list[str] | None = None) -> int:
    from crosspool.models.prepare import prepare_smollm2

    p = argparse.ArgumentParser(
        prog="crosspool bench executor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: SmolLM2-135M)")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per FfnAgent")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, required=True, help="the JSON report")
    args = p.parse_args(argv)
    model = args.model or prepare_smollm2()
    spec = load_ffn_spec(model)
    cpus = host_cpus()
    if len(cpus) < max(TP_DEGREES):
        p.error(f"needs {max(TP_DEGREES)} CPUs, this process may use {cpus}")
    resolved = resolve(parse_deployment(_deployment(model, args.dtype, args.threads, cpus), "bench"), "bench")
    # The in-process MLPs: plain F.linear, and the plan's engine kernels; both with the activation
    # as the pool computes it for this plan.
    pooled = resolved.plan().models[0]
    baselines = {
        name: load_layers(spec, args.dtype, pooled.activation_math, linears, [args.layer])[args.layer]
        for name, linears in (("plain", PlainTorch()), ("engine", kernels(pooled.engine)))
    }
    samples: dict[tuple[int, int], dict[str, list[float]]] = {
        (rows, k): {"pool": [], "plain": [], "engine": []} for rows in ROWS for k in TP_DEGREES
    }
    threads = torch.get_num_threads()
    with running_pool(resolved) as gen:
        ranks = {k: RankTransport(gen.plan.rank_layout(f"tp{k}", 0)) for k in TP_DEGREES}
        for repeat in range(args.repeats):
            print(f"repeat {repeat + 1}/{args.repeats} ...", file=sys.stderr, flush=True)
            for rows in ROWS:
                x = torch.randn(rows, spec.hidden, generator=torch.Generator().manual_seed(rows)).to(DTYPES[args.dtype])
                out = torch.empty_like(x)
                for k, rank in ranks.items():
                    calls, case = CALLS[rows], samples[rows, k]
                    with running_on(cpus[:1]):
                        case["pool"].append(
                            timed_us(lambda: rank.call(args.layer, x, out), calls, warmup=2)["p50"]  # noqa: B023
                        )
                    torch.set_num_threads(k * args.threads)
                    try:
                        with running_on(cpus[:k]):  # the same CPUs as the pool's agents
                            for name, ffn in baselines.items():
                                case[name].append(timed_us(lambda: ffn(x), calls, warmup=2)["p50"])  # noqa: B023
                    finally:
                        torch.set_num_threads(threads)
    cases = []
    for (rows, k), case in samples.items():
        pool_us, plain_us, engine_us = (statistics.median(case[name]) for name in ("pool", "plain", "engine"))
        cases.append(
            {
                "rows": rows,
                "ffn_tp": k,
                "threads_total": k * args.threads,
                "pool_us": case["pool"],
                "plain_us": case["plain"],
                "engine_us": case["engine"],
                "pool_rows_per_s": rows / pool_us * 1e6,
                "plain_rows_per_s": rows / plain_us * 1e6,
                "engine_rows_per_s": rows / engine_us * 1e6,
                "ratio": plain_us / pool_us,
                "ratio_vs_engine_kernels": engine_us / pool_us,
            }
        )
    tp1 = [c for c in cases if c["ffn_tp"] == 1]
    result = {
        "host": host.describe(),
        "argv": sys.argv[1:] if argv is None else argv,
        "summary": {f"ratio_vs_engine_kernels_rows{c['rows']}": round(c["ratio_vs_engine_kernels"], 3) for c in tp1}
        | {f"ratio_vs_plain_rows{c['rows']}": round(c["ratio"], 3) for c in tp1},
        "model": str(model),
        "layer": args.layer,
        "dtype": args.dtype,
        "threads_per_agent": args.threads,
        "repeats": args.repeats,
        "cases": cases,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=1))
    for c in cases:
        print(
            f"rows {c['rows']:>4} TP {c['ffn_tp']}: pool {c['pool_rows_per_s']:>9.0f} rows/s, "
            f"plain torch ({c['threads_total']} threads) {c['plain_rows_per_s']:>9.0f} rows/s, ratio {c['ratio']:.2f}; "
            f"engine kernels in-process {c['engine_rows_per_s']:>9.0f} rows/s, "
            f"ratio {c['ratio_vs_engine_kernels']:.2f}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
