"""`crosspool bench faults`: a fault campaign against a deployment as a user runs it
(`crosspool daemon FILE`, restart = true) under steady load on all its models.

Each fault hits one process of a role: an Instance's API server, EngineCore or Worker (vLLM; for
SGLang its server or scheduler), an FfnAgent, the AtnAgent or the front; with SIGKILL, with
SIGSTOP for longer than the deployment's bounds (then SIGCONT), or with SIGSTOP for shorter. The
campaign waits until every model serves again, then judges the fault:
* every request in flight ends within END_BOUND_S of the failure's detection (of the SIGCONT for a
  short stop): none hangs;
* each one ends with 200 or with 503 naming the failed member (a failed front: the connection;
  an AtnAgent's failure restarts the generation, whose endpoint refuses requests sent meanwhile);
* the models the failed member does not serve answer every request with 200;
* a short stop fails nothing; afterwards every model answers.
After the last fault the daemon stops (SIGTERM): nothing of it may be left in /dev/shm or as a
process.

    crosspool bench faults --deployment examples/two-models.toml --per-kind 2 --out faults.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx

from crosspool import host
from crosspool.bench import procs
from crosspool.bench.overhead import START_TIMEOUT_S, Side, crosspool_daemon, set_top_level, wait_ready
from crosspool.config import Deployment, parse_deployment
from crosspool.ipc import SHM_DIR, bind_port

END_BOUND_S = 10.0
RECOVER_S = 420.0
KINDS = ("SIGKILL", "SIGSTOP-long", "SIGSTOP-short")
ENGINE_ROLES = {"vllm": ("API server", "EngineCore", "Worker"), "sglang": ("API server", "scheduler")}
CAMPAIGN_POLICY = {"restart": True, "max_restarts": 100, "restart_window_s": 30, "restart_backoff_s": 1}
"""The campaign restarts on every fault, one after another: its own restart policy."""


@dataclass
class Request:
    model: str
    start: float
    end: float | None = None
    status: int | None = None
    """HTTP status; 0: the connection failed."""
    text: str = ""


class Load:
    """One request after another per model and kind (plain, streamed), each recorded."""

    def __init__(self, url: str, models: list[str]) -> None:
        self.url, self.stop = url, threading.Event()
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._run, args=(m, stream), daemon=True)
            for m in models
            for stream in (False, True)
        ]
        for t in self.threads:
            t.start()

    def _run(self, model: str, stream: bool) -> None:
        body = {"model": model, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
        with httpx.Client(timeout=httpx.Timeout(120.0, connect=5.0)) as client:
            while not self.stop.is_set():
                r = Request(model, time.monotonic())
                with self._lock:
                    self.requests.append(r)
                try:
                    if stream:
                        with client.stream("POST", self.url + "/v1/completions", json={**body, "stream": True}) as s:
                            lines = list(s.iter_lines())
                            errors = [line for line in lines if line.startswith('data: {"error"')]
                            status, text = (503, errors[0]) if errors else (s.status_code, "".join(lines))
                    else:
                        resp = client.post(self.url + "/v1/completions", json=body)
                        status, text = resp.status_code, resp.text
                except httpx.HTTPError as e:
                    status, text = 0, f"{type(e).__name__}: {e}"
                r.status, r.text, r.end = status, text[:400], time.monotonic()
                if status != 200:
                    time.sleep(0.2)  # a refused model is asked again, not hammered

    def between(self, start: float, end: float) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.start < end and (r.end is None or r.end > start)]

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=130)


@dataclass
class Fault:
    role: str
    kind: str
    model: str | None
    """The Instance hit (engine roles)."""
    member: str
    """The failed member as the daemon names it."""
    pid: int
    stop_s: float = 0.0
    at: float = 0.0
    detected_s: float | None = None
    """Seconds from the fault to the daemon's naming of a failure."""
    detected: str | None = None
    recovered_s: float | None = None
    affected: list[str] = field(default_factory=list)
    requests: dict[str, int] = field(default_factory=dict)
    """In the fault's window: outcome -> count."""
    slowest_end_s: float = 0.0
    """The longest a request stayed open after the detection (after SIGCONT for a short stop)."""
    problems: list[str] = field(default_factory=list)
    unaffected_errors: int = 0
    """Requests of models the failed member does not serve that did not answer 200."""


def _status(control: str) -> dict | None:
    try:
        return httpx.get(control + "/status", timeout=2).json()  # type: ignore[no-any-return]
    except (httpx.HTTPError, ValueError):
        return None


def _serving(control: str) -> bool:
    s = _status(control)
    return s is not None and s["phase"] == "ready" and all(m["state"] == "serving" for m in s["models"].values())


