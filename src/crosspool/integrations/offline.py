"""Offline greedy generation in a child process, for any engine (tests, qualification, benchmarks).

The child runs `python -m crosspool.integrations.<engine>.offline JOB.json`, whose `run(job)`
drives the engine's own offline API on token-id prompts and returns tokens and timings. Native
and CrossPool runs differ only in the environment (`launch.engine_env`), so both run the same
code. A child, because an engine may take its caller down with it (SGLang SIGKILLs the process
that created its Engine when a scheduler fails) and must not keep state between runs.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from crosspool.config import ModelConfig
from crosspool.cpus import host_cpus, rank_cpus
from crosspool.integrations import launcher
from crosspool.ipc import GROUP_GONE_S, EngineFiles, wait_groups_gone

T = TypeVar("T")


def generate_in_child(
    model: ModelConfig,
    max_batched_tokens: int,
    batches: list[list[list[int]]],
    max_tokens: int,
    plan_path: Path | None,
    timeout_s: float = 900.0,
    *,
    in_process_engine: bool = True,
    first_logits: list[list[int]] | None = None,
    cpus: list[int] | None = None,
) -> dict:
    """Run the engine's offline `run` in a fresh process (native when `plan_path` is None) and
    return `{"runs": [{"tokens", "seconds", "generated"}, ...]}`, one run per batch. With
    `first_logits` (prompts) it also returns each one's first-step log-probabilities over the
    whole vocabulary (`"first_logits"`; raw logits where the engine offers them).

    `in_process_engine` asks the engine to schedule every request of a batch together (vLLM: its
    EngineCore in the generating process), so batch composition, and with it the bf16 arithmetic
    of every kernel, does not depend on how fast requests reach a busy engine. Token-identity
    checks need that; throughput measurements want the engine's default process layout.

    `cpus`: the CPUs the engine's processes may run on (default: this process's), so that two
    runs side by side do not share a core."""
    module = f"crosspool.integrations.{model.engine}.offline"
    with tempfile.TemporaryDirectory(prefix="crosspool-offline-") as tmp:
        job_file, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job = {
            "model": model.model_dump(mode="json"),
            "max_batched_tokens": max_batched_tokens,
            "batches": batches,
            "max_tokens": max_tokens,
            "first_logits": first_logits,
            "cpus": cpus,
            "out": str(out),
        }
        job_file.write_text(json.dumps(job))
        ranks = rank_cpus(model.ranks, cpus or host_cpus())
        env = launcher(model.engine).engine_env(model, plan_path, ranks)
        env.update(importlib.import_module(module).offline_env(in_process_engine), TMPDIR=tmp)
        # The engine logs to stdout; callers' stdout may be a JSON report (crosspool qualify).
        engine_files = EngineFiles.now()
        proc = subprocess.Popen(
            [sys.executable, "-m", module, str(job_file)], env=env, start_new_session=True, stdout=2
        )
        try:
            code = proc.wait(timeout=timeout_s)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            wait_groups_gone([proc.pid], GROUP_GONE_S)
            engine_files.sweep()
        if code != 0:
            raise RuntimeError(f"offline {model.engine} run exited with code {code}")
        return json.loads(out.read_text())


def side_by_side(calls: Sequence[Callable[[list[int]], T]]) -> list[T]:
    """Run `calls` concurrently, each given one CPU of this process's to keep to (`cpus` of
    `generate_in_child`), at most one call per CPU at a time; results in order. Offline runs are
    CPU-bound processes: two side by side on a 2-core host took 24 s where one after the other
    took 48 s, with the same tokens."""
    free: queue.Queue[int] = queue.Queue()
    for cpu in host_cpus():
        free.put(cpu)

    def run(call: Callable[[list[int]], T]) -> T:
        cpu = free.get()
        try:
            return call([cpu])
        finally:
            free.put(cpu)

    with ThreadPoolExecutor(max(1, min(free.qsize(), len(calls)))) as pool:
        return list(pool.map(run, calls))


def child_main(run: object) -> None:
    """`__main__` of an engine's offline module: run the job file named in argv, write its result."""
    assert callable(run)
    job = json.loads(Path(sys.argv[1]).read_text())
    if job.get("cpus"):  # before the engine is imported: its workers inherit it and bind within it
        os.sched_setaffinity(0, job["cpus"])
    Path(job["out"]).write_text(json.dumps(run(job)))
