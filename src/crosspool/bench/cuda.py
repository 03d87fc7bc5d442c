"""The CUDA data plane on one GPU: floors, the per-layer round trip through a GPU FfnAgent in
another process, the FFN executor against plain torch, and a transformers model's decode step
with its FFN out of process against in process.

    crosspool bench cuda [--steps 200] [--layers 32] [--decode-steps 64] --out FILE

Everything runs under a private MPS control daemon: the bench starts it, runs itself again as its
client, and stops it. Device times
come from CUDA events; a "step" is one call of every layer of a mailbox (the unit a rank's
captured graph holds), and a per-layer time is a step's time over its layers. Model shapes are
Llama-3-8B's (hidden 4096, intermediate 14336, 32 heads, 8 KV heads) with fewer layers and a
random checkpoint made on the GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from crosspool import host
from crosspool.agents.ffn.weights import LayerExecutor, load_layers
from crosspool.agents.gpu_ffn_agent import TorchKernels, running_agent
from crosspool.bench.quantiles import quantile
from crosspool.daemon.mps import run_under_mps, under_mps
from crosspool.models.prepare import make_tiny_checkpoint
from crosspool.models.spec import load_ffn_spec
from crosspool.transport.cuda import DeviceMailbox, RankChannel, wait_word, write_word

HIDDEN = 4096
SHAPE = dict(
    hidden_size=HIDDEN,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=32000,
    initializer_range=0.02,
    max_position_embeddings=4096,
)
ROUND_TRIP_ROWS = (0, 1, 64, 512)
EXECUTOR_ROWS = (1, 256, 4096)
DECODE_BATCHES = (1, 64)


def percentiles(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"p50": quantile(s, 0.5), "p99": quantile(s, 0.99), "n": len(s)}


def device_times_us(run: Callable[[], object], repeats: int, per: int = 1) -> list[float]:
    """Device time of each of `repeats` runs of `run` on the current stream, over `per`, in us."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return [1e3 * start.elapsed_time(end) / per for start, end in events]


def captured(fn: Callable[[], None], stream: torch.cuda.Stream) -> Callable[[], None]:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return graph.replay


