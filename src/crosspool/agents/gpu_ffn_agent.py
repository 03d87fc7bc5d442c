"""A GPU FfnAgent: serves the CUDA mailboxes (`transport.cuda`) of its ranks on its GPU.

One lane per mailbox, each with its own stream and the FFN executors of the lane's model. The
host thread watches every lane's step doorbell; when a rank starts a step it clears the doorbell
and launches the whole step on the lane's stream: in `graph` mode the replay of the graph captured
for that row count (one per bucket, covering every layer: no per-layer host work), else (`eager`,
or a row count with no graph, such as a prefill) the same work enqueued eagerly. Either way the
host never waits for the device: the flags carry the per-layer handshakes.

Row counts are computed exactly as the rank sends them (a graph per bucket, no padding), since a
GEMM's rounding can depend on its row count and the pool must compute what the engine would.

    python -m crosspool.agents.gpu_ffn_agent --lane MAILBOX_FILE[:CHECKPOINT] ... [--mode graph] \
        [--buckets 1,64] [--activation-math dtype] [--split-gate-up]

A lane without a checkpoint is a probe: it copies its input rows to the output (the Transport's
own cost; a step of zero rows is the flags alone). The agent exits when a mailbox is stopped or
its rank exits; an error in a step fails the mailbox (`STATUS_AGENT_ERROR`) and releases every
wait, then the agent exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from crosspool.agents.ffn.weights import LayerExecutor, load_layers
from crosspool.ipc import SLICE_S, Peer
from crosspool.kernels import Linear, MoeKernel, plain_linear
from crosspool.models.spec import ActivationMath, MoeRouting, load_ffn_spec
from crosspool.transport.cuda import (
    H_AGENT_PID,
    H_RANK_PID,
    H_READY,
    H_STEP,
    H_STOP,
    STATUS_AGENT_ERROR,
    DeviceMailbox,
    Watchdog,
    wait_word,
    write_word,
)

SPIN_S = 0.002
"""After a step the host thread polls the doorbells without sleeping this long (a decode loop's
next step comes sooner), then sleeps `POLL_S` between looks."""
POLL_S = 0.0001
READY_TIMEOUT_S = 120.0


class TorchKernels:
    """Kernels of the GPU lanes: torch's own GEMMs (cuBLAS); dense FFNs only for now."""

    def linear(self, weight: torch.Tensor, /) -> Linear:
        return plain_linear(weight)

    def moe(
        self,
        router: torch.Tensor,
        bias: torch.Tensor | None,
        w13: torch.Tensor,
        w2: torch.Tensor,
        routing: MoeRouting,
        /,
    ) -> MoeKernel:
        raise NotImplementedError("the GPU FfnAgent serves dense FFNs only")


class Lane:
    def __init__(
        self, box: DeviceMailbox, layers: dict[int, LayerExecutor] | None, buckets: list[int], graphs: bool
    ) -> None:
        assert layers is None or sorted(layers) == list(range(box.layers)), sorted(layers or {})
        self.box, self.layers = box, layers
        self.stream = torch.cuda.Stream(box.input.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if graphs:
            for rows in buckets:
                self.graphs[rows] = self._capture(rows)

    def _compute(self, layer: int, rows: int) -> None:
        x, out = self.box.input[:rows], self.box.output[:rows]
        if self.layers is None:
            out.copy_(x)
        else:
            self.layers[layer](x, out)

    def _step(self, rows: int) -> None:
        box, stream = self.box, torch.cuda.current_stream()
        for layer in range(box.layers):
            wait_word(stream, box.req(layer), 1)
            write_word(stream, box.req(layer), 0)
            self._compute(layer, rows)
            write_word(stream, box.resp(layer), 1)

    def _capture(self, rows: int) -> torch.cuda.CUDAGraph:
        with torch.cuda.stream(self.stream):  # warm up: cuBLAS handles and workspaces outside the capture
            for layer in range(self.box.layers):
                self._compute(layer, rows)
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream):
            self._step(rows)
        return graph

    def launch(self, rows: int) -> None:
        assert 0 <= rows <= self.box.max_rows, rows
        with torch.cuda.stream(self.stream):
            graph = self.graphs.get(rows)
            if graph is not None:
                graph.replay()
            else:
                self._step(rows)


def serve(lanes: list[Lane], stopped: Callable[[], bool]) -> None:
    """Launch each lane's steps as their doorbells ring, until `stopped()` (looked at between steps)."""
    doorbells = [(lane, lane.box.host.words) for lane in lanes]
    last_step = time.monotonic()
    next_look = last_step + SLICE_S
    while True:
        rang = False
        for lane, words in doorbells:
            doorbell = words[H_STEP]
            if doorbell:
                words[H_STEP] = 0
                lane.launch(doorbell - 1)
                rang = True
        now = time.monotonic()
        if rang:
            last_step = now
        elif now - last_step > SPIN_S:
            time.sleep(POLL_S)
        if now >= next_look:
            next_look = now + SLICE_S
            if stopped():
                return


