"""CrossPool overhead vs native vLLM: generation throughput at batch 1 and 16, and the latency
of one Transport+Fabric round trip.

    python -m crosspool.bench.overhead [--model DIR] [--dtype bfloat16] [--eager] [--repeats 3]

Native and CrossPool engines run in the same invocation on the same prompts, each as vLLM runs
by default (multiprocess EngineCore, a Worker bound to its cores); the report gives medians and
the CrossPool/native ratio (this machine is shared: compare ratios, not absolutes). The round
trip is timed from a rank's side: a probe crosses Transport and Fabric and is answered by the
FfnAgent without computing; a one-row layer call is compared with the same FFN in process.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from crosspool import host
from crosspool.agents.ffn.weights import load_layers
from crosspool.config import parse_deployment
from crosspool.daemon.daemon import running_pool
from crosspool.integrations import kernels
from crosspool.integrations.offline import generate_in_child
from crosspool.models.spec import load_ffn_spec
from crosspool.plan import Plan
from crosspool.resolve import resolve
from crosspool.transport.mailbox import W_REQ_SEQ, Mailbox, RankTransport


def _deployment(model: Path, dtype: str, eager: bool, max_batched: int):
    return parse_deployment(f'''
[limits]
max_batched_tokens = {max_batched}
[[model]]
id = "bench"
path = "{model}"
engine = "vllm"
dtype = "{dtype}"
max_model_len = 512
max_num_seqs = 16
enforce_eager = {str(eager).lower()}
''')


def timed_us(fn: Callable[[], object], calls: int, warmup: int = 100) -> dict[str, float]:
    """p50 and p99 of `calls` timed calls of `fn` in microseconds, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    samples.sort()
    return {p: samples[min(len(samples) - 1, int(q * len(samples)))] for p, q in (("p50", 0.5), ("p99", 0.99))}


def round_trips(plan: Plan, calls: int) -> dict:
    """Timed from the rank's side, each in its own loop: a probe (Transport + Fabric, no FFN
    compute), a real one-row layer call, and the same layer computed in this process with the
    FfnAgent's thread count."""
    model = plan.models[0]
    rank = RankTransport(plan.rank_layout(model.id, 0))
    spec = load_ffn_spec(model.path)
    layer = load_layers(spec, model.dtype, model.activation_math, kernels(model.engine), [0])[0]
    x = torch.randn(1, model.hidden).to(getattr(torch, model.dtype))
    out = torch.empty_like(x)

    threads = torch.get_num_threads()
    torch.set_num_threads(plan.ffn_agents[0].threads)
    try:
        return {
            "calls": calls,
            "probe_round_trip_us": timed_us(rank.probe, calls),
            "layer_call_us": timed_us(lambda: rank.call(0, x, out), calls),
            "in_process_ffn_us": timed_us(lambda: layer(x), calls),
        }
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> int:
    from crosspool.models.prepare import prepare_smollm2

    p = argparse.ArgumentParser(
        prog="crosspool bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: SmolLM2-135M)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--eager", action="store_true", help="enforce_eager (default: compile mode)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--round-trips", type=int, default=2000)
    p.add_argument("--out", type=Path, default=None, help="write the JSON result here too")
    args = p.parse_args(argv)
    model = args.model or prepare_smollm2()
    d = _deployment(model, args.dtype, args.eager, 2048)
    rng = random.Random(0)
    prompt = lambda: [rng.randrange(1, 49152 if args.model is None else 500) for _ in range(args.prompt_len)]  # noqa: E731
    batches = {1: [prompt()], 16: [prompt() for _ in range(16)]}
    work = [batches[1][:1]] + [batches[b] for _ in range(args.repeats) for b in (1, 16)]  # first = warm-up

    def measure(plan_path: Path | None) -> dict[int, list[float]]:
        runs = generate_in_child(d.model[0], 2048, work, args.output_len, plan_path, in_process_engine=False)["runs"]
        runs = runs[1:]
        rates: dict[int, list[float]] = {1: [], 16: []}
        for r in runs:
            rates[len(r["tokens"])].append(r["generated"] / r["seconds"])
        return rates

    print(f"native vLLM ({args.dtype}, {'eager' if args.eager else 'compile'}) ...", file=sys.stderr, flush=True)
    native = measure(None)
    with running_pool(resolve(d, "bench")) as gen:
        print("CrossPool ...", file=sys.stderr, flush=True)
        (mailbox_plan,) = gen.plan.mailboxes_of(d.model[0].id)
        mailbox = Mailbox.open(mailbox_plan.name)
        pooled = measure(gen.plan_path)
        # Every generated token is a step through every layer: else the plugin was not active and
        # this compared native vLLM with itself.
        steps = len(work) * args.output_len  # each batch decodes output_len steps
        layers = gen.plan.model(d.model[0].id).num_layers
        if mailbox.words[W_REQ_SEQ] < steps * layers:
            raise SystemExit(
                f"crosspool bench: the pool answered {mailbox.words[W_REQ_SEQ]} layer calls, "
                f"expected at least {steps * layers}: CrossPool was not active in the engine"
            )
        print("round trips ...", file=sys.stderr, flush=True)
        rt = round_trips(gen.plan, args.round_trips)
    result = {
        "host": host.describe(),
        "model": str(model),
        "dtype": args.dtype,
        "mode": "eager" if args.eager else "compile",
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "throughput_tok_s": {
            str(b): {
                "native": native[b],
                "crosspool": pooled[b],
                "native_median": statistics.median(native[b]),
                "crosspool_median": statistics.median(pooled[b]),
                "ratio": statistics.median(pooled[b]) / statistics.median(native[b]),
            }
            for b in (1, 16)
        },
        "one_row": rt,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    for b in (1, 16):
        t = result["throughput_tok_s"][str(b)]
        print(
            f"batch {b:>2}: native {t['native_median']:.1f} tok/s, CrossPool {t['crosspool_median']:.1f} tok/s, "
            f"ratio {t['ratio']:.2f}",
            file=sys.stderr,
        )
    print(
        f"one-row Transport+Fabric round trip (probe): p50 {rt['probe_round_trip_us']['p50']:.0f} us, "
        f"p99 {rt['probe_round_trip_us']['p99']:.0f} us; one-row layer call p50 {rt['layer_call_us']['p50']:.0f} us "
        f"vs the same FFN in process p50 {rt['in_process_ffn_us']['p50']:.0f} us",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
