"""`crosspool bench soak`: a deployment under steady load for a long time, as a user runs it
(`crosspool daemon FILE`): Poisson arrivals over all its models at a fixed rate, every request
streamed and checked. Every SAMPLE_S the resident memory of each of the deployment's processes,
summed by role. Headline figures: requests lost (anything but a complete 200 stream), and per role
the RSS growth from the first sample after the warm-up to the last (a flat RSS is ~0%).

    crosspool bench soak --deployment examples/two-models.toml --minutes 30 --out soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from tqdm import tqdm

from crosspool import host
from crosspool.bench import procs
from crosspool.bench.overhead import START_TIMEOUT_S, crosspool_daemon, set_top_level, wait_ready
from crosspool.bench.serve import Lengths, poisson, send_all
from crosspool.config import parse_deployment
from crosspool.ipc import bind_port
from crosspool.kv.backing import rss_bytes

SAMPLE_S = 30.0
WARMUP_S = 120.0  # allocator pools and engine caches fill in the first minutes: growth counts after


class RssSampler:
    """Every SAMPLE_S: RSS of each process of the deployment's tree, summed per role."""

    def __init__(self, root: int) -> None:
        self.root, self.start = root, time.monotonic()
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="crosspool-soak-rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            by_role: dict[str, int] = {}
            for pid, role in procs.roles(self.root).items():
                with contextlib.suppress(OSError, ValueError):
                    by_role[role] = by_role.get(role, 0) + rss_bytes(pid)
            self.samples.append({"t": round(time.monotonic() - self.start, 1), "rss": by_role})
            if self._stop.wait(SAMPLE_S):
                return

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        return self.samples


def rss_growth(samples: list[dict], warmup_s: float) -> dict[str, dict[str, float]]:
    """Per role: MiB at the first sample from `warmup_s` on and at the last, and the growth in %."""
    after = [s for s in samples if s["t"] >= warmup_s] or samples[-1:]
    first, last = after[0]["rss"], after[-1]["rss"]
    out = {}
    for role in sorted(set(first) & set(last)):
        out[role] = {
            "first_mib": round(first[role] / 2**20, 1),
            "last_mib": round(last[role] / 2**20, 1),
            "growth_pct": round(100 * (last[role] - first[role]) / first[role], 2),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="crosspool bench soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--deployment", type=Path, required=True, help="a deployment file (its ports are replaced)")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--rate", type=float, default=1.0, help="requests per second over all models")
    p.add_argument("--prompt", type=Lengths.parse, default=Lengths.parse("uniform:16:128"))
    p.add_argument("--output", type=Lengths.parse, default=Lengths.parse("uniform:8:48"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="the JSON report (daemon log next to it)")
    args = p.parse_args(argv)
    # free ports: the soak must not collide with a running deployment
    ports = {"port": bind_port("127.0.0.1"), "control_port": bind_port("127.0.0.1")}
    text = set_top_level(args.deployment.read_text(), ports)
    models = [m.id for m in parse_deployment(text).model]
    arrivals = poisson(models, args.rate, int(args.rate * args.minutes * 60), args.prompt, args.output, args.seed)
    log_path = args.out.with_suffix(".log")
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    with (
        log_path.open("w") as log,
        tempfile.TemporaryDirectory(prefix="crosspool-soak-") as tmp,
        crosspool_daemon("crosspool", text, Path(tmp), log) as side,
    ):
        wait_ready([side], log_path, time.monotonic() + START_TIMEOUT_S)
        sampler = RssSampler(side.root)
        begin = time.perf_counter()
        with tqdm(total=len(arrivals), desc="soak", unit="req", file=sys.stderr) as progress:
            outcomes = asyncio.run(send_all(side.url, arrivals, progress))
        seconds = time.perf_counter() - begin
        samples = sampler.stop()
    lost = [o for o in outcomes if not o.ok]
    ttft = sorted(o.ttft_s for o in outcomes if o.ttft_s is not None)
    growth = rss_growth(samples, WARMUP_S)
    summary = {
        "requests": len(outcomes),
        "lost": len(lost),
        "seconds": round(seconds, 1),
        "rate_rps": args.rate,
        "ttft_p50_s": round(statistics.median(ttft), 3) if ttft else None,
        "rss_growth_pct": {role: g["growth_pct"] for role, g in growth.items()},
        # Caches that fill once per new batch shape level off: the last third says whether growth goes on.
        "rss_growth_last_third_pct": {
            role: g["growth_pct"] for role, g in rss_growth(samples, 2 * samples[-1]["t"] / 3).items()
        },
    }
    report = {
        "bench": "soak",
        "started": started_at,
        "host": host.describe(),
        "deployment": text,
        "summary": summary,
        "rss": growth,
        "lost": [{"model": o.model, "sent_at_s": round(o.sent_at, 1), "error": o.error} for o in lost[:50]],
        "samples": samples,
    }
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(summary), flush=True)
    return 0 if not lost else 1
