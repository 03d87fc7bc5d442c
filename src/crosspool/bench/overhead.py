"""`crosspool bench overhead`: what serving through CrossPool costs against the native engine.

    crosspool bench overhead [--engine vllm|sglang] [--dtype D] [--eager] [--repeats N] --out FILE

One invocation starts the native engine's OpenAI server (the engine's own defaults on this host's
CPUs) and a CrossPool deployment of the same model with the same engine arguments (`crosspool
daemon`: FFN pool, engine, front, as planned; with `--compare-shared-cpus` a second one whose
FfnAgent shares its rank's CPUs), side by side, and sends them the same greedy
requests (token-id prompts, `ignore_eos`), alternating native and CrossPool for every batch size
and repeat (native first in even repeats, CrossPool first in odd ones); a ratio is the median over
repeats of each repeat's adjacent pair. Only the measured side's engine runs: the other's
processes are stopped (SIGSTOP) until its turn, since an idle engine still polls (SGLang's
scheduler takes its whole CPU, vLLM's worker 1 s after its last step); the CrossPool deployment's
heartbeat timeout is raised so that a stopped rank does not fail it. Each CrossPool run must have
made its pool execute at least one call per layer and generated token; each native run must have
made it execute none.

Per run the report has the throughput, per process role of both sides the CPU time and run-queue
wait over the timed window (`/proc/PID/task/TID/schedstat`) and the CPUs each role may use; per
CrossPool run a per-step breakdown from the daemon's FFN counters (attention side, the rank's
time in layer calls, the FfnAgents' compute, publication-to-claim, the rest of the round trip).
Then, with the deployments stopped, a one-row Transport+Fabric probe round trip, a one-row layer
call and the same FFN in this process. `summary` holds the headline figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from crosspool import host
from crosspool.agents.ffn.weights import load_layers
from crosspool.bench import procs
from crosspool.bench.quantiles import quantile
from crosspool.config import ModelConfig, parse_deployment
from crosspool.cpus import descendants, host_cpus, running_on
from crosspool.daemon.daemon import running_pool
from crosspool.daemon.supervisor import Supervisor
from crosspool.integrations import kernels, launcher
from crosspool.ipc import EngineFiles, bind_port
from crosspool.models.spec import DTYPES, load_ffn_spec
from crosspool.plan import Plan
from crosspool.qualify.serving import prompts
from crosspool.resolve import resolve
from crosspool.transport.mailbox import RankTransport

HOST = "127.0.0.1"
SHARED = "crosspool-ffn-on-rank-cpus"
"""The variant `--compare-shared-cpus` adds: the FfnAgent on its rank's CPUs, both ends sleeping."""
MAX_BATCHED = 2048
BATCHES = (1, 16)
START_TIMEOUT_S = 900.0
STOPPED_SIDE_TIMEOUT_S = 120  # a CrossPool rank stopped while native runs (alone()) beats again after
REQUEST_TIMEOUT_S = 600.0


class BenchError(RuntimeError):
    """The benchmark could not measure what it claims (a side failed, or the pool did not work)."""


def deployment_text(
    model_path: Path,
    engine: str,
    dtype: str,
    eager: bool,
    port: int,
    control_port: int,
    ffn_cpus: list[int] | None,
    spin_us: int | None,
) -> str:
    agent = f'[[ffn_agent]]\nid = "ffn0"\ncpus = {ffn_cpus}\n' if ffn_cpus else ""
    spin = f"spin_us = {spin_us}\n" if spin_us is not None else ""
    return (
        f'''name = "bench"
port = {port}
control_port = {control_port}
[limits]
max_batched_tokens = {MAX_BATCHED}
heartbeat_timeout_s = {STOPPED_SIDE_TIMEOUT_S}
{spin}[[model]]
id = "bench"
path = "{model_path}"
engine = "{engine}"
dtype = "{dtype}"
max_model_len = 512
max_num_seqs = 16
enforce_eager = {str(eager).lower()}
'''
        + agent
    )


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
    return {p: quantile(samples, q) for p, q in (("p50", 0.5), ("p99", 0.99))}


