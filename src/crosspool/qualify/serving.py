"""`crosspool qualify --serving`: greedy serving per topology through real engines.

Rows: attention (TP, DP) in {(1,1), (2,1), (1,2)} x FFN TP in {1, 2} x executor lanes in {1, 2}
x execution mode (eager, or vLLM's torch.compile), on a tiny random Qwen3 (SmolLM2's tokenizer);
the DP rows serve two models on one pool (FFN TP 1 and 2), concurrently, which is also the "two
models, one pool" row.

Each prompt is generated alone (8 prompts x 72 greedy tokens), so batch composition never
changes the arithmetic. A row must be token-identical to the configuration that does the same
arithmetic: native vLLM with the same attention TP and mode when FFN TP equals attention TP
(vLLM's own TP splits the MLP the same way), and the CrossPool single-rank row with the same FFN
TP, lanes and mode for DP rows. Where no native configuration does the same arithmetic (FFN TP != attention TP), the
first step's logits must meet the FFN tolerances against native (normalised RMSE
<= 0.01, max scaled error <= 0.10) and the verdict reports each prompt's identical greedy prefix.
Structure: every row makes >= 1,000 layer calls with no failure in the generation.

One context-parallel row (eager, lanes 1): SGLang zigzag prefill CP 2 through CrossPool, token-
identical to native SGLang at CP 1, with both CP ranks having split a batch.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import torch

from crosspool import envs
from crosspool.config import parse_deployment
from crosspool.daemon.daemon import running_pool
from crosspool.integrations import launcher
from crosspool.integrations.offline import generate_in_child, side_by_side
from crosspool.integrations.sglang.cp import CP_SPLIT
from crosspool.ipc import bind_port
from crosspool.qualify.ffn import MAX_NRMSE, MAX_SCALED, STRUCTURAL_CALLS, errors
from crosspool.resolve import resolve
from crosspool.transport.mailbox import W_REQ_SEQ, Mailbox

PROMPTS, TOKENS, MAX_BATCHED = 8, 72, 512  # 8 x 72 decode steps x 2 layers > 1,000 layer calls


@dataclass(frozen=True)
class Row:
    attention_tp: int
    attention_dp: int
    ffn_tp: int
    lanes: int
    mode: str  # "eager" or "compile"

    @property
    def name(self) -> str:
        topology = f"attn-tp{self.attention_tp}-dp{self.attention_dp}/ffn-tp{self.ffn_tp}"
        return f"{topology}/lanes{self.lanes}/{self.mode}"

    @property
    def model_id(self) -> str:
        return f"tp{self.attention_tp}dp{self.attention_dp}f{self.ffn_tp}"


MODES = ("eager", "compile")
MATRIX = [
    Row(tp, dp, f, lanes, mode)
    for mode in MODES
    for lanes in (1, 2)
    for tp, dp in ((1, 1), (2, 1), (1, 2))
    for f in (1, 2)
]


def prompts(vocab: int, count: int = PROMPTS, seed: int = 0, length: int | None = None) -> list[list[int]]:
    """Seeded random token-id prompts of `length` tokens, default 4 to 39 (tests, qualification and
    benchmarks share them)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length or rng.randrange(4, 40))] for _ in range(count)]


def identical_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def _model(row: Row, path: Path) -> str:
    return (
        f'[[model]]\nid = "{row.model_id}"\npath = "{path}"\nengine = "vllm"\nmax_model_len = 512\n'
        f"enforce_eager = {str(row.mode == 'eager').lower()}\n"
        f"attention_tp = {row.attention_tp}\nattention_dp = {row.attention_dp}\nffn_tp = {row.ffn_tp}\n"
    )


def _pool(rows: list[Row], path: Path, lanes: int) -> str:
    agents = "".join(f'[[ffn_agent]]\nid = "ffn{i}"\nlanes = {lanes}\n' for i in range(2))
    return f"[limits]\nmax_batched_tokens = {MAX_BATCHED}\n{agents}" + "".join(_model(r, path) for r in rows)