def floors(repeats: int) -> dict[str, Any]:
    """One process: an empty kernel, a stream memop write+wait pair, device copies; eager and graph."""
    n = 200
    flag = torch.zeros(16, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()

    def memops() -> None:
        s = torch.cuda.current_stream()
        for i in range(n):
            write_word(s, flag.data_ptr(), i + 1)
            wait_word(s, flag.data_ptr(), i + 1)
            write_word(s, flag.data_ptr(), 0)
            wait_word(s, flag.data_ptr(), 0)

    def empty_kernels() -> None:
        for _ in range(n):
            torch.cuda._sleep(0)

    def copies(x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            for _ in range(n):
                y.copy_(x)

        return run

    work: dict[str, tuple[Callable[[], None], int]] = {
        "empty_kernel": (empty_kernels, n),
        "memop_write_wait_pair": (memops, 2 * n),
    }
    for rows in ROUND_TRIP_ROWS[1:]:
        x = torch.randn(rows, HIDDEN, dtype=torch.bfloat16, device="cuda")
        work[f"copy_{rows}x{HIDDEN}"] = (copies(x, torch.empty_like(x)), n)
    out: dict[str, Any] = {}
    with torch.cuda.stream(stream):
        for name, (fn, per) in work.items():
            fn()
            torch.cuda.synchronize()
            out[name] = {
                "eager_us": percentiles(device_times_us(fn, repeats, per)),
                "graph_us": percentiles(device_times_us(captured(fn, stream), repeats, per)),
            }
    return out


def rank_steps(channel: RankChannel, rows: int, layers: int, steps: int, graph: bool) -> dict[str, Any]:
    """Per-layer device time of `steps` steps of `layers` calls each; the rows come back checked
    against `check` (the probe's copy)."""
    x = torch.randn(rows, HIDDEN, dtype=torch.bfloat16, device="cuda")
    y = torch.full_like(x, float("nan"))

    def step() -> None:
        for layer in range(layers):
            channel.call(layer, x, y)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        run = captured(step, stream) if graph else step
        wall = time.perf_counter()
        times = device_times_us(run, steps, layers)
        wall = time.perf_counter() - wall
    channel.mailbox.raise_if_failed()
    return {"per_layer_us": percentiles(times), "wall_per_layer_us": 1e6 * wall / (steps * layers), "y": y, "x": x}


def in_process_steps(ffns: dict[int, LayerExecutor], rows: int, steps: int) -> dict[str, Any]:
    x = torch.randn(rows, HIDDEN, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)

    def step() -> None:
        for layer in sorted(ffns):
            ffns[layer](x, y)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()
        torch.cuda.synchronize()
        return {"per_layer_us": percentiles(device_times_us(captured(step, stream), steps, len(ffns)))}


def hf_mlp(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The same MLP as transformers' LlamaMLP computes it: three `F.linear`, SiLU and product in bf16."""
    f = torch.nn.functional
    return lambda x: f.linear(f.silu(f.linear(x, gate)) * f.linear(x, up), down)


def executor_vs_torch(checkpoint: Path, repeats: int) -> dict[str, Any]:
    spec = load_ffn_spec(checkpoint)
    (ffn,) = load_layers(spec, "bfloat16", "dtype", TorchKernels(), layers=[0], device="cuda").values()
    (split,) = load_layers(
        spec, "bfloat16", "dtype", TorchKernels(), layers=[0], device="cuda", fuse_gate_up=False
    ).values()
    layer = spec.layers[0]
    from safetensors.torch import load_file

    t = load_file(checkpoint / "model.safetensors", device="cuda")
    plain = hf_mlp(t[layer.gate_key], t[layer.up_key], t[layer.down_key])  # type: ignore[union-attr]
    out: dict[str, Any] = {}
    stream = torch.cuda.Stream()
    for rows in EXECUTOR_ROWS:
        x = torch.randn(rows, HIDDEN, dtype=torch.bfloat16, device="cuda")
        y = torch.empty_like(x)
        runs: dict[str, Callable[[], object]] = {
            "executor": functools.partial(ffn, x, y),
            "executor_split_gate_up": functools.partial(split, x, y),
            "plain_torch": functools.partial(plain, x),
        }
        with torch.cuda.stream(stream):
            for fn in runs.values():
                fn()
            torch.cuda.synchronize()
            row: dict[str, Any] = {name: [] for name in runs}
            for _ in range(5):  # alternate, so drift hits each alike
                for name, fn in runs.items():
                    row[name] += device_times_us(fn, max(3, repeats // 5))
        row = {name: percentiles(samples) for name, samples in row.items()}
        row["executor_over_torch_speed"] = row["plain_torch"]["p50"] / row["executor"]["p50"]
        row["split_bitwise_equal_to_torch"] = bool(torch.equal(split(x), plain(x)))
        row["fused_bitwise_equal_to_torch"] = bool(torch.equal(ffn(x), plain(x)))
        out[str(rows)] = row
    return out


def decode(checkpoint: Path, env: dict[str, str], steps: int) -> dict[str, Any]:
    """Decode step time of the transformers model, FFN in process vs in a GPU FfnAgent, graph mode."""
    from transformers import AutoModelForCausalLM

    from crosspool import ops
    from crosspool.integrations.transformers import AGENT_ARGS, greedy, offload_mlps

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).to("cuda")  # type: ignore[arg-type]
    torch.manual_seed(1)
    prompts = {b: torch.randint(0, 32000, (b, 32), device="cuda") for b in DECODE_BATCHES}
    out: dict[str, Any] = {}
    native: dict[tuple[str, int], torch.Tensor] = {}
    for mode in ("graph", "eager"):
        for b in DECODE_BATCHES:
            times: list[float] = []
            native[mode, b] = greedy(model, prompts[b], steps, graph=mode == "graph", step_times_ms=times)
            out.setdefault(mode, {}).setdefault(str(b), {})["in_process_step_ms"] = percentiles(times[2:])
    layers = offload_mlps(model)
    box = DeviceMailbox.create(
        layers=layers, max_rows=max(DECODE_BATCHES) * 32, hidden=HIDDEN, dtype=torch.bfloat16, device=0
    )
    channel = RankChannel(box)
    ops.attach(channel)
    try:
        with running_agent(
            [(box, checkpoint)], mode="graph", buckets=list(DECODE_BATCHES), env=env, mps=True, extra=AGENT_ARGS
        ):
            for mode in ("graph", "eager"):
                for b in DECODE_BATCHES:
                    times = []
                    tokens = greedy(
                        model,
                        prompts[b],
                        steps,
                        graph=mode == "graph",
                        after_step=box.raise_if_failed,
                        step_times_ms=times,
                    )
                    row = out[mode][str(b)]
                    row["pool_step_ms"] = percentiles(times[2:])
                    row["pool_over_in_process"] = row["pool_step_ms"]["p50"] / row["in_process_step_ms"]["p50"]
                    row["pool_minus_in_process_per_layer_us"] = (
                        1e3 * (row["pool_step_ms"]["p50"] - row["in_process_step_ms"]["p50"]) / layers
                    )
                    row["tokens_identical"] = bool(torch.equal(tokens, native[mode, b]))
                    row["distinct_tokens"] = int(tokens.unique().numel())
    finally:
        box.close()
    return out


def gpu_description() -> dict[str, Any]:
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nvidia_smi": smi.stdout.strip(),
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="crosspool bench cuda")
    p.add_argument("--steps", type=int, default=200, help="timed steps per round-trip configuration")
    p.add_argument("--layers", type=int, default=32, help="layer calls per step in the round trip")
    p.add_argument("--model-layers", type=int, default=8)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if not under_mps():
        return run_under_mps([sys.executable, "-m", "crosspool.cli", "bench", "cuda", *argv])
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": host.describe()}
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="crosspool-bench-cuda-") as tmp:
        report["gpu"] = gpu_description()
        report["floors"] = floors(args.steps)
        print(json.dumps(report["floors"], indent=1), flush=True)
        checkpoint = make_tiny_checkpoint(
            "llama", Path(tmp) / "llama", layers=args.model_layers, shape=SHAPE, device="cuda"
        )
        report["executor"] = executor_vs_torch(checkpoint, args.steps)
        print(json.dumps(report["executor"], indent=1), flush=True)
        report["round_trip"] = round_trips(checkpoint, args, env)
        print(json.dumps(report["round_trip"], indent=1), flush=True)
        report["decode"] = decode(checkpoint, env, args.decode_steps)
        print(json.dumps(report["decode"], indent=1), flush=True)
    report["summary"] = summary(report)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["summary"], indent=1))
    return 0