@dataclass
class Side:
    """One served deployment under measurement: its endpoint and the root of its process tree."""

    name: str
    url: str
    root: int
    metrics_url: str | None = None
    """CrossPool's control API (/metrics), for its FFN counters."""

    def processes(self) -> dict[int, str]:
        return procs.roles(self.root)

    def engine_processes(self) -> list[int]:
        """The engine's processes (its server and everything under it)."""
        servers = [pid for pid, role in self.processes().items() if role == "API server"]
        return [pid for server in servers for pid in descendants(server)]


@contextlib.contextmanager
def native_server(
    model: ModelConfig,
    rank_cpus: list[list[int]],
    log: TextIO,
    name: str = "native",
    env: dict[str, str | None] | None = None,
) -> Iterator[Side]:
    """The engine's own OpenAI server with its own defaults on this host's CPUs; its ranks bound as
    CrossPool binds its Instance's (the same binding variables: for vLLM what its "auto" binding
    picks on one NUMA node; SGLang applies them only with its AMX kernels). `env` overrides its
    environment (None: unset)."""
    engine = launcher(model.engine)
    port = bind_port(HOST)
    sup = Supervisor("crosspool-bench-native-", EngineFiles.now())  # owns no segments; sweeps the engine's leftovers
    try:
        child = sup.start(
            name,
            engine.server_command(model, MAX_BATCHED, HOST, port),
            {k: v for k, v in {**engine.engine_env(model, None, rank_cpus), **(env or {})}.items() if v is not None},
            member=("Instance", model.id),
            stop_order=0,
            cpus=host_cpus(),
            sink=log,
        )
        yield Side(name, f"http://{HOST}:{port}", child.proc.pid)
    finally:
        sup.stop_all(30.0)


def set_top_level(text: str, values: Mapping[str, object]) -> str:
    """A deployment file's text with these top-level keys set (e.g. free ports for a benchmark)."""
    lines, kept, in_table = text.splitlines(), [], False
    for line in lines:
        in_table = in_table or line.lstrip().startswith("[")
        if in_table or line.split("=")[0].strip() not in values:
            kept.append(line)
    return "\n".join([f"{key} = {json.dumps(value)}" for key, value in values.items()] + kept) + "\n"


@contextlib.contextmanager
def crosspool_daemon(name: str, text: str, run_dir: Path, log: TextIO) -> Iterator[Side]:
    """`crosspool daemon FILE` as a user runs it."""
    d = parse_deployment(text)
    file = run_dir / "bench.toml"
    file.write_text(text)
    proc = subprocess.Popen(
        [sys.executable, "-m", "crosspool", "daemon", str(file)],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,
    )
    try:
        yield Side(name, f"http://{d.host}:{d.port}", proc.pid, f"http://{d.host}:{d.control}")
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()  # its members get SIGTERM by PR_SET_PDEATHSIG and clean up after themselves
            proc.wait()


@contextlib.contextmanager
def alone(sides: list[Side]) -> Iterator[Callable[..., None]]:
    """`only(*active)` lets those sides' engines run and stops (SIGSTOP) the others' engines: an idle
    engine is not idle (SGLang's scheduler polls at 100% of its CPU, vLLM's worker for 1 s after its
    last step). Everything runs again when the block ends."""

    def signal_engine(side: Side, sig: signal.Signals) -> None:
        for pid in side.engine_processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def only(*active: Side) -> None:
        for side in active:
            signal_engine(side, signal.SIGCONT)
        for other in sides:
            if other not in active:
                signal_engine(other, signal.SIGSTOP)

    try:
        yield only
    finally:
        for side in sides:
            signal_engine(side, signal.SIGCONT)


def wait_ready(sides: list[Side], log_path: Path, deadline: float) -> None:
    with httpx.Client(timeout=2.0) as client:
        for side in sides:
            while True:
                if not Path(f"/proc/{side.root}").exists() or procs.role_of(side.root) == "other":
                    raise BenchError(f"the {side.name} side exited during startup (log: {log_path})")
                try:
                    if client.get(side.url + "/v1/models").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise BenchError(
                        f"the {side.name} side was not ready within {START_TIMEOUT_S:g} s (log: {log_path})"
                    )
                time.sleep(0.5)