def _offline(model: Any, work: list[list[int]], plan_path: Path | None, cpus: list[int], *, logits: bool) -> dict:
    """Greedy tokens of each prompt generated alone, and with `logits` its first-step logits."""
    first, batches = (work if logits else None), [[p] for p in work]
    result = generate_in_child(model, MAX_BATCHED, batches, TOKENS, plan_path, first_logits=first, cpus=cpus)
    return {"tokens": [run["tokens"][0] for run in result["runs"]], "logits": result.get("first_logits")}


def native_references(path: Path, work: list[list[int]], mode: str) -> dict[int, dict]:
    """Native vLLM at attention TP 1 and 2 in `mode`: tokens and first-step logits per prompt."""
    models = {tp: parse_deployment(_pool([Row(tp, 1, 1, 1, mode)], path, 1)).model[0] for tp in (1, 2)}
    runs = side_by_side([partial(_offline, m, work, None, logits=True) for m in models.values()])
    return dict(zip(models, runs, strict=True))


def _verdict(
    row: Row, got: dict, reference: dict, what: str, same_arithmetic: bool, calls: int, failure: str | None
) -> dict[str, Any]:
    """Tokens identical to a reference doing the same arithmetic; otherwise first-step logits
    within the FFN tolerances (both sides carry them then)."""
    prefixes = [identical_prefix(a, b) for a, b in zip(got["tokens"], reference["tokens"], strict=True)]
    verdict: dict[str, Any] = {"case": f"serving/{row.name}", "reference": what, "identical_prefix": prefixes}
    ok = calls >= STRUCTURAL_CALLS and failure is None
    verdict.update(layer_calls=calls, failure=failure)
    if not same_arithmetic:
        worst = {"nrmse": 0.0, "max_scaled": 0.0}
        for ours, theirs in zip(got["logits"], reference["logits"], strict=True):
            e = errors(torch.tensor(ours), torch.tensor(theirs))
            worst = {k: max(worst[k], e[k]) for k in worst}
        verdict["first_step_logits"] = {k: round(v, 6) for k, v in worst.items()}
        ok = ok and worst["nrmse"] <= MAX_NRMSE and worst["max_scaled"] <= MAX_SCALED
    else:
        ok = ok and got["tokens"] == reference["tokens"]
    verdict["pass"] = ok
    return verdict


def single_rank_rows(
    path: Path, work: list[list[int]], refs: dict[int, dict], lanes: int, mode: str
) -> Iterator[tuple]:
    """Attention (1,1) and (2,1) x FFN TP {1, 2}: offline engines side by side, each on its own
    model of one pool (an engine that ended its run leaves its slot registered; no other member
    depends on it)."""
    rows = [r for r in MATRIX if (r.lanes, r.mode) == (lanes, mode) and r.attention_dp == 1]
    d = parse_deployment(_pool(rows, path, lanes))
    with running_pool(resolve(d)) as gen:

        def run(row: Row, model: Any, cpus: list[int]) -> tuple:
            (mailbox_plan,) = gen.plan.mailboxes_of(row.model_id)
            mailbox = Mailbox.open(mailbox_plan.name)
            same = row.ffn_tp == row.attention_tp  # vLLM's TP splits its MLP as FFN TP does
            got = _offline(model, work, gen.plan_path, cpus, logits=not same)
            calls = mailbox.words[W_REQ_SEQ]  # the run ended without error: no call failed
            what = f"native TP{row.attention_tp} {mode}"
            return row, got, _verdict(row, got, refs[row.attention_tp], what, same, calls, None)

        yield from side_by_side([partial(run, r, m) for r, m in zip(rows, d.model, strict=True)])