def round_trips(checkpoint: Path, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    spec_layers = args.model_layers
    ffns = load_layers(load_ffn_spec(checkpoint), "bfloat16", "dtype", TorchKernels(), device="cuda")
    for mode in ("eager", "graph"):
        probes = {
            rows: DeviceMailbox.create(
                layers=args.layers, max_rows=max(rows, 1), hidden=HIDDEN, dtype=torch.bfloat16, device=0
            )
            for rows in ROUND_TRIP_ROWS
        }
        ffn_box = DeviceMailbox.create(layers=spec_layers, max_rows=64, hidden=HIDDEN, dtype=torch.bfloat16, device=0)
        lanes: list[tuple[DeviceMailbox, Path | None]] = [(box, None) for box in probes.values()]
        lanes.append((ffn_box, checkpoint))
        try:
            with running_agent(lanes, mode=mode, buckets=[*ROUND_TRIP_ROWS], env=env, mps=True):
                row: dict[str, Any] = {}
                for rows, box in probes.items():
                    r = rank_steps(RankChannel(box), rows, args.layers, args.steps, graph=mode == "graph")
                    row[f"probe_{rows}_rows"] = {
                        "per_layer_us": r["per_layer_us"],
                        "wall_per_layer_us": r["wall_per_layer_us"],
                        "correct": bool(torch.equal(r["y"], r["x"])),
                    }
                for rows in (1, 64):
                    r = rank_steps(RankChannel(ffn_box), rows, spec_layers, args.steps, graph=mode == "graph")
                    expect = ffns[spec_layers - 1](r["x"])
                    local = in_process_steps(ffns, rows, args.steps)
                    row[f"ffn_{rows}_rows"] = {
                        "pool_per_layer_us": r["per_layer_us"],
                        "in_process_per_layer_us": local["per_layer_us"],
                        "pool_minus_in_process_us": r["per_layer_us"]["p50"] - local["per_layer_us"]["p50"],
                        "correct": bool(torch.equal(r["y"], expect)),
                    }
                out[mode] = row
        finally:
            for box, _ in lanes:
                box.close()
    return out


def summary(report: dict[str, Any]) -> dict[str, Any]:
    graph = report["round_trip"]["graph"]
    one = graph["probe_1_rows"]["per_layer_us"]["p50"]
    flags = graph["probe_0_rows"]["per_layer_us"]["p50"]
    return {
        "device": report["gpu"]["device"],
        "round_trip_1_row_graph_p50_us": one,
        "round_trip_1_row_graph_p99_us": graph["probe_1_rows"]["per_layer_us"]["p99"],
        "round_trip_flags_only_graph_p50_us": flags,
        "round_trip_1_row_over_flags_only": one / flags,
        "round_trip_1_row_eager_p50_us": report["round_trip"]["eager"]["probe_1_rows"]["per_layer_us"]["p50"],
        "ffn_layer_call_out_minus_in_process_us_1_row": graph["ffn_1_rows"]["pool_minus_in_process_us"],
        "executor_over_plain_torch_4096_rows": report["executor"]["4096"]["executor_over_torch_speed"],
        "decode_graph_pool_over_in_process": {
            b: report["decode"]["graph"][b]["pool_over_in_process"] for b in report["decode"]["graph"]
        },
        "decode_tokens_identical": all(
            r["tokens_identical"] for mode in report["decode"].values() for r in mode.values()
        ),
        "all_round_trips_correct": all(v["correct"] for mode in report["round_trip"].values() for v in mode.values()),
    }