async def _generate(url: str, model: str, prompts: list[list[int]], tokens: int) -> tuple[float, int]:
    """All `prompts` at once, greedy, `tokens` each: (seconds until the last answer, tokens generated)."""
    body = {"model": model, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        start = time.perf_counter()
        answers = await asyncio.gather(
            *(client.post(url + "/v1/completions", json={**body, "prompt": p}) for p in prompts)
        )
        seconds = time.perf_counter() - start
    for a in answers:
        if a.status_code != 200:
            raise BenchError(f"{url}: HTTP {a.status_code}: {a.text[:500]}")
    return seconds, sum(a.json()["usage"]["completion_tokens"] for a in answers)


def ffn_counters(metrics_url: str) -> dict[str, float]:
    """The daemon's FFN-path totals for the bench model: rank calls and their seconds, and the
    FfnAgents' executed calls, compute seconds and publication-to-claim seconds."""
    text = httpx.get(metrics_url + "/metrics", timeout=10).text
    out = dict.fromkeys(("calls", "call_s", "executed", "execute_s", "queue_s"), 0.0)
    names = {
        "crosspool_ffn_call_seconds_count": "calls",
        "crosspool_ffn_call_seconds_sum": "call_s",
        "crosspool_ffn_executed_total": "executed",
        "crosspool_ffn_execute_seconds_total": "execute_s",
        "crosspool_ffn_queue_seconds_total": "queue_s",
    }
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names and sample.labels.get("model") == "bench":
                out[names[sample.name]] += sample.value
    return out


def _pools(sides: list[Side]) -> dict[str, dict[str, float]]:
    return {s.name: ffn_counters(s.metrics_url) for s in sides if s.metrics_url is not None}


def measure(side: Side, others: list[Side], prompts: list[list[int]], tokens: int, layers: int) -> dict:
    """One timed run on `side`; the scheduler's view of every side's processes over the window.
    Only `side`'s FFN pool (none for the native side) may execute layer calls meanwhile."""
    watched = {s.name: s.processes() for s in [side, *others]}
    before = {name: procs.snapshot(p) for name, p in watched.items()}
    pools_before = _pools([side, *others])
    seconds, generated = asyncio.run(_generate(side.url, "bench", prompts, tokens))
    after = {name: procs.snapshot(p) for name, p in watched.items()}
    pools = {name: {k: v - pools_before[name][k] for k, v in c.items()} for name, c in _pools([side, *others]).items()}
    for name, c in pools.items():
        if name != side.name and (c["executed"] or c["calls"]):
            raise BenchError(f"the FFN pool of {name} executed {c['executed']:g} calls during a run of {side.name}")
    if generated != len(prompts) * tokens:
        raise BenchError(f"{side.name}: {generated} tokens generated, {len(prompts) * tokens} asked")
    run: dict = {
        "side": side.name,
        "batch": len(prompts),
        "seconds": round(seconds, 4),
        "tok_s": round(generated / seconds, 3),
        "processes": {name: procs.by_role(p, before[name], after[name]) for name, p in watched.items()},
    }
    if side.metrics_url is None:  # native
        return run
    counters = pools[side.name]
    # Every step of the batch is a forward pass through every layer.
    if counters["executed"] < tokens * layers or counters["calls"] < tokens * layers:
        raise BenchError(
            f"the FFN pool executed {counters['executed']:g} layer calls ({counters['calls']:g} made by the "
            f"ranks) for {tokens} steps of {layers} layers: CrossPool was not active in the engine"
        )
    steps = counters["calls"] / layers
    per_step = {k: counters[k] / steps * 1e3 for k in ("call_s", "execute_s", "queue_s")}
    run["steps"] = round(steps, 1)
    run["per_step_ms"] = {
        "step": round(seconds / steps * 1e3, 3),
        "attention_side": round((seconds - counters["call_s"]) / steps * 1e3, 3),
        "ffn_calls": round(per_step["call_s"], 3),
        "ffn_execute": round(per_step["execute_s"], 3),
        "publish_to_claim": round(per_step["queue_s"], 3),
        "transport_rest": round(per_step["call_s"] - per_step["execute_s"] - per_step["queue_s"], 3),
    }
    return run


def round_trips(plan: Plan, calls: int) -> dict:
    """Timed from the rank's side, on the rank's CPUs, each in its own loop: a probe (Transport +
    Fabric, no FFN compute), a real one-row layer call, and the same layer computed in this process
    with the FfnAgent's thread count."""
    model = plan.models[0]
    rank = RankTransport(plan.rank_layout(model.id, 0))
    spec = load_ffn_spec(model.path)
    layer = load_layers(spec, model.dtype, model.activation_math, kernels(model.engine), [0])[0]
    x = torch.randn(1, model.hidden).to(DTYPES[model.dtype])
    out = torch.empty_like(x)
    threads = torch.get_num_threads()
    torch.set_num_threads(plan.ffn_agents[0].threads)
    with running_on(model.rank_cpus[0]):
        try:
            return {
                "calls": calls,
                "probe_round_trip_us": timed_us(rank.probe, calls),
                "layer_call_us": timed_us(lambda: rank.call(0, x, out), calls),
                "in_process_ffn_us": timed_us(lambda: layer(x), calls),
            }
        finally:
            torch.set_num_threads(threads)


def _ratios(runs: list[dict], batch: int, side: str) -> dict:
    """The `side`/native ratio at `batch`: the median over repeats of each repeat's pair of runs
    (adjacent: this host's speed drifts over tens of seconds, more than within a pair), and the
    ratio of the sides' medians beside it."""
    rates = {s: [r["tok_s"] for r in runs if r["batch"] == batch and r["side"] == s] for s in ("native", side)}
    pairs = [c / n for n, c in zip(rates["native"], rates[side], strict=True)]
    native, pooled = statistics.median(rates["native"]), statistics.median(rates[side])
    steps = [r["per_step_ms"] for r in runs if r["batch"] == batch and r["side"] == side]
    breakdown = {k: round(statistics.median(s[k] for s in steps), 3) for k in steps[0]}
    return {
        "native_tok_s": rates["native"],
        "crosspool_tok_s": rates[side],
        "pair_ratios": [round(r, 4) for r in pairs],
        "ratio": round(statistics.median(pairs), 4),
        "native_median": native,
        "crosspool_median": pooled,
        "ratio_of_medians": round(pooled / native, 4),
        "crosspool_per_step_ms_median": breakdown,
    }


def main(argv: list[str] | None = None) -> int:
    from crosspool.models.prepare import prepare_smollm2

    p = argparse.ArgumentParser(
        prog="crosspool bench overhead", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--engine", choices=["vllm", "sglang"], default="vllm")
    p.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: SmolLM2-135M)")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument(
        "--eager", action="store_true", help="vLLM enforce_eager (default: compile mode; SGLang: always eager)"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--idle-s", type=float, default=1.5, help="pause after switching sides, before a run")
    p.add_argument("--ffn-cpus", type=int, nargs="+", default=None, help="the FfnAgent's CPUs (default: planned)")
    p.add_argument(
        "--spin-us", type=int, default=None, help="limits.spin_us of the CrossPool deployment (default: its default)"
    )
    p.add_argument(
        "--compare-shared-cpus",
        action="store_true",
        help="also a CrossPool deployment with the FfnAgent on its rank's CPUs (both ends sleeping), in the same run",
    )
    p.add_argument("--round-trips", type=int, default=2000)
    p.add_argument("--out", type=Path, required=True, help="the JSON report (engine logs next to it, .log)")
    args = p.parse_args(argv)
    model_path = (args.model or prepare_smollm2()).resolve()
    eager = args.eager or args.engine == "sglang"
    ports = bind_port(HOST), bind_port(HOST)
    text = deployment_text(model_path, args.engine, args.dtype, eager, *ports, args.ffn_cpus, args.spin_us)
    resolved = resolve(parse_deployment(text, "bench"), "bench")
    (model,) = resolved.deployment.model
    layers = len(resolved.specs[model.id].layers)
    vocab = json.loads((model_path / "config.json").read_text())["vocab_size"]
    work = prompts(vocab, max(BATCHES), length=args.prompt_len)
    log_path = args.out.with_suffix(".log")
    say = lambda message: print(f"crosspool bench: {message}", file=sys.stderr, flush=True)  # noqa: E731
    runs: list[dict] = []
    rank_cpus = resolved.cpus.ranks[model.id]
    variants = {"crosspool": text}
    if args.compare_shared_cpus:
        shared = deployment_text(
            model_path, args.engine, args.dtype, eager, bind_port(HOST), bind_port(HOST), rank_cpus[0], args.spin_us
        )
        variants[SHARED] = shared
    with (
        log_path.open("w") as log,
        tempfile.TemporaryDirectory(prefix="crosspool-bench-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        mode = "eager" if eager else "compile"
        say(f"starting native {args.engine} and {', '.join(variants)} ({args.dtype}, {mode}); log: {log_path}")
        native = stack.enter_context(native_server(model, rank_cpus, log))
        sides = [native]
        for name, variant in variants.items():
            run_dir = Path(tmp) / name
            run_dir.mkdir()
            sides.append(stack.enter_context(crosspool_daemon(name, variant, run_dir, log)))
        start = time.monotonic()
        wait_ready(sides, log_path, start + START_TIMEOUT_S)
        say(f"all serving after {time.monotonic() - start:.0f} s")
        with alone(sides) as only:
            for side in sides:  # warm-up: first steps, and in compile mode shapes seen the first time
                only(side)
                for batch in BATCHES:
                    asyncio.run(_generate(side.url, "bench", work[:batch], args.output_len))
            for repeat in range(args.repeats):
                for batch in BATCHES:
                    # A B, then B A: a drift of the host's speed weighs on both sides alike.
                    for side in sides if repeat % 2 == 0 else sides[::-1]:
                        only(side)
                        time.sleep(args.idle_s)
                        others = [s for s in sides if s is not side]
                        run = measure(side, others, work[:batch], args.output_len, layers)
                        runs.append(run)
                        say(
                            f"repeat {repeat + 1}/{args.repeats} batch {batch:>2} {side.name:>9}: "
                            f"{run['tok_s']:.1f} tok/s"
                        )
        placement = {s.name: {role: procs.affinity(pid) for pid, role in s.processes().items()} for s in sides}
    say("round trips ...")
    with running_pool(resolved) as gen:
        rt = round_trips(gen.plan, args.round_trips)
    by_batch = {str(b): _ratios(runs, b, "crosspool") for b in BATCHES}
    compared = {name: {str(b): _ratios(runs, b, name) for b in BATCHES} for name in variants if name != "crosspool"}
    result = {
        "host": host.describe(),
        "argv": sys.argv[1:] if argv is None else argv,
        "engine": args.engine,
        "model": str(model_path),
        "dtype": args.dtype,
        "mode": "eager" if eager else "compile",
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "idle_s": args.idle_s,
        "spin_us": {"ranks": resolved.cpus.rank_spin_us[model.id], "ffn_agent": resolved.cpus.ffn_spin_us["ffn0"]},
        "summary": {
            "ratio_batch1": by_batch["1"]["ratio"],
            "ratio_batch16": by_batch["16"]["ratio"],
            "round_trip_p50_us": round(rt["probe_round_trip_us"]["p50"], 1),
            "round_trip_p99_us": round(rt["probe_round_trip_us"]["p99"], 1),
            "layer_call_p50_us": round(rt["layer_call_us"]["p50"], 1),
            "in_process_ffn_p50_us": round(rt["in_process_ffn_us"]["p50"], 1),
            **{f"{name}_ratio_batch{b}": ratios[str(b)]["ratio"] for name, ratios in compared.items() for b in BATCHES},
        },
        "throughput": by_batch,
        "compared": compared,
        "placement": placement,
        "one_row": rt,
        "runs": runs,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    for b in BATCHES:
        t = by_batch[str(b)]
        say(
            f"batch {b:>2}: native {t['native_median']:.1f} tok/s, CrossPool {t['crosspool_median']:.1f} tok/s, "
            f"ratio {t['ratio']:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
