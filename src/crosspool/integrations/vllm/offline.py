"""Offline vLLM generation in a child process (tests, qualification, benchmarks).

`python -m crosspool.integrations.vllm.offline JOB.json` runs greedy generation on token-id
prompts with `vllm.LLM` and writes tokens and timings to the job's `out` file. Native and
CrossPool runs differ only in the environment (`launch.engine_env`), so both use this code.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from crosspool.config import ModelConfig
from crosspool.integrations.vllm.launch import engine_env, engine_kwargs


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    model = ModelConfig.model_validate(job["model"])
    kwargs = engine_kwargs(model, job["max_batched_tokens"])
    if job.get("first_logits"):  # "logprobs" then carry the raw logits of the whole vocabulary
        kwargs.update(max_logprobs=-1, logprobs_mode="raw_logits")
    llm = LLM(**kwargs, skip_tokenizer_init=True, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    results: dict = {"runs": []}
    if job.get("first_logits"):
        # The first step's logits over the whole vocabulary, per prompt (one prompt per batch).
        first = SamplingParams(temperature=0.0, max_tokens=1, logprobs=-1)
        results["first_logits"] = []
        for prompt in job["first_logits"]:
            (out,) = llm.generate([{"prompt_token_ids": prompt}], first, use_tqdm=False)  # type: ignore[arg-type]
            steps = out.outputs[0].logprobs
            assert steps is not None and len(steps) == 1
            results["first_logits"].append([steps[0][t].logprob for t in range(len(steps[0]))])
    for batch in job["batches"]:
        prompts = [{"prompt_token_ids": p} for p in batch]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)  # type: ignore[arg-type]
        seconds = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        results["runs"].append({"tokens": tokens, "seconds": seconds, "generated": sum(map(len, tokens))})
    return results


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
) -> dict:
    """Run `run` in a fresh process (native vLLM when `plan_path` is None) and return its result.
    With `first_logits` (prompts) it also returns each one's first-step logits (whole vocabulary).

    `in_process_engine` runs vLLM's EngineCore in the generating process, so every request of a
    batch is scheduled together: batch composition (and with it the bf16 arithmetic of every
    kernel) no longer depends on how fast requests reach a busy engine. Token-identity checks
    need that; throughput measurements want vLLM's default multiprocess engine (EngineCore and
    a Worker bound to its own cores), as served."""
    with tempfile.TemporaryDirectory(prefix="crosspool-offline-") as tmp:
        job_file, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job = {
            "model": model.model_dump(mode="json"),
            "max_batched_tokens": max_batched_tokens,
            "batches": batches,
            "max_tokens": max_tokens,
            "first_logits": first_logits,
            "out": str(out),
        }
        job_file.write_text(json.dumps(job))
        # An in-process EngineCore steps only when generate() drives it, so every request of a
        # batch is scheduled together: batch composition (and with it the bf16 arithmetic of
        # every kernel) no longer depends on how fast requests reach a busy engine.
        env = {**engine_env(model, plan_path), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        # The engine logs to stdout; callers' stdout may be a JSON report (crosspool qualify).
        proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(job_file)], env=env, start_new_session=True, stdout=2
        )
        try:
            code = proc.wait(timeout=timeout_s)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if code != 0:
            raise RuntimeError(f"offline vLLM run exited with code {code}")
        return json.loads(out.read_text())


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    result = run(job)
    Path(job["out"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
