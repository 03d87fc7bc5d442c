"""`crosspool qualify` plans its cases from the matrix before anything runs, and refuses a model
that no engine would qualify on this host instead of dropping it."""

from __future__ import annotations

import json
import subprocess
import sys

from crosspool.integrations.sglang.launch import host_problems
from crosspool.qualify import serving


def _qualify(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "crosspool", "qualify", *args], capture_output=True, text=True)


def test_serving_rows_are_the_matrix():
    assert len(serving.MATRIX) == 3 * 2 * 2 * 2  # attention (TP, DP) x FFN TP x lanes x mode
    eager_lanes1 = serving.planned_cases((1,), ("eager",))
    sglang_served = not host_problems()  # an AMX host with a real sgl_kernel: no SGLang, no CP row
    assert len(eager_lanes1) == 6 + sglang_served and all(c.endswith("/lanes1/eager") for c in eager_lanes1)
    assert (eager_lanes1[-1] == serving.CP_CASE) == sglang_served  # the SGLang prefill-CP row, eager and lanes 1
    assert serving.CP_CASE not in serving.planned_cases((2,), ("eager", "compile"))


def test_a_model_no_engine_serves_is_refused(tiny_models):
    r = _qualify("--model", str(tiny_models["qwen3_moe"]), "--engine", "sglang", "--list")
    assert r.returncode == 2 and "tiny-qwen3_moe: Qwen3MoeForCausalLM is served by none of sglang" in r.stderr
    r = _qualify("--model", str(tiny_models["qwen3_moe"]), "--list")
    planned = json.loads(r.stdout)
    assert r.returncode == 0 and planned and all("/vllm/tiny-qwen3_moe/" in case for case in planned)
