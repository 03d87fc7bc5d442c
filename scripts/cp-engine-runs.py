"""Runs the smallest context-parallel configurations of both pinned engines natively (no CrossPool)
on this host and keeps each raw log: whether the engine starts, serves one greedy completion, or
fails, and with what. Evidence for docs/context-parallel.md.

    .venv/bin/python scripts/cp-engine-runs.py OUT_DIR

Each configuration runs alone, bounded (START_S to serve), and is stopped with its process tree.
The model is the tiny Qwen3 with one KV head (vLLM decode CP needs TP > KV heads), with the
SmolLM2 tokenizer so the OpenAI servers accept text."""

from __future__ import annotations

import json
import sys
import time
from datetime import date
from pathlib import Path

import httpx

from crosspool import envs, host
from crosspool.bench.overhead import BenchError, native_server, wait_ready
from crosspool.config import ModelConfig
from crosspool.models.prepare import make_tiny_checkpoint, prepare_smollm2

START_S = 420.0
RUNS: dict[str, tuple[str, int, dict[str, object]]] = {
    # name: (engine, ranks, engine arguments beyond the model's)
    "vllm-tp2-dcp2": ("vllm", 2, {"decode_context_parallel_size": 2}),
    "vllm-tp1-pcp2": ("vllm", 2, {"prefill_context_parallel_size": 2, "tensor_parallel_size": 1}),
    "sglang-tp2-attn-cp2-zigzag": (
        "sglang",
        2,
        {"attn_cp_size": 2, "enable_prefill_cp": True, "cp_strategy": "zigzag", "attention_backend": "torch_native"},
    ),
    "sglang-tp2-dcp2": ("sglang", 2, {"dcp_size": 2, "attention_backend": "torch_native"}),
}


def last_lines(path: Path, n: int = 6) -> list[str]:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line or "assert" in line]
    return (errors or lines)[-n:]


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    path = make_tiny_checkpoint(
        "qwen3",
        envs.cache_root() / "tiny" / "tiny-qwen3-kv1-tok",
        seed=0,
        tokenizer=prepare_smollm2(),
        shape={"num_key_value_heads": 1},
    )
    results = {}
    for name, (engine, ranks, args) in RUNS.items():
        model = ModelConfig(
            id="cp",
            path=path,
            engine=engine,
            attention_tp=ranks,
            rank_cpus=[[r % 2] for r in range(ranks)],
            max_model_len=1024,
        ).model_copy(update={"engine_args": args})
        log_path = out / f"{name}.log"
        started = time.monotonic()
        with log_path.open("w") as log:
            log.write(f"# {name}: {engine} {json.dumps(args)} on {json.dumps(host.describe())}\n")
            log.flush()
            try:
                with native_server(model, model.rank_cpus, log, name) as side:
                    wait_ready([side], log_path, started + START_S)
                    body = {"model": "cp", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
                    answer = httpx.post(side.url + "/v1/completions", json=body, timeout=120)
                    outcome = f"served: HTTP {answer.status_code} {answer.text[:300]}"
            except (BenchError, httpx.HTTPError) as e:
                outcome = f"failed: {e}"
        results[name] = {
            "engine": engine,
            "args": args,
            "outcome": outcome,
            "seconds": round(time.monotonic() - started, 1),
            "log": log_path.name,
            "last_error_lines": last_lines(log_path),
        }
        print(f"{name}: {outcome}", flush=True)
    summary = {name: r["outcome"].split(":")[0] for name, r in results.items()}
    (out / "summary.json").write_text(
        json.dumps(
            {"date": date.today().isoformat(), "host": host.describe(), "summary": summary, "runs": results}, indent=2
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
