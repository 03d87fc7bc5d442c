"""`crosspool bench serve`: the load runner, against a CrossPool deployment and the native engines
in the same run.

    crosspool bench serve FILE [--rate R] [--requests N] [--trace JSONL] [--prompt-len DIST]
                          [--output-len DIST] [--seed S] [--warmup N] --out FILE

The runner starts `crosspool daemon FILE` and, per model, the native engine with the same engine
arguments on the same CPUs; where the model's attention device has kv_budget_gib, the natives
split that budget evenly (a fixed split, what elastic KV is measured against), otherwise each
gets its kv_cache_gib. Both sides get the same requests at the same offsets: Poisson arrivals
(--rate per second over all models, each request to a model drawn uniformly) or a trace (JSONL
lines {"t": s, "model": id, "prompt_len": n, "output_len": n}); lengths are `fixed:N`,
`uniform:A:B` or `lognormal:MEDIAN:SIGMA`. One side runs at a time (the other's engines
stopped, see bench/overhead.py); CrossPool first. Streaming completions give TTFT, TPOT and ITL
per request; a request meets its SLO when its TTFT and TPOT are within the model's ttft_slo_s
and tbt_slo_s. While a side runs, the runner samples each model's worker RSS and (CrossPool) the
daemon's /v1/kv. The JSON (`summary`: per side throughput and SLO attainment) goes to --out, a
Markdown report with plots (latency CDFs, KV bytes per Instance, RSS over time) next to it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from crosspool import host
from crosspool.bench.overhead import Side, alone, crosspool_daemon, native_server, wait_ready
from crosspool.bench.quantiles import quantile
from crosspool.config import Deployment, load_deployment
from crosspool.kv.backing import rss_bytes
from crosspool.qualify.serving import prompts
from crosspool.resolve import resolve

SAMPLE_S = 0.25
VOCAB = 32000  # prompts' token ids stay below this: inside every served model's vocabulary
REQUEST_TIMEOUT_S = 600.0
START_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Lengths:
    """A length distribution: fixed:N, uniform:A:B (inclusive), lognormal:MEDIAN:SIGMA."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Lengths:
        kind, *values = text.split(":")
        counts = {"fixed": 1, "uniform": 2, "lognormal": 2}
        if kind not in counts or len(values) != counts[kind]:
            raise argparse.ArgumentTypeError(f"expected fixed:N, uniform:A:B or lognormal:MEDIAN:SIGMA (got {text!r})")
        return cls(kind, *map(float, values))

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.lognormvariate(math.log(self.a), self.b)))


@dataclass(frozen=True)
class Arrival:
    t: float
    """Seconds after the load starts."""
    model: str
    prompt: list[int]
    output_len: int


