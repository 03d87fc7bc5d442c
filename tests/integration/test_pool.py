"""The FFN pool without an engine: real FfnAgent/AtnAgent processes, real shared memory; the test
process plays the Instance rank."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from crosspool.agents.ffn.weights import load_layers
from crosspool.config import parse_deployment
from crosspool.daemon.daemon import running_pool
from crosspool.daemon.generation import Generation
from crosspool.integrations import kernels
from crosspool.models.spec import load_ffn_spec
from crosspool.plan import resolve
from crosspool.transport.mailbox import W_REQ_SEQ, RankTransport


@pytest.fixture
def pool(tiny_models, no_leftovers):
    d = parse_deployment(f'''
[limits]
max_batched_tokens = 256
ffn_timeout_s = 2
[[model]]
id = "q"
path = "{tiny_models["qwen3"]}"
engine = "vllm"
''')
    with running_pool(resolve(d)) as gen:
        yield (
            gen,
            RankTransport.attach(gen.plan, "q", 0),
            load_layers(load_ffn_spec(tiny_models["qwen3"]), "bfloat16", "fp32", kernels("vllm")),
        )


def _member(gen: Generation, role: str):
    return next(m for m in gen.sup.members if m.name.startswith(role))


def test_layer_calls_match_in_process_ffn(pool):
    _, rank, reference = pool
    torch.manual_seed(0)
    for rows in (1, 3, 64, 256):
        for layer in (0, 1):
            x = torch.randn(rows, 128, dtype=torch.bfloat16)
            out = torch.empty_like(x)
            rank.call(layer, x, out)
            assert torch.equal(out, reference[layer](x))


def test_oversized_call_is_refused(pool):
    _, rank, _ = pool
    x = torch.zeros(257, 128, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="carries 257 rows; the mailbox holds 256"):
        rank.call(0, x, torch.empty_like(x))


def test_dead_ffn_agent_is_named(pool):
    run, rank, _ = pool
    os.kill(_member(run, "FfnAgent").proc.pid, signal.SIGKILL)
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"FFN pool failed: FfnAgent 'ffn0' \(pid \d+\) exited during layer 1 of q"):
        rank.call(1, x, torch.empty_like(x))
    assert time.monotonic() - start < 2


def test_silent_ffn_agent_times_out(pool):
    run, rank, _ = pool
    pid = _member(run, "FfnAgent").proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        x = torch.zeros(4, 128, dtype=torch.bfloat16)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="FfnAgent 'ffn0' did not answer within 2 s during layer 0 "):
            rank.call(0, x, torch.empty_like(x))
        assert time.monotonic() - start < 5
    finally:
        os.kill(pid, signal.SIGCONT)


def test_dead_atn_agent_fences_the_transport(pool):
    run, rank, _ = pool
    os.kill(_member(run, "AtnAgent").proc.pid, signal.SIGKILL)
    assert run.supervise() is not None  # returns at the first member failure, having fenced every mailbox
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="FFN pool failed: AtnAgent 'atn0' killed by SIGKILL"):
        rank.call(0, x, torch.empty_like(x))


def test_fence_fails_a_waiting_call(pool):
    run, rank, _ = pool
    pid = _member(run, "FfnAgent").proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        errors: list[str] = []

        def call() -> None:
            x = torch.zeros(4, 128, dtype=torch.bfloat16)
            try:
                rank.call(0, x, torch.empty_like(x))
            except RuntimeError as e:
                errors.append(str(e))

        t = threading.Thread(target=call)
        t.start()
        time.sleep(0.3)
        run.state.fail("test failure", "test")
        run.fence("test failure")
        t.join(timeout=1)
        assert not t.is_alive() and errors == ["FFN pool failed: test failure during layer 0 of q"]
    finally:
        os.kill(pid, signal.SIGCONT)


def test_probe_round_trip(pool):
    _, rank, _ = pool
    for _ in range(100):
        rank.probe()


def test_layers_spread_over_two_agents(tiny_models, no_leftovers):
    d = parse_deployment(f'''
[[ffn_agent]]
id = "ffn0"
[[ffn_agent]]
id = "ffn1"
[[model]]
id = "q"
path = "{tiny_models["qwen3"]}"
engine = "vllm"
''')
    reference = load_layers(load_ffn_spec(tiny_models["qwen3"]), "bfloat16", "fp32", kernels("vllm"))
    with running_pool(resolve(d)) as gen:
        assert gen.plan.model("q").layer_agents == [["ffn0"], ["ffn1"]]
        rank = RankTransport.attach(gen.plan, "q", 0)
        x = torch.randn(8, 128, dtype=torch.bfloat16)
        for layer in (0, 1):
            out = torch.empty_like(x)
            rank.call(layer, x, out)
            assert torch.equal(out, reference[layer](x))


def test_ffn_tensor_parallel_2_and_3(tiny_models, no_leftovers):
    """q2 split over 2 agents, q3 over 3 (256 intermediate rows: 86/85/85). The result is the
    shards' outputs added in shard order in fp32, cast once: bit-equal to that sum in process
    and close to the unsplit FFN."""
    path = tiny_models["qwen3"]
    d = parse_deployment(
        "".join(f'[[ffn_agent]]\nid = "ffn{i}"\n' for i in range(3))
        + "".join(f'[[model]]\nid = "q{k}"\npath = "{path}"\nengine = "vllm"\nffn_tp = {k}\n' for k in (2, 3))
    )
    spec, engine = load_ffn_spec(path), kernels("vllm")
    whole = load_layers(spec, "bfloat16", "fp32", engine)
    with running_pool(resolve(d)) as gen:
        for k in (2, 3):
            assert all(len(group) == k for group in gen.plan.model(f"q{k}").layer_agents)
            rank = RankTransport.attach(gen.plan, f"q{k}", 0)
            shards = [
                load_layers(spec, "bfloat16", "fp32", engine, None, dict.fromkeys((0, 1), (i, k))) for i in range(k)
            ]
            torch.manual_seed(k)
            for rows in (1, 33, 256):
                x = torch.randn(rows, 128, dtype=torch.bfloat16)
                for layer in (0, 1):
                    out = torch.empty_like(x)
                    rank.call(layer, x, out)
                    expected = shards[0][layer](x).float()
                    for shard in shards[1:]:
                        expected += shard[layer](x)
                    assert torch.equal(out, expected.to(torch.bfloat16))
                    ref = whole[layer](x).float()
                    assert ((out.float() - ref).norm() / ref.norm()).item() < 0.01


def test_attention_tp_ranks_share_one_call_per_layer(tiny_models, no_leftovers):
    """attention_tp = 2: rank 0 publishes, rank 1 reads the same reply; the agent computes each
    call once; rank 0 does not publish its next call before rank 1 has read the previous one."""
    path = tiny_models["qwen3"]
    d = parse_deployment(f'[[model]]\nid = "q"\npath = "{path}"\nengine = "vllm"\nattention_tp = 2\n')
    reference = load_layers(load_ffn_spec(path), "bfloat16", "fp32", kernels("vllm"))
    with running_pool(resolve(d)) as gen:
        assert [mb.tp for mb in gen.plan.mailboxes] == [2]
        ranks = [RankTransport.attach(gen.plan, "q", r) for r in (0, 1)]
        torch.manual_seed(0)
        inputs = [torch.randn(rows, 128, dtype=torch.bfloat16) for rows in (1, 7, 64, 256) for _ in range(25)]
        outs: dict[int, list[torch.Tensor]] = {0: [], 1: []}

        def run(r: int) -> None:
            for i, x in enumerate(inputs):
                if r == 1 and i % 10 == 0:
                    time.sleep(0.01)  # a slow follower: the leader must wait for it
                out = torch.empty_like(x)
                ranks[r].call(i % 2, x, out)
                outs[r].append(out)

        threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1], strict=True))
        assert all(torch.equal(o, reference[i % 2](x)) for i, (x, o) in enumerate(zip(inputs, outs[0], strict=True)))
        assert ranks[0].mailbox.words[W_REQ_SEQ] == ranks[1].seq == len(inputs)  # one publication per call