@contextlib.contextmanager
def _daemon(text: str) -> Iterator[tuple[str, str, Path]]:
    """`crosspool daemon` on a deployment file, as a user runs it: (front URL, control URL, its
    log); stopped (and killed if need be) after."""
    with tempfile.TemporaryDirectory(prefix="crosspool-qualify-") as tmp:
        port, control = bind_port("127.0.0.1"), bind_port("127.0.0.1")
        file = Path(tmp) / "dp.toml"
        file.write_text(f'name = "qualify"\nport = {port}\ncontrol_port = {control}\n' + text)
        log = Path(tmp) / "daemon.log"
        with log.open("w") as stderr:
            argv = [sys.executable, "-m", "crosspool", "daemon", str(file)]
            # The daemon stops (SIGTERM) if this process dies, even by SIGKILL.
            env = {**os.environ, envs.SUPERVISOR_PID: str(os.getpid())}
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
        try:
            line = proc.stdout.readline() if proc.stdout else ""
            if not line.startswith("crosspool: ready"):
                text = log.read_text()
                failures = [line for line in text.splitlines() if line.startswith("crosspool: failure")]
                raise RuntimeError(f"qualify: the deployment did not start: {failures}\n{text[-3000:]}")
            yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{control}", log
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _served_tokens(url: str, model: str, work: list[list[int]]) -> list[list[int]]:
    tokens = []
    for prompt in work:  # one at a time: each request alone in its DP rank's batch
        body = {"model": model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json={**body, "return_token_ids": True}, timeout=300)
        r.raise_for_status()
        tokens.append(r.json()["choices"][0]["token_ids"])
    return tokens


def data_parallel_rows(
    path: Path, work: list[list[int]], single: dict[tuple[int, int, str], dict], lanes: int, mode: str
) -> list[dict[str, Any]]:
    """Attention DP 2 x FFN TP {1, 2}: two models on one pool, served concurrently over HTTP.
    Returns rather than yields, so the daemon is always stopped before a caller sees a verdict."""
    rows = [r for r in MATRIX if (r.lanes, r.mode) == (lanes, mode) and r.attention_dp == 2]
    verdicts: list[dict[str, Any]] = []
    with _daemon(_pool(rows, path, lanes)) as (url, control, _):
        got: dict[str, list[list[int]]] = {}
        threads = [
            threading.Thread(target=lambda r=r: got.__setitem__(r.model_id, _served_tokens(url, r.model_id, work)))
            for r in rows
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=1200)
        status = httpx.get(control + "/status", timeout=10).json()
        executed = _settled_executed(control)
    for row in rows:
        if row.model_id not in got:
            verdicts.append({"case": f"serving/{row.name}", "pass": False, "failure": status.get("failure")})
            continue
        calls = executed.get(row.model_id, 0) // row.ffn_tp
        what = f"CrossPool attn-tp1 ffn-tp{row.ffn_tp} {mode}"  # a DP rank computes a request as one rank does
        reference, failure = single[row.ffn_tp, lanes, mode], status.get("failure")
        verdict = _verdict(row, {"tokens": got[row.model_id]}, reference, what, True, calls, failure)
        verdicts.append({**verdict, "concurrent_models": [r.model_id for r in rows]})
    return verdicts


def _settled_executed(control: str, timeout_s: float = 15.0) -> dict[str, int]:
    """The executed counts once they stop moving: agents report them with their heartbeats."""
    deadline = time.monotonic() + timeout_s
    previous = executed_per_model(httpx.get(control + "/metrics", timeout=10).text)
    while time.monotonic() < deadline:
        time.sleep(1.5)
        current = executed_per_model(httpx.get(control + "/metrics", timeout=10).text)
        if current == previous:
            break
        previous = current
    return previous


def executed_per_model(metrics: str) -> dict[str, int]:
    """crosspool_ffn_executed_total per model, summed over agents."""
    out: dict[str, int] = {}
    for line in metrics.splitlines():
        if line.startswith("crosspool_ffn_executed_total{"):
            labels, value = line.rsplit(" ", 1)
            model = labels.split('model="', 1)[1].split('"', 1)[0]
            out[model] = out.get(model, 0) + int(float(value))
    return out


CP_CASE = "serving/sglang/attn-cp2-zigzag/ffn-tp1/lanes1/eager"
CP_MODEL = (
    'engine = "sglang"\nmax_model_len = 1024\nattention_tp = 2\ndtype = "float32"\n'
    'engine_args = { attn_cp_size = 2, enable_prefill_cp = true, cp_strategy = "zigzag" }\n'
)
"""The CP model as examples/context-parallel.toml serves it. float32: in bf16 CP changes the row
counts of the attention projections' GEMMs (each rank projects its own tokens), whose rounding
depends on the row count, and greedy tokens of the random model drift from CP 1's."""


