"""The context-parallel harness: real rank processes of one Instance DP group hand the pool the rows
the engines' own CP partition functions give them (SGLang zigzag and interleave prefill CP, vLLM
prefill CP with a decode on every rank), through a local-row mailbox. Each rank must get back
exactly the rows one rank holding the whole batch gets from the pool, bit for bit: a row that
reaches the wrong rank, or a rank left out of a call, fails the test."""

from __future__ import annotations

import multiprocessing
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np
import pytest
import torch

from conftest import assert_nothing_left, leftover_files
from crosspool.config import parse_deployment
from crosspool.daemon.daemon import running_pool
from crosspool.integrations.sglang.cp import prefill_cp_shares as sglang_shares
from crosspool.integrations.vllm.cp import prefill_cp_shares as vllm_shares
from crosspool.plan import Plan
from crosspool.resolve import Resolved, resolve
from crosspool.transport import _calls as calls
from crosspool.transport.errors import FfnCallRejected, RankDisagreement
from crosspool.transport.mailbox import RankLayout, RankTransport, RowShare

HIDDEN = 128  # the tiny checkpoints'
LAYERS = (0, 1)


@dataclass(frozen=True)
class LocalRows(Resolved):
    """The plan an integration admitting a local-row CP mode makes: the mailboxes of the models
    named `cp*` hold local rows (their attention_tp ranks are the CP ranks of one DP group)."""

    def plan(self, generation: int = 1) -> Plan:
        plan = super().plan(generation)
        boxes = [mb.model_copy(update={"local_rows": mb.model.startswith("cp")}) for mb in plan.mailboxes]
        return plan.model_copy(update={"mailboxes": boxes})


def _model(model_id: str, path: object, **extra: object) -> str:
    return f'[[model]]\nid = "{model_id}"\npath = "{path}"\nengine = "vllm"\nffn_agent = "ffn0"\n' + "".join(
        f"{k} = {v!r}\n" for k, v in extra.items()
    )


@pytest.fixture(scope="module")
def pool(tiny_models):
    """One FfnAgent; per FFN kind a single-rank reference model and CP 2 / CP 4 local-row models."""
    files_before = leftover_files()
    dense, moe = tiny_models["qwen3"], tiny_models["qwen3_moe"]
    d = parse_deployment(
        '[limits]\nmax_batched_tokens = 256\nffn_timeout_s = 5\n[[ffn_agent]]\nid = "ffn0"\n'
        + _model("dense", dense)
        + _model("cp2-dense", dense, attention_tp=2)
        + _model("cp4-dense", dense, attention_tp=4)
        + _model("moe", moe)
        + _model("cp2-moe", moe, attention_tp=2)
    )
    resolved = resolve(d)
    with running_pool(LocalRows(**vars(resolved))) as gen:
        assert [mb.local_rows for mb in gen.plan.mailboxes] == [False, True, True, False, True]
        yield gen
    assert_nothing_left(files_before, 20)


def _run_rank(layout: RankLayout, calls_in: list[tuple[int, bytes, RowShare]], results: Connection) -> None:
    """A rank process: its layer calls, in order; each answer's bytes back to the test (a pipe:
    a multiprocessing queue would leave its named semaphore in /dev/shm)."""
    rank = RankTransport(layout)
    answers = []
    for layer, rows, share in calls_in:
        x = torch.frombuffer(bytearray(rows), dtype=torch.bfloat16).view(-1, HIDDEN)
        out = torch.empty_like(x)
        rank.call(layer, x, out, share)
        answers.append(out.view(torch.int16).numpy().tobytes())
    results.send(answers)


def _reference(gen, model: str, x: torch.Tensor) -> list[torch.Tensor]:
    rank = RankTransport(gen.plan.rank_layout(model, 0))
    outs = []
    for layer in LAYERS:
        out = torch.empty_like(x)
        rank.call(layer, x, out)
        outs.append(out)
    return outs


CASES = {
    "sglang-zigzag-cp2": ("dense", 2, lambda: sglang_shares("zigzag", 2, [9, 17, 5])),
    "sglang-zigzag-cp4": ("dense", 4, lambda: sglang_shares("zigzag", 4, [9, 17, 8, 23])),
    "sglang-interleave-cp2-moe": ("moe", 2, lambda: sglang_shares("interleave", 2, [9, 17, 5])),
    "sglang-zigzag-cp2-moe": ("moe", 2, lambda: sglang_shares("zigzag", 2, [4, 30])),
    "vllm-pcp2-with-decodes": ("dense", 2, lambda: vllm_shares(2, [37, 1, 20, 1], [True, False, True, False])),
    "vllm-pcp2-moe-short-prefill": ("moe", 2, lambda: vllm_shares(2, [3, 41], [True, True])),
}


def _bf16_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.int16).numpy().tobytes()