def _failure(status: dict | None, generation: int) -> str | None:
    if status is None:
        return None
    if status["failure"] is not None or status["generation"] != generation:
        return str(status["failure"] or f"generation {status['generation']}")
    named = [m["failure"] for m in status["models"].values() if m["failure"] is not None]
    return named[0] if named else None


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _target(d: Deployment, status: dict, role: str, rng: random.Random) -> tuple[int, str, str | None, list[str]]:
    """(pid, member name, model, models taken down) of a random process of `role`."""
    members = {m["name"]: m["pid"] for m in status["members"]}
    all_models = [m.id for m in d.model]
    if role in ("FfnAgent", "AtnAgent"):
        name = rng.choice(sorted(n for n in members if n.startswith(role)))
        if role == "AtnAgent":
            return members[name], name, None, all_models
        agent = name.split("'")[1]
        return members[name], name, None, [m for m, s in status["models"].items() if agent in s["ffn_agents"]]
    if role == "front":
        return members["front endpoint"], "front endpoint", None, all_models
    model = rng.choice([m.id for m in d.model if role in ENGINE_ROLES[m.engine]])
    pid = members[f"Instance '{model}' rank 0"]  # the Worker (vLLM) or scheduler (SGLang)
    while procs.role_of(pid) != role:
        pid = _parent(pid)
    return pid, f"Instance '{model}'", model, [model]


def plan_faults(d: Deployment, per_kind: int, rng: random.Random) -> list[tuple[str, str]]:
    roles = [*sorted({r for m in d.model for r in ENGINE_ROLES[m.engine]}), "FfnAgent", "AtnAgent", "front"]
    faults = [(role, kind) for role in roles for kind in KINDS for _ in range(per_kind)]
    rng.shuffle(faults)
    return faults


def stop_bounds(d: Deployment) -> tuple[float, float]:
    """A short stop stays under every bound; a long one outlasts all of them."""
    limits = d.limits
    short = min(limits.heartbeat_timeout_s, limits.engine_health_timeout_s, limits.ffn_timeout_s) / 2
    long = max(limits.heartbeat_timeout_s, limits.engine_health_timeout_s, limits.ffn_timeout_s)
    return short, long