def poisson(models: list[str], rate: float, count: int, prompt: Lengths, output: Lengths, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    t, arrivals = 0.0, []
    for i in range(count):
        t += rng.expovariate(rate)
        tokens = prompts(VOCAB, 1, seed=seed * 1_000_003 + i, length=prompt.sample(rng))[0]
        arrivals.append(Arrival(t, rng.choice(models), tokens, output.sample(rng)))
    return arrivals


def from_trace(path: Path, seed: int) -> list[Arrival]:
    arrivals = []
    for i, line in enumerate(path.read_text().splitlines()):
        if line.strip():
            row = json.loads(line)
            tokens = prompts(VOCAB, 1, seed=seed * 1_000_003 + i, length=int(row["prompt_len"]))[0]
            arrivals.append(Arrival(float(row["t"]), row["model"], tokens, int(row["output_len"])))
    return sorted(arrivals, key=lambda a: a.t)


@dataclass
class Outcome:
    model: str
    sent_at: float
    """Seconds after the load started."""
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0

    @property
    def tpot_s(self) -> float | None:
        return statistics.fmean(self.itl_s) if self.itl_s else None


async def _one(client: httpx.AsyncClient, url: str, a: Arrival, start: float) -> Outcome:
    await asyncio.sleep(max(0.0, start + a.t - time.perf_counter()))
    sent = time.perf_counter()
    out = Outcome(a.model, sent - start)
    body = {
        "model": a.model,
        "prompt": a.prompt,
        "max_tokens": a.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    last = sent
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = json.dumps(event)[:300]
                    return out
                now = time.perf_counter()
                if out.ttft_s is None:
                    out.ttft_s = now - sent
                else:
                    out.itl_s.append(now - last)
                last = now
                out.output_tokens += 1
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    out.ok = out.output_tokens > 0
    return out


async def send_all(url: str, arrivals: list[Arrival], progress: tqdm) -> list[Outcome]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        start = time.perf_counter()

        async def tracked(a: Arrival) -> Outcome:
            outcome = await _one(client, url, a, start)
            progress.update(1)
            return outcome

        return list(await asyncio.gather(*(tracked(a) for a in arrivals)))


class Sampler:
    """Every SAMPLE_S while a side runs: each model's worker RSS and, for CrossPool, /v1/kv."""

    def __init__(self, workers: dict[str, list[int]], control: str | None) -> None:
        self.workers, self.control = workers, control
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.start = time.perf_counter()
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.wait(SAMPLE_S):
                sample: dict = {"t": round(time.perf_counter() - self.start, 3), "rss": {}}
                for model, pids in self.workers.items():
                    with contextlib.suppress(OSError, ValueError):
                        sample["rss"][model] = sum(rss_bytes(pid) for pid in pids)
                if self.control is not None:
                    with contextlib.suppress(httpx.HTTPError):
                        sample["kv"] = client.get(self.control + "/v1/kv").json()
                self.samples.append(sample)

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        return self.samples


def _pct(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    ordered = sorted(values)
    pick = lambda q: round(quantile(ordered, q) * 1e3, 2)  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def meets(o: Outcome, ttft_slo_s: float, tbt_slo_s: float) -> bool:
    return o.ok and o.ttft_s is not None and o.ttft_s <= ttft_slo_s and (o.tpot_s or 0.0) <= tbt_slo_s


def summarize(outcomes: list[Outcome], d: Deployment, seconds: float) -> dict:
    slos = {m.id: (m.ttft_slo_s, m.tbt_slo_s) for m in d.model}

    def met(o: Outcome) -> bool:
        return meets(o, *slos[o.model])

    per_model = {
        m: {
            "requests": len(mine),
            "slo_attainment": round(sum(map(met, mine)) / len(mine), 4) if mine else None,
            "ttft_ms": _pct([o.ttft_s for o in mine if o.ttft_s is not None]),
        }
        for m in slos
        for mine in [[o for o in outcomes if o.model == m]]
    }
    return {
        "requests": len(outcomes),
        "failed": sum(not o.ok for o in outcomes),
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
        "seconds": round(seconds, 2),
        "output_tok_s": round(sum(o.output_tokens for o in outcomes) / seconds, 2),
        "slo_attainment": round(sum(map(met, outcomes)) / len(outcomes), 4) if outcomes else None,
        "ttft_ms": _pct([o.ttft_s for o in outcomes if o.ttft_s is not None]),
        "tpot_ms": _pct([t for o in outcomes if (t := o.tpot_s) is not None]),
        "itl_ms": _pct([x for o in outcomes for x in o.itl_s]),
        "per_model": per_model,
    }


def worker_pids(side: Side, control: str | None, models: list[str]) -> dict[str, list[int]]:
    """Each model's worker (rank) processes."""
    if control is not None:
        members = httpx.get(control + "/status", timeout=5).json()["members"]
        return {m: [x["pid"] for x in members if x["role"] == "rank" and x["id"] == m] for m in models}
    return {models[0]: [pid for pid, role in side.processes().items() if role in ("Worker", "scheduler")]}


def native_env(d: Deployment, model_id: str) -> tuple[dict, dict[str, str | None]]:
    """Engine-argument and environment overrides of a native engine: the model's share of its
    device's kv_budget_gib, split evenly, where the device has one."""
    model = next(m for m in d.model if m.id == model_id)
    device = next(a for a in d.attention_device if a.id == d.attention_of(model))
    if device.kv_budget_gib is None:
        return {}, {}
    sharing = [m for m in d.model if d.attention_of(m) == device.id]
    per_rank = int(device.kv_budget_gib * 2**30 / sum(m.ranks for m in sharing))
    if model.engine == "vllm":
        # An explicit byte size; the GiB variable would win over it, and vLLM parses "" as an int: unset.
        return {"kv_cache_memory_bytes": per_rank}, {"VLLM_CPU_KVCACHE_SPACE": None}
    from crosspool.integrations.sglang.launch import kv_cache_tokens

    return {"max_total_tokens": kv_cache_tokens(model, per_rank)}, {}


def run(
    file_text: str, arrivals: list[Arrival], warmup: int, log_path: Path
) -> tuple[dict, dict[str, list[Outcome]], dict[str, list[dict]], Deployment]:
    """Both sides over `arrivals`: (summary per side, outcomes per side, samples per side, deployment)."""
    from crosspool.config import parse_deployment

    d = parse_deployment(file_text, "bench")
    resolved = resolve(d, "bench")
    models = [m.id for m in d.model]
    summaries, outcomes, samples = {}, {}, {}
    with (
        log_path.open("w") as log,
        tempfile.TemporaryDirectory(prefix="crosspool-bench-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        run_dir = Path(tmp) / "crosspool"
        run_dir.mkdir()
        pooled = stack.enter_context(crosspool_daemon("crosspool", file_text, run_dir, log))
        natives = []
        for config in d.model:
            args, env = native_env(d, config.id)
            model = config.model_copy(update={"engine_args": {**config.engine_args, **args}})
            natives.append(
                stack.enter_context(
                    native_server(model, resolved.cpus.ranks[config.id], log, f"native-{config.id}", env)
                )
            )
        sides = [pooled, *natives]
        started = time.monotonic()
        wait_ready(sides, log_path, started + START_TIMEOUT_S)
        print(f"crosspool bench: all serving after {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        with alone(sides) as only:
            for name, active in (("crosspool", [pooled]), ("native", natives)):
                only(*active)
                urls = (
                    {m: pooled.url for m in models}
                    if name == "crosspool"
                    else {m: s.url for m, s in zip(models, natives, strict=True)}
                )
                for m in models:  # warm-up, not measured
                    warm = [Arrival(0.0, m, a.prompt, a.output_len) for a in arrivals if a.model == m][:warmup]
                    for a in warm:
                        asyncio.run(send_all(urls[m], [a], tqdm(disable=True)))
                workers: dict[str, list[int]] = {}
                control = pooled.metrics_url if name == "crosspool" else None
                if name == "crosspool":
                    workers = worker_pids(pooled, control, models)
                else:
                    for m, s in zip(models, natives, strict=True):
                        workers |= {m: worker_pids(s, None, [m])[m]}
                sampler = Sampler(workers, control)
                begin = time.perf_counter()
                with tqdm(total=len(arrivals), desc=name, unit="req", file=sys.stderr) as progress:
                    results = asyncio.run(_gather_sides(urls, arrivals, progress))
                seconds = time.perf_counter() - begin
                samples[name] = sampler.stop()
                outcomes[name] = results
                summaries[name] = summarize(results, d, seconds)
    return summaries, outcomes, samples, d


async def _gather_sides(urls: dict[str, str], arrivals: list[Arrival], progress: tqdm) -> list[Outcome]:
    """One load over several endpoints (a native engine per model), the offsets shared."""
    by_url: dict[str, list[Arrival]] = {}
    for a in arrivals:
        by_url.setdefault(urls[a.model], []).append(a)
    parts = await asyncio.gather(*(send_all(url, mine, progress) for url, mine in by_url.items()))
    return [o for part in parts for o in part]


def _save(plt: Any, fig: Any, path: str) -> None:
    """Grid and legend (where something is plotted) on every axis, then the PNG."""
    for ax in fig.axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(out: Path, result: dict, outcomes: dict[str, list[Outcome]], samples: dict[str, list[dict]]) -> None:
    """OUT.md with plots OUT-latency.png, OUT-kv.png, OUT-rss.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stem = out.with_suffix("")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for side, results in outcomes.items():
        for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
            values = sorted(v for o in results if (v := o.ttft_s if metric == "ttft" else o.tpot_s) is not None)
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=side)
            ax.set_xlabel(f"{metric.upper()} (s)")
            ax.set_ylabel("fraction of requests")
    _save(plt, fig, f"{stem}-latency.png")

    fig, ax = plt.subplots(figsize=(11, 4))
    for s in samples.get("crosspool", []):
        s.setdefault("kv", [])
    models = sorted({g["model"] for s in samples.get("crosspool", []) for p in s["kv"] for g in p["groups"]})
    for model in models:
        points = [
            (s["t"], sum(g["backed_bytes"] for p in s["kv"] for g in p["groups"] if g["model"] == model) / 2**20)
            for s in samples.get("crosspool", [])
            if s["kv"]
        ]
        ax.plot(*zip(*points, strict=True), label=f"{model} backed")
    ax.set_xlabel("s")
    ax.set_ylabel("KV MiB backed (CrossPool)")
    _save(plt, fig, f"{stem}-kv.png")

    fig, ax = plt.subplots(figsize=(11, 4))
    for side, taken in samples.items():
        for model in sorted({m for s in taken for m in s["rss"]}):
            ax.plot([s["t"] for s in taken], [s["rss"].get(model, 0) / 2**20 for s in taken], label=f"{side} {model}")
    ax.set_xlabel("s")
    ax.set_ylabel("worker RSS MiB")
    _save(plt, fig, f"{stem}-rss.png")

    rows: list[str] = [
        "| side | requests | failed | output tok/s | SLO attainment | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms |"
    ]
    rows.append("|---|---|---|---|---|---|---|")
    for side, s in result["sides"].items():
        t, p = s["ttft_ms"], s["tpot_ms"]
        rows.append(
            f"| {side} | {s['requests']} | {s['failed']} | {s['output_tok_s']} | {s['slo_attainment']} | "
            f"{t['p50']}/{t['p90']}/{t['p99']} | {p['p50']}/{p['p90']}/{p['p99']} |"
        )
    sweep = result.get("slo_attainment_by_ttft_slo_s")
    if sweep:  # bench elastic-kv: the attainment at other TTFT SLOs, same requests
        sides = list(sweep)
        rows += ["", "| SLO attainment at TTFT SLO (s) | " + " | ".join(sides) + " |", "|---" * (len(sides) + 1) + "|"]
        rows += [f"| {slo} | " + " | ".join(str(sweep[side][slo]) for side in sides) + " |" for slo in sweep[sides[0]]]
    name, host = stem.name, result["host"]
    text: list[str] = [
        f"# {result['bench']} {time.strftime('%Y-%m-%d')}",
        "",
        f"Host: {host['cpu']}, {host['cores']} cores, flags {' '.join(host['cpu_flags'])}.",
        "",
        "```",
        json.dumps(result["summary"], indent=1),
        "```",
        "",
        *rows,
        "",
        f"![latency CDFs]({name}-latency.png)",
        "",
        f"![KV bytes per Instance]({name}-kv.png)",
        "",
        f"![worker RSS]({name}-rss.png)",
        "",
    ]
    Path(f"{stem}.md").write_text("\n".join(text))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="crosspool bench serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("file", type=Path, help="the deployment file (its ports are used; they must be free)")
    p.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second, over all models")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--trace", type=Path, default=None, help="JSONL arrivals instead of Poisson")
    p.add_argument("--prompt-len", type=Lengths.parse, default=Lengths("uniform", 64, 512))
    p.add_argument("--output-len", type=Lengths.parse, default=Lengths("uniform", 16, 128))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2, help="requests per model before the timed load (not counted)")
    p.add_argument(
        "--out", type=Path, required=True, help="the JSON report (report .md, plots and engine log next to it)"
    )
    args = p.parse_args(argv)
    d = load_deployment(args.file)
    models = [m.id for m in d.model]
    if args.trace is not None:
        arrivals = from_trace(args.trace, args.seed)
    else:
        arrivals = poisson(models, args.rate, args.requests, args.prompt_len, args.output_len, args.seed)
    summaries, outcomes, samples, _ = run(args.file.read_text(), arrivals, args.warmup, args.out.with_suffix(".log"))
    result = {
        "bench": "serve",
        "host": host.describe(),
        "argv": sys.argv[1:] if argv is None else argv,
        "deployment": args.file.read_text(),
        "summary": {f"{side}_{k}": s[k] for side, s in summaries.items() for k in ("output_tok_s", "slo_attainment")},
        "sides": summaries,
        "outcomes": {side: [asdict(o) for o in rows] for side, rows in outcomes.items()},
        "samples": samples,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    write_report(args.out, result, outcomes, samples)
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