def _rows_of(share: RowShare) -> torch.Tensor:
    return torch.from_numpy((share.index & ~np.uint32(calls.RECEIVE_ONLY)).astype(np.int64))


@pytest.mark.parametrize("case", CASES)
def test_each_cp_rank_gets_exactly_the_single_rank_rows(pool, case):
    kind, cp, make_shares = CASES[case]
    shares = make_shares()
    assert shares is not None and len(shares) == cp
    total = shares[0].total
    sent = [_rows_of(s)[torch.from_numpy((s.index & np.uint32(calls.RECEIVE_ONLY)) == 0)] for s in shares]
    assert sorted(torch.cat(sent).tolist()) == list(range(total))  # the engine split the batch, once each
    torch.manual_seed(cp * total)
    x = torch.randn(total, HIDDEN, dtype=torch.bfloat16)
    expected = _reference(pool, kind, x)
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in shares]
    procs = [
        ctx.Process(
            target=_run_rank,
            args=(
                pool.plan.rank_layout(f"cp{cp}-{kind}", r),
                [(layer, _bf16_bytes(x[_rows_of(share)]), share) for layer in LAYERS],
                send,
            ),
        )
        for r, (share, (_, send)) in enumerate(zip(shares, pipes, strict=True))
    ]
    for p in procs:
        p.start()
    try:
        assert all(recv.poll(120) for recv, _ in pipes), "a rank process did not answer within 120 s"
        answers = [recv.recv() for recv, _ in pipes]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * cp
    for r, share in enumerate(shares):
        for i, layer in enumerate(LAYERS):
            got = torch.frombuffer(bytearray(answers[r][i]), dtype=torch.int16).view(torch.bfloat16).view(-1, HIDDEN)
            assert torch.equal(got, expected[i][_rows_of(share)]), f"rank {r}, layer {layer}: rows not its own"


def _together(ranks: list[RankTransport], calls_in: list[tuple[int, torch.Tensor, RowShare]]) -> list[str | None]:
    """One call per rank, each on its own thread; the RankDisagreement text of each (None: it worked)."""
    errors: list[str | None] = [None] * len(ranks)

    def run(r: int) -> None:
        layer, x, share = calls_in[r]
        try:
            ranks[r].call(layer, x, torch.empty_like(x), share)
        except RankDisagreement as e:
            errors[r] = str(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return errors


def test_rows_that_break_the_layout_are_a_protocol_error(pool):
    """Two ranks sending one row, a row nobody sends, or another invocation size: every rank's call
    fails (none takes another's answer), and the next good call works."""
    ranks = [RankTransport(pool.plan.rank_layout("cp2-dense", r)) for r in (0, 1)]
    x = torch.randn(6, HIDDEN, dtype=torch.bfloat16)
    good = [RowShare.of([0, 1, 2], 6), RowShare.of([3, 4, 5], 6)]
    overlap = [RowShare.of([0, 1, 2], 6), RowShare.of([2, 4, 5], 6)]
    hole = [RowShare.of([0, 1, 2], 6), RowShare.of([3, 4], 6)]
    unowned_return = [RowShare.of([0, 1, 2, 3], 6, [True, True, True, False]), RowShare.of([4, 5], 6)]
    owned = "do not own the rows of call"
    for shares in (overlap, hole, unowned_return):
        errors = _together(ranks, [(0, x[: s.index.size], s) for s in shares])
        assert all(e is not None and owned in e for e in errors), errors
    sizes = _together(ranks, [(0, x[:3], good[0]), (0, x[:3], RowShare.of([3, 4, 5], 7))])
    assert sizes[0] is None and "is layer 0 with 6 rows on rank 0, layer 0 with 7 rows on rank 1" in (sizes[1] or "")
    assert _together(ranks, [(1, x[:3], good[0]), (1, x[3:], good[1])]) == [None, None]


def test_a_call_must_match_its_mailboxs_layout(pool):
    local = RankTransport(pool.plan.rank_layout("cp2-dense", 0))
    replicated = RankTransport(pool.plan.rank_layout("dense", 0))
    x = torch.zeros(2, HIDDEN, dtype=torch.bfloat16)
    with pytest.raises(FfnCallRejected, match="the mailbox holds local rows: a call needs its RowShare"):
        local.call(0, x, torch.empty_like(x))
    with pytest.raises(FfnCallRejected, match="the mailbox holds replicated rows"):
        replicated.call(0, x, torch.empty_like(x), RowShare.of([0, 1], 2))
    with pytest.raises(FfnCallRejected, match="2 rows with a RowShare of 3 rows out of 3"):
        local.call(0, x, torch.empty_like(x), RowShare.of([0, 1, 2], 3))
    with pytest.raises(FfnCallRejected, match="holds local rows, and a probe has none"):
        local.probe()