def run_fault(d: Deployment, side: Side, load: Load, fault: Fault) -> None:
    control = side.metrics_url
    assert control is not None
    generation = _status(control)["generation"]  # type: ignore[index]
    fault.at = time.monotonic()
    os.kill(fault.pid, signal.SIGKILL if fault.kind == "SIGKILL" else signal.SIGSTOP)
    resumed = fault.at
    end = fault.at + RECOVER_S
    while time.monotonic() < end:
        now = time.monotonic()
        if fault.kind != "SIGKILL" and resumed == fault.at and now - fault.at >= fault.stop_s:
            with contextlib.suppress(ProcessLookupError):  # a restart may have killed it
                os.kill(fault.pid, signal.SIGCONT)
            resumed = time.monotonic()
        status = _status(control)
        if fault.detected is None and (named := _failure(status, generation)) is not None:
            fault.detected_s, fault.detected = round(time.monotonic() - fault.at, 2), named
        settled = fault.detected is not None or fault.kind == "SIGSTOP-short"
        if settled and (fault.kind == "SIGKILL" or resumed > fault.at) and _serving(control):
            time.sleep(2 * d.limits.heartbeat_interval_s)  # the front learns it from its next heartbeat
            break
        time.sleep(0.1)
    else:
        fault.problems.append(f"the deployment did not serve again within {RECOVER_S:g} s")
    if fault.kind == "SIGSTOP-short":
        time.sleep(END_BOUND_S)  # requests held by the stop finish
    recovered = time.monotonic()
    fault.recovered_s = round(recovered - fault.at, 1)
    judge(fault, load.between(fault.at, recovered), resumed)
    for model in [m.id for m in d.model]:
        r = httpx.post(side.url + "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2}, timeout=60)
        if r.status_code != 200:
            fault.problems.append(f"after recovery {model} answered {r.status_code}: {r.text[:200]}")


def judge(fault: Fault, requests: list[Request], resumed: float) -> None:
    short = fault.kind == "SIGSTOP-short"
    if short and fault.detected is not None:
        fault.problems.append(f"a stop shorter than the bounds failed something: {fault.detected}")
    if not short and fault.detected is None:
        fault.problems.append("the failure was never named")
    reference = resumed if short else fault.at + (fault.detected_s or 0.0)
    for r in requests:
        open_for = (r.end if r.end is not None else time.monotonic()) - max(r.start, reference)
        fault.slowest_end_s = round(max(fault.slowest_end_s, open_for), 2)
        if open_for > END_BOUND_S:
            fault.problems.append(f"a {r.model} request was open {open_for:.1f} s after the failure was named")
        outcome = "open" if r.status is None else str(r.status)
        fault.requests[outcome] = fault.requests.get(outcome, 0) + 1
        if r.status == 200 or r.status is None:
            continue
        if r.model not in fault.affected:
            fault.unaffected_errors += 1
            fault.problems.append(f"{r.model} does not depend on {fault.member}, yet answered {r.status}: {r.text}")
        elif r.status == 0:
            # The front is the connection; between generations (an AtnAgent's failure) the endpoint
            # is down, as documented: a request sent then is refused.
            if not (fault.role == "front" or (fault.role == "AtnAgent" and r.start >= reference)):
                fault.problems.append(f"a {r.model} request lost its connection: {r.text}")
        elif r.status != 503 or fault.member not in r.text:
            fault.problems.append(f"a {r.model} request ended {r.status} without naming {fault.member}: {r.text}")


def shm_files() -> set[str]:
    return {p.name for p in SHM_DIR.iterdir()}


def table(faults: list[Fault]) -> str:
    lines = [
        "| # | role | signal | member | detected (s) | back (s) | requests | slowest end (s) | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, f in enumerate(faults, 1):
        kind = f.kind if f.kind == "SIGKILL" else f"{f.kind} {f.stop_s:.1f} s"
        counts = ", ".join(f"{n}x{code}" for code, n in sorted(f.requests.items()))
        verdict = "ok" if not f.problems else "FAIL: " + "; ".join(f.problems)[:300]
        detected = "-" if f.detected_s is None else f"{f.detected_s:.1f}"
        lines.append(
            f"| {i} | {f.role} | {kind} | {f.member} | {detected} | {f.recovered_s} | {counts} | "
            f"{f.slowest_end_s:.1f} | {verdict} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="crosspool bench faults", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--deployment", type=Path, required=True, help="a deployment file (ports, restart policy replaced)")
    p.add_argument("--per-kind", type=int, default=1, help="faults per role and signal")
    p.add_argument("--roles", nargs="*", help="only these roles (default: every role of the deployment)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="the JSON report (daemon log next to it)")
    args = p.parse_args(argv)
    ports = {"port": bind_port("127.0.0.1"), "control_port": bind_port("127.0.0.1")}
    text = set_top_level(args.deployment.read_text(), {**ports, **CAMPAIGN_POLICY})
    d = parse_deployment(text)
    rng = random.Random(args.seed)
    plan = [f for f in plan_faults(d, args.per_kind, rng) if not args.roles or f[0] in args.roles]
    short_s, long_s = stop_bounds(d)
    log_path = args.out.with_suffix(".log")
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    shm_before, pids_before = shm_files(), project_pids()
    faults: list[Fault] = []
    with (
        log_path.open("w") as log,
        tempfile.TemporaryDirectory(prefix="crosspool-faults-") as tmp,
        crosspool_daemon("crosspool", text, Path(tmp), log) as side,
    ):
        wait_ready([side], log_path, time.monotonic() + START_TIMEOUT_S)
        assert side.metrics_url is not None
        while not _serving(side.metrics_url):
            time.sleep(0.5)
        load = Load(side.url, [m.id for m in d.model])
        try:
            for role, kind in plan:
                time.sleep(3)  # steady load before the fault
                pid, member, model, affected = _target(d, _status(side.metrics_url) or {}, role, rng)
                stop_s = {"SIGKILL": 0.0, "SIGSTOP-short": rng.uniform(0.5, short_s)}.get(
                    kind, long_s + rng.uniform(2.0, 5.0)
                )
                fault = Fault(role, kind, model, member, pid, round(stop_s, 1), affected=affected)
                print(f"fault {len(faults) + 1}/{len(plan)}: {kind} {role} of {member} (pid {pid})", flush=True)
                run_fault(d, side, load, fault)
                faults.append(fault)
                print(f"  -> {'ok' if not fault.problems else fault.problems}", flush=True)
        finally:
            load.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (shm_files() - shm_before or project_pids() - pids_before):
        time.sleep(0.5)
    left_shm = shm_files() - shm_before
    left_procs = sorted(f"{pid} {procs.role_of(pid)}" for pid in project_pids() - pids_before)
    summary = {
        "faults": len(faults),
        "ok": sum(not f.problems for f in faults),
        "failed": sum(bool(f.problems) for f in faults),
        "slowest_end_after_detection_s": max((f.slowest_end_s for f in faults), default=0.0),
        "unaffected_model_errors": sum(f.unaffected_errors for f in faults),
        "left_in_dev_shm": sorted(left_shm),
        "left_processes": left_procs,
    }
    report = {
        "bench": "faults",
        "started": started_at,
        "host": host.describe(),
        "deployment": text,
        "stop_s": {"short_at_most": short_s, "long_at_least": long_s + 2.0},
        "summary": summary,
        "faults": [asdict(f) for f in faults],
        "table": table(faults),
    }
    args.out.write_text(json.dumps(report, indent=1))
    print(table(faults), flush=True)
    print(json.dumps(summary), flush=True)
    ok = not summary["failed"] and not left_shm and not left_procs
    return 0 if ok else 1


def project_pids() -> set[int]:
    """Processes of a deployment on this host (a daemon, its members, engines), by command line."""
    return {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and procs.role_of(int(p.name)) != "other"}


if __name__ == "__main__":
    sys.exit(main())
