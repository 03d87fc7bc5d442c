"""The FFN pool without an engine: real FfnAgent/AtnAgent processes, real shared memory; the test
process plays the Instance ranks. Tests that kill or stop a member get a pool of their own."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from conftest import assert_nothing_left, frozen, leftover_files
from crosspool.agents.ffn.weights import load_layers
from crosspool.config import parse_deployment
from crosspool.daemon.daemon import running_pool
from crosspool.daemon.generation import Generation, Scope
from crosspool.integrations import kernels
from crosspool.models.spec import load_ffn_spec
from crosspool.resolve import resolve
from crosspool.transport.errors import FfnCallRejected, FfnFenced, FfnPeerExited, FfnTimeout, RankDisagreement
from crosspool.transport.mailbox import W_REQ_SEQ, RankTransport, resp_word

HIDDEN = 128  # the tiny checkpoints'


def _model(model_id: str, path: object, **extra: object) -> str:
    return f'[[model]]\nid = "{model_id}"\npath = "{path}"\nengine = "vllm"\n' + "".join(
        f"{k} = {v!r}\n" for k, v in extra.items()
    )


@pytest.fixture(scope="module")
def shared(tiny_models):
    """One pool for the tests that leave it working: three FfnAgents; q pinned to ffn0, p (the
    probe's) to ffn2, spread's layers placed over the agents, q2 / q3 at FFN TP 2 / 3 (256
    intermediate rows: 86/85/85 for three), f2 at FFN TP 2 in float32, tp at attention TP 2."""
    files_before = leftover_files()
    path = tiny_models["qwen3"]
    d = parse_deployment(
        "[limits]\nmax_batched_tokens = 256\nffn_timeout_s = 2\n"
        + "".join(f'[[ffn_agent]]\nid = "ffn{i}"\n' for i in range(3))
        + _model("q", path, ffn_agent="ffn0")
        + _model("p", path, ffn_agent="ffn2")
        + _model("spread", path)
        + _model("q2", path, ffn_tp=2)
        + _model("q3", path, ffn_tp=3)
        + _model("f2", path, ffn_tp=2, dtype="float32")
        + _model("tp", path, attention_tp=2)
    )
    with running_pool(resolve(d)) as gen:
        yield gen
    assert_nothing_left(files_before, 20)


@pytest.fixture
def lone(tiny_models, no_leftovers):
    """A pool of one FfnAgent for a test that kills or stops one of its members."""
    d = parse_deployment("[limits]\nmax_batched_tokens = 256\nffn_timeout_s = 2\n" + _model("q", tiny_models["qwen3"]))
    with running_pool(resolve(d)) as gen:
        yield gen, RankTransport(gen.plan.rank_layout("q", 0))


@pytest.fixture(scope="module")
def reference(tiny_models):
    """Both tiny Qwen3 layers computed in this process with vLLM's kernels (compile-mode activation)."""
    return load_layers(load_ffn_spec(tiny_models["qwen3"]), "bfloat16", "fp32", kernels("vllm"))


def _member(gen: Generation, name: str) -> int:
    return next(m for m in gen.sup.members if m.name == name).proc.pid


def _rows(n: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, dtype=torch.bfloat16)


def test_layer_calls_match_in_process_ffn(shared, reference):
    rank = RankTransport(shared.plan.rank_layout("q", 0))
    torch.manual_seed(0)
    for rows in (1, 3, 64, 256):
        for layer in (0, 1):
            x = _rows(rows)
            out = torch.empty_like(x)
            rank.call(layer, x, out)
            assert torch.equal(out, reference[layer](x))


def test_oversized_or_misshapen_call_is_refused(shared):
    rank = RankTransport(shared.plan.rank_layout("q", 0))
    x = torch.zeros(257, HIDDEN, dtype=torch.bfloat16)
    with pytest.raises(FfnCallRejected, match="carries 257 rows; the mailbox holds 256"):
        rank.call(0, x, torch.empty_like(x))
    x = torch.zeros(4, HIDDEN, dtype=torch.float32)
    with pytest.raises(FfnCallRejected, match=r"expected \[rows, 128\] torch.bfloat16"):
        rank.call(0, x, torch.empty_like(x))


def test_layers_spread_over_agents(shared, reference):
    groups = shared.plan.model("spread").layer_agents
    assert len({g[0] for g in groups}) == 2, groups  # the placement spread the two layers
    rank = RankTransport(shared.plan.rank_layout("spread", 0))
    x = _rows(8)
    for layer in (0, 1):
        out = torch.empty_like(x)
        rank.call(layer, x, out)
        assert torch.equal(out, reference[layer](x))


@pytest.mark.parametrize(("model", "k", "dtype"), [("q2", 2, "bfloat16"), ("q3", 3, "bfloat16"), ("f2", 2, "float32")])
def test_ffn_tensor_parallel(shared, reference, tiny_models, model, k, dtype):
    """The result is the shards' outputs added in shard order in fp32, cast once: bit-equal to
    that sum in process and close to the unsplit FFN."""
    spec, engine = load_ffn_spec(tiny_models["qwen3"]), kernels("vllm")
    assert all(len(group) == k for group in shared.plan.model(model).layer_agents)
    rank = RankTransport(shared.plan.rank_layout(model, 0))
    shards = [load_layers(spec, dtype, "fp32", engine, None, dict.fromkeys((0, 1), (i, k))) for i in range(k)]
    torch.manual_seed(k)
    for rows in (1, 33, 256):
        x = _rows(rows).to(getattr(torch, dtype))
        for layer in (0, 1):
            out = torch.empty_like(x)
            rank.call(layer, x, out)
            expected = shards[0][layer](x).float()
            for shard in shards[1:]:
                expected += shard[layer](x)
            assert torch.equal(out, expected.to(x.dtype))
            ref = reference[layer](x.to(torch.bfloat16)).float()
            assert ((out.float() - ref).norm() / ref.norm()).item() < 0.01


def test_attention_tp_ranks_share_one_call_per_layer(shared, reference):
    """attention_tp = 2: rank 0 publishes, rank 1 reads the same reply; the agent computes each
    call once; rank 0 does not publish its next call before rank 1 has read the previous one."""
    assert [mb.tp for mb in shared.plan.mailboxes_of("tp")] == [2]
    ranks = [RankTransport(shared.plan.rank_layout("tp", r)) for r in (0, 1)]
    first = ranks[0].seq
    torch.manual_seed(0)
    inputs = [_rows(rows) for rows in (1, 7, 64, 256) for _ in range(25)]
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
    assert ranks[0].mailbox.words[W_REQ_SEQ] - first == ranks[1].seq - first == len(inputs)  # one publication each


def test_a_follower_whose_call_differs_fails_instead_of_taking_the_leaders_result(shared):
    """Same layer and row count but one element different, or another layer: the follower's call
    is a protocol error (it still acknowledges, so the leader goes on); the same call works."""
    ranks = [RankTransport(shared.plan.rank_layout("tp", r)) for r in (0, 1)]
    x = _rows(8)
    other = x.clone()
    other[5, 17] += 1
    outs = [torch.empty_like(x) for _ in ranks]

    def both(follower_layer: int, follower_rows: torch.Tensor) -> str | None:
        errors: list[RankDisagreement] = []

        def follow() -> None:
            try:
                ranks[1].call(follower_layer, follower_rows, outs[1])
            except RankDisagreement as e:
                errors.append(e)

        follower = threading.Thread(target=follow)
        follower.start()
        ranks[0].call(0, x, outs[0])
        follower.join(timeout=30)
        return str(errors[0]) if errors else None

    assert "handed the pool other rows than rank 0 for layer 0 (8 rows)" in (both(0, other) or "")
    assert "is layer 0 with 8 rows on rank 0, layer 1 with 8 rows on rank 1" in (both(1, x) or "")
    assert both(0, x) is None and torch.equal(outs[0], outs[1])


def test_probe_is_answered_by_the_agent_without_computing(shared):
    rank = RankTransport(shared.plan.rank_layout("p", 0))
    first = rank.mailbox.words[W_REQ_SEQ]
    before = shared.pool_counters()
    for _ in range(100):
        rank.probe()
    x = _rows(2)
    for _ in range(3):
        rank.call(0, x, torch.empty_like(x))
    assert rank.mailbox.words[W_REQ_SEQ] == rank.mailbox.words[resp_word(0)] == first + 103
    after = shared.pool_counters()  # read from shared memory: exact, no heartbeat to wait for
    assert after.executed[("ffn2", "p")].executed - before.executed[("ffn2", "p")].executed == 3  # probes: none
    assert after.calls["p"].count - before.calls["p"].count == 3
    with frozen(_member(shared, "FfnAgent 'ffn2'")), pytest.raises(FfnTimeout):
        rank.probe()  # nobody else answers for the agent


def test_spinning_ends_compute_alike_and_still_time_out(tiny_models, reference, no_leftovers):
    """Ends on different CPUs watch the mailbox (yielding the CPU) before they sleep, as planned.
    Results are the same bits, and a stopped agent still fails the call within its bound."""
    d = parse_deployment(
        "[limits]\nmax_batched_tokens = 256\nffn_timeout_s = 2\nspin_us = 3000\n"
        + '[[ffn_agent]]\nid = "ffn0"\ncpus = [0]\n'
        + _model("q", tiny_models["qwen3"], rank_cpus=[[1]])
    )
    with running_pool(resolve(d)) as gen:
        assert gen.plan.ffn_agents[0].spin_us == gen.plan.model("q").spin_us == 3000
        rank = RankTransport(gen.plan.rank_layout("q", 0))
        torch.manual_seed(1)
        for rows in (1, 64):
            for layer in (0, 1):
                x = _rows(rows)
                out = torch.empty_like(x)
                rank.call(layer, x, out)
                assert torch.equal(out, reference[layer](x))
        with frozen(_member(gen, "FfnAgent 'ffn0'")), pytest.raises(FfnTimeout):
            rank.call(0, x, torch.empty_like(x))


def test_dead_ffn_agent_is_named(lone):
    gen, rank = lone
    os.kill(_member(gen, "FfnAgent 'ffn0'"), signal.SIGKILL)
    x = torch.zeros(4, HIDDEN, dtype=torch.bfloat16)
    start = time.monotonic()
    with pytest.raises(FfnPeerExited, match=r"FFN pool failed: FfnAgent 'ffn0' \(pid \d+\) exited during layer 1 of q"):
        rank.call(1, x, torch.empty_like(x))
    assert time.monotonic() - start < 2


def _waiting_call(rank: RankTransport, layer: int, x: torch.Tensor) -> tuple[threading.Thread, list[FfnFenced]]:
    """A call on a thread of its own (it waits: its agent is stopped), and the fence errors it got."""
    errors: list[FfnFenced] = []

    def call() -> None:
        try:
            rank.call(layer, x, torch.empty_like(x))
        except FfnFenced as e:
            errors.append(e)

    t = threading.Thread(target=call)
    t.start()
    return t, errors


def test_stopped_ffn_agent_times_out_and_a_fence_fails_a_waiting_call(lone):
    gen, rank = lone
    x = torch.zeros(4, HIDDEN, dtype=torch.bfloat16)
    with frozen(_member(gen, "FfnAgent 'ffn0'")):
        start = time.monotonic()
        with pytest.raises(FfnTimeout, match="FfnAgent 'ffn0' did not answer within 2 s during layer 0 of q"):
            rank.call(0, x, torch.empty_like(x))
        assert time.monotonic() - start < 5
        t, errors = _waiting_call(rank, 1, x)
        time.sleep(0.3)  # the call waits (the agent cannot answer)
        gen.state.fail("test failure", "test")
        gen.fence("test failure")
        t.join(timeout=1)
        assert not t.is_alive() and [str(e) for e in errors] == ["FFN pool failed: test failure during layer 1 of q"]


def test_a_fenced_mailbox_goes_to_the_next_rank_once_the_pool_answered_its_last_call(lone, reference):
    """An Instance restarting alone: its rank's call is published and waiting when the mailbox is
    fenced (the agent is stopped, so the call is not claimed yet). The mailbox is not handed on
    until the agent claimed that call and answered it without computing; then the next rank's
    calls continue the sequence and get the FFN's result."""
    gen, rank = lone
    index, mailbox = gen.plan.mailboxes[0].index, gen.mailboxes[0]
    scope = Scope(("q",))
    x = _rows(4)
    out = torch.empty_like(x)
    rank.call(0, x, out)
    inbox = gen.inbox("ffn0")
    executed = inbox.agent_stats(index).executed
    with frozen(_member(gen, "FfnAgent 'ffn0'")):
        t, errors = _waiting_call(rank, 1, x)
        while mailbox.words[W_REQ_SEQ] != rank.seq or rank.seq < 2:
            time.sleep(0.01)
        mailbox.fence("Instance 'q' rank 0 exited")
        t.join(timeout=1)
        assert not t.is_alive() and len(errors) == 1
        time.sleep(0.2)
        assert not gen.mailbox_answered(index, mailbox, scope)  # the stopped agent has not seen the call
    end = time.monotonic() + 5
    while not gen.mailbox_answered(index, mailbox, scope):
        assert time.monotonic() < end, "the agent never answered the fenced call"
        time.sleep(0.05)
    assert mailbox.words[resp_word(0)] == rank.seq and inbox.agent_stats(index).executed == executed  # not computed
    mailbox.reset()
    successor = RankTransport(gen.plan.rank_layout("q", 0))
    for layer in (0, 1):
        successor.call(layer, x, out)
        assert torch.equal(out, reference[layer](x))
    assert successor.seq == rank.seq + 2


def test_dead_atn_agent_fences_the_transport(lone):
    gen, rank = lone
    os.kill(_member(gen, "AtnAgent 'atn0'"), signal.SIGKILL)
    assert gen.supervise() is not None  # returns at the first member failure, having fenced every mailbox
    x = torch.zeros(4, HIDDEN, dtype=torch.bfloat16)
    with pytest.raises(FfnFenced, match="FFN pool failed: AtnAgent 'atn0' killed by SIGKILL"):
        rank.call(0, x, torch.empty_like(x))