def _parse_lane(text: str) -> tuple[Path, Path | None]:
    mailbox, _, checkpoint = text.partition(":")
    return Path(mailbox), Path(checkpoint) if checkpoint else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m crosspool.agents.gpu_ffn_agent")
    p.add_argument("--lane", action="append", required=True, help="MAILBOX_FILE[:CHECKPOINT_DIR]")
    p.add_argument("--mode", choices=("graph", "eager"), default="graph")
    p.add_argument("--buckets", default="1", help="row counts to capture a graph for, comma-separated")
    p.add_argument("--activation-math", choices=("dtype", "fp32"), default="dtype")
    p.add_argument("--split-gate-up", action="store_true", help="gate and up as two GEMMs (the engine's rounding)")
    args = p.parse_args(argv)
    buckets = sorted({int(b) for b in args.buckets.split(",")})
    math: ActivationMath = args.activation_math
    boxes = [DeviceMailbox.open(mailbox.read_bytes()) for mailbox, _ in map(_parse_lane, args.lane)]
    try:
        lanes = []
        for box, (_, checkpoint) in zip(boxes, map(_parse_lane, args.lane), strict=True):
            torch.cuda.set_device(box.input.device)
            layers = None
            if checkpoint is not None:
                dtype = str(box.input.dtype).removeprefix("torch.")
                layers = load_layers(
                    load_ffn_spec(checkpoint),
                    dtype,
                    math,
                    TorchKernels(),
                    device=box.input.device,
                    fuse_gate_up=not args.split_gate_up,
                )
            fits = [b for b in buckets if b <= box.max_rows and (b > 0 or layers is None)]
            lanes.append(Lane(box, layers, fits, args.mode == "graph"))
        ranks = [Peer("rank", f"mailbox {box.host.name}", box.host.words[H_RANK_PID]) for box in boxes]
        for box in boxes:
            box.host.words[H_AGENT_PID] = os.getpid()
            box.host.words[H_READY] = 1

        def stopped() -> bool:
            return any(box.host.words[H_STOP] for box in boxes) or not all(r.alive() for r in ranks)

        try:
            serve(lanes, stopped)
        except Exception as e:
            for box in boxes:
                box.fail(STATUS_AGENT_ERROR, f"GPU FfnAgent (pid {os.getpid()}): {type(e).__name__}: {e}")
                box.release_waits(torch.cuda.Stream(box.input.device))
            torch.cuda.synchronize()
            raise
        torch.cuda.synchronize()
        return 0
    finally:
        for box in boxes:
            box.close()


@dataclass
class GpuAgentProcess:
    proc: subprocess.Popen[bytes]
    watchdogs: list[Watchdog]
    """One per lane, in this (the rank's) process: they release the lanes' waits if the agent exits."""


class MpsRequired(RuntimeError):
    """Several processes would share one GPU without an MPS control daemon."""


@contextlib.contextmanager
def running_agent(
    lanes: list[tuple[DeviceMailbox, Path | None]],
    *,
    mode: str,
    buckets: list[int],
    env: dict[str, str],
    mps: bool,
    extra: tuple[str, ...] = (),
) -> Iterator[GpuAgentProcess]:
    """A GPU FfnAgent process serving `lanes` (mailboxes this process created), ready and watched
    (a `Watchdog` per mailbox); stopped (the mailboxes' stop word, then SIGKILL after 10 s) when
    the block ends.

    `env` is the agent's environment (the MPS variables among it); `mps` says a control daemon
    runs: the agent shares its GPU with this process, which time-slices without MPS (a per-layer
    round trip of ~290 us instead of ~18, FEASIBILITY.md), so that is refused."""
    if not mps:
        raise MpsRequired(
            "the GPU FfnAgent would share a GPU with its rank process without MPS; start the deployment's "
            "MPS control daemon (crosspool.daemon.mps) first"
        )
    with tempfile.TemporaryDirectory(prefix="crosspool-gpu-agent-") as tmp:
        argv = [sys.executable, "-m", "crosspool.agents.gpu_ffn_agent", "--mode", mode]
        argv += ["--buckets", ",".join(map(str, buckets)), *extra]
        for i, (box, checkpoint) in enumerate(lanes):
            blob = Path(tmp) / f"mailbox{i}"
            blob.write_bytes(box.export())
            blob.chmod(0o600)
            argv += ["--lane", f"{blob}:{checkpoint}" if checkpoint else str(blob)]
        proc = subprocess.Popen(argv, env=env)
        agent = GpuAgentProcess(proc, [])
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not all(box.host.words[H_READY] for box, _ in lanes):
                if proc.poll() is not None:
                    raise RuntimeError(f"the GPU FfnAgent exited with {proc.returncode} before it was ready")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the GPU FfnAgent was not ready within {READY_TIMEOUT_S:.0f} s")
                time.sleep(0.01)
            peer = Peer("GPU FfnAgent", "ffn", proc.pid)
            agent.watchdogs = [Watchdog(box, peer) for box, _ in lanes]
            yield agent
        finally:
            for watchdog in agent.watchdogs:
                watchdog.stop()
            for box, _ in lanes:
                box.host.words[H_STOP] = 1
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