def context_parallel_row(path: Path, work: list[list[int]]) -> dict[str, Any]:
    """SGLang zigzag prefill CP 2 served through CrossPool over HTTP against native SGLang at CP 1:
    every prompt (4 tokens or more) is split over the two CP ranks at prefill; the MLP rows SGLang
    gathers reach the pool once per layer. The greedy tokens must be identical."""
    from crosspool.bench.overhead import START_TIMEOUT_S, native_server, wait_ready  # bench imports this module

    text = f'[limits]\nmax_batched_tokens = {MAX_BATCHED}\n[[ffn_agent]]\nid = "ffn0"\n'
    text += f'[[model]]\nid = "cp2"\npath = "{path}"\n{CP_MODEL}'
    with _daemon(text) as (url, control, log):
        got = _served_tokens(url, "cp2", work)
        failure = httpx.get(control + "/status", timeout=10).json().get("failure")
        calls = _settled_executed(control).get("cp2", 0)
        split_ranks = log.read_text().count(CP_SPLIT)
    cp2 = parse_deployment(text).model[0]
    native = cp2.model_copy(update={"attention_tp": 1, "rank_cpus": [[0]], "engine_args": {}})
    with tempfile.TemporaryDirectory(prefix="crosspool-qualify-") as tmp:
        log = Path(tmp) / "native.log"
        with log.open("w") as sink, native_server(native, [[0]], sink, "native-cp1") as side:
            wait_ready([side], log, time.monotonic() + START_TIMEOUT_S)
            reference = _served_tokens(side.url, "cp2", work)
    prefixes = [identical_prefix(a, b) for a, b in zip(got, reference, strict=True)]
    ok = got == reference and calls >= STRUCTURAL_CALLS and failure is None and split_ranks == 2
    return {
        "case": CP_CASE,
        "reference": "native SGLang CP 1 (attention TP 1) eager",
        "identical_prefix": prefixes,
        "layer_calls": calls,
        "cp_ranks_that_split": split_ranks,
        "failure": failure,
        "pass": ok,
    }


def _with_cp_row(lanes_options: tuple[int, ...], modes: tuple[str, ...]) -> bool:
    """Eager, lanes 1, and where CrossPool serves SGLang (not on an AMX host with a real sgl_kernel)."""
    return 1 in lanes_options and "eager" in modes and not launcher("sglang").host_problems()


def planned_cases(lanes_options: tuple[int, ...], modes: tuple[str, ...]) -> list[str]:
    cp = [CP_CASE] if _with_cp_row(lanes_options, modes) else []
    return [f"serving/{row.name}" for row in MATRIX if row.lanes in lanes_options and row.mode in modes] + cp


def qualify_serving(
    path: Path, lanes_options: tuple[int, ...] = (1, 2), modes: tuple[str, ...] = MODES
) -> Iterator[dict[str, Any]]:
    """The verdicts of `planned_cases(lanes_options, modes)`, as they come."""
    import transformers

    vocab = len(transformers.AutoTokenizer.from_pretrained(path))
    work = prompts(vocab)
    single: dict[tuple[int, int, str], dict] = {}
    for mode in modes:
        refs = native_references(path, work, mode)
        for lanes in lanes_options:
            for row, got, verdict in single_rank_rows(path, work, refs, lanes, mode):
                yield verdict
                if row.attention_tp == 1:
                    single[row.ffn_tp, lanes, mode] = got
            yield from data_parallel_rows(path, work, single, lanes, mode)
    if _with_cp_row(lanes_options, modes):
        yield context_parallel_row(path, work)


def default_model() -> Path:
    from crosspool.models.prepare import make_tiny_checkpoint, prepare_smollm2

    cache = envs.cache_root() / "tiny"
    return make_tiny_checkpoint("qwen3", cache / "tiny-qwen3-tok", seed=0, tokenizer=prepare_smollm2())
