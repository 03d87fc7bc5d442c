"""The CUDA data plane on a real GPU: the Transport's captured layer call, a GPU FfnAgent in
another process, the escape from a dead agent, and token identity of the transformers
integration. Skipped where there is no GPU (CI); run on the GPU host as

    python -m crosspool.daemon.mps python -m pytest tests/gpu -m gpu
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.version.cuda is None or shutil.which("nvidia-smi") is None, reason="needs a CUDA GPU and torch for CUDA"
    ),
]

HIDDEN = 512
SHAPE = dict(
    hidden_size=HIDDEN,
    intermediate_size=1536,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=4096,
    initializer_range=0.05,
)


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    from crosspool.daemon.mps import under_mps

    assert under_mps(), "GPU tests share the GPU among processes: run them as `python -m crosspool.daemon.mps pytest`"
    return dict(os.environ)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> dict[str, Path]:
    from crosspool.models.prepare import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("gpu-models")
    return {
        family: make_tiny_checkpoint(family, root / family, layers=4, shape=SHAPE, device="cuda")
        for family in ("llama", "qwen3")
    }


def _layers(checkpoint: Path, *, fuse: bool = True) -> dict:
    from crosspool.agents.ffn.weights import load_layers
    from crosspool.agents.gpu_ffn_agent import TorchKernels
    from crosspool.models.spec import load_ffn_spec

    spec = load_ffn_spec(checkpoint)
    return load_layers(spec, "bfloat16", "dtype", TorchKernels(), device="cuda", fuse_gate_up=fuse)


def test_a_captured_step_replays_10000_times_with_the_pools_results(env, checkpoints, no_leftovers):
    """The rank (this process) holds no FFN weights; each replay's rows come back as the FFN of
    fresh inputs, checked on the device; replays run with torch's sync debug mode set to error,
    so any host synchronisation in them would raise."""
    from crosspool.agents.gpu_ffn_agent import running_agent
    from crosspool.transport.cuda import DeviceMailbox, RankChannel

    ffns = _layers(checkpoints["llama"])
    layers = len(ffns)
    box = DeviceMailbox.create(layers=layers, max_rows=8, hidden=HIDDEN, dtype=torch.bfloat16, device=0)
    try:
        with running_agent([(box, checkpoints["llama"])], mode="graph", buckets=[8], env=env, mps=True):
            channel = RankChannel(box)
            inputs = torch.randn(16, 8, HIDDEN, dtype=torch.bfloat16, device="cuda")
            # The expected rows, computed here with the same executor: layer l's output is
            # layer l+1's input in this test.
            expected = inputs.clone()
            for i in range(len(inputs)):
                for layer in range(layers):
                    expected[i] = ffns[layer](expected[i])
            del ffns
            torch.cuda.empty_cache()
            x = torch.empty(8, HIDDEN, dtype=torch.bfloat16, device="cuda")
            y = torch.empty_like(x)
            which = torch.zeros(1, dtype=torch.long, device="cuda")
            mismatches = torch.zeros((), dtype=torch.long, device="cuda")

            def step() -> None:
                x.copy_(inputs.index_select(0, which)[0])
                for layer in range(layers):
                    channel.call(layer, x, y)
                    if layer + 1 < layers:
                        x.copy_(y)
                mismatches.add_((y != expected.index_select(0, which)[0]).any().long())
                which.add_(1).remainder_(len(inputs))

            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                step()
                torch.cuda.synchronize()
                assert mismatches.item() == 0
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    step()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    for _ in range(10_000):
                        graph.replay()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                stream.synchronize()
            box.raise_if_failed()
            assert mismatches.item() == 0
            assert which.item() == 10_001 % len(inputs)
    finally:
        box.close()


def test_a_dead_agent_releases_the_ranks_captured_graph(env, no_leftovers):
    """A device wait has no timeout: the rank's watchdog sees the agent exit and releases the
    waits of the graph in flight; the rank learns why from `raise_if_failed`."""
    from crosspool.agents.gpu_ffn_agent import running_agent
    from crosspool.transport.cuda import DeviceMailbox, RankChannel
    from crosspool.transport.errors import FfnPeerExited

    box = DeviceMailbox.create(layers=4, max_rows=1, hidden=HIDDEN, dtype=torch.bfloat16, device=0)
    try:
        with running_agent([(box, None)], mode="graph", buckets=[1], env=env, mps=True) as agent:
            channel = RankChannel(box)
            x = torch.randn(1, HIDDEN, dtype=torch.bfloat16, device="cuda")
            y = torch.empty_like(x)
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    for layer in range(4):
                        channel.call(layer, x, y)
                graph.replay()
                stream.synchronize()
                assert torch.equal(y, x)
                os.kill(agent.proc.pid, signal.SIGSTOP)  # the next step waits on a silent agent
                graph.replay()
                time.sleep(0.5)
                assert not stream.query(), "the step finished without its agent"
                os.kill(agent.proc.pid, signal.SIGKILL)
                started = time.monotonic()
                while not stream.query():
                    assert time.monotonic() - started < 5, "the captured graph still waits for a dead agent"
                    time.sleep(0.01)
            with pytest.raises(FfnPeerExited, match=f"pid {agent.proc.pid}"):
                box.raise_if_failed()
            with pytest.raises(FfnPeerExited):
                channel.call(0, x, y)  # an eager call fails at once
    finally:
        box.close()


def test_an_agent_sharing_the_gpu_without_mps_is_refused(env):
    from crosspool.agents.gpu_ffn_agent import MpsRequired, running_agent

    with pytest.raises(MpsRequired, match="MPS"), running_agent([], mode="graph", buckets=[1], env=env, mps=False):
        pass


def test_the_private_mps_daemon_serves_this_process(env):
    from crosspool.daemon.mps import CONTROL

    torch.zeros(1, device="cuda")  # this process is a client by now
    done = subprocess.run([CONTROL], input="get_server_list\n", env=env, capture_output=True, text=True, timeout=10)
    assert done.returncode == 0 and done.stdout.split(), (done.stdout, done.stderr)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_tokens_match_native_transformers(env, checkpoints, family, no_leftovers):
    """HF generate (eager) and the graph-captured decode loop, each with transformers' own MLP
    and with the FFN pool, greedy: identical tokens."""
    from transformers import AutoModelForCausalLM

    from crosspool import ops
    from crosspool.agents.gpu_ffn_agent import running_agent
    from crosspool.integrations.transformers import AGENT_ARGS, greedy, offload_mlps
    from crosspool.transport.cuda import DeviceMailbox, RankChannel

    model = AutoModelForCausalLM.from_pretrained(checkpoints[family], dtype=torch.bfloat16).to("cuda")
    torch.manual_seed(0)
    prompts = torch.randint(0, SHAPE["vocab_size"], (4, 12), device="cuda")
    new = 24
    native_generate = model.generate(prompts, max_new_tokens=new, min_new_tokens=new, do_sample=False)[:, 12:]
    native_graph = greedy(model, prompts, new, graph=True)
    assert native_generate.unique().numel() > 4, "degenerate random model: identity would prove little"
    layers = offload_mlps(model)
    box = DeviceMailbox.create(layers=layers, max_rows=4 * 12, hidden=HIDDEN, dtype=torch.bfloat16, device=0)
    ops.attach(RankChannel(box))
    try:
        with running_agent(
            [(box, checkpoints[family])], mode="graph", buckets=[4], env=env, mps=True, extra=AGENT_ARGS
        ):
            pool_generate = model.generate(prompts, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            pool_graph = greedy(model, prompts, new, graph=True, after_step=box.raise_if_failed)
            box.raise_if_failed()
    finally:
        ops.detach()
        box.close()
    assert torch.equal(pool_generate[:, 12:], native_generate)
    assert torch.equal(pool_graph, native_graph)
