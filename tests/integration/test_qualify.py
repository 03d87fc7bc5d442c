"""`crosspool qualify --all --serving --mode eager --lanes 1` as CI runs it: a real FFN pool (FFN TP
1 and 2) against the families' own transformers MLP / MoE modules with each engine's kernels, MoE
routing, 1,000-call structural runs, and the serving topology matrix through real vLLM engines
(attention TP/DP x FFN TP, executor lanes 1) and SGLang prefill CP 2. Its other half (lanes 2,
compile mode) runs outside CI as `crosspool qualify --serving` (evidence in docs/evidence);
executor lanes 2 serve in CI in test_deployments.py (two engines on one pool) and compile mode in
test_vllm_tokens.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from crosspool.integrations.sglang.launch import host_problems

pytestmark = pytest.mark.engine
ARGS = ["--all", "--serving", "--mode", "eager", "--lanes", "1"]


@pytest.mark.timeout(3000)  # FFN cases, then engines for the serving rows
def test_qualify_all_passes(tiny_models, smollm2, no_leftovers, tmp_path):
    qualify = [sys.executable, "-m", "crosspool", "qualify", *ARGS]
    planned = json.loads(subprocess.run([*qualify, "--list"], capture_output=True, text=True, check=True).stdout)
    r = subprocess.run(qualify, capture_output=True, text=True, timeout=3000)
    (tmp_path / "qualify.jsonl").write_text(r.stdout)  # the run's raw verdicts, kept by pytest's tmp dirs
    verdicts = [json.loads(line) for line in r.stdout.splitlines()]
    assert r.returncode == 0, [v for v in verdicts if not v["pass"]] or r.stderr[-3000:]
    assert [v["case"] for v in verdicts] == planned  # every planned case ran, once, in order
    # the matrix as planned: every family with each engine serving it, MoE routing, the topologies
    assert "ffn-numerics/vllm/smollm2-135m/tp2/layer29/rows4096" in planned
    assert "ffn-numerics/sglang/smollm2-135m/tp2/layer29/rows4096" in planned
    assert "ffn-numerics/vllm/tiny-deepseek_v2/tp2/layer1/rows4096" in planned
    assert "moe-routing/vllm/tiny-qwen3_moe/layer1/rows4096" in planned
    assert not any("/sglang/tiny-qwen3_moe/" in case for case in planned)  # SGLang serves no MoE family
    rows = [v for v in verdicts if v["case"].startswith("serving/")]
    sglang_served = not host_problems()  # an AMX host with a real sgl_kernel: no SGLang, no CP row
    assert len(rows) == 6 + sglang_served and all(v["layer_calls"] >= 1000 for v in rows)
    cps = [v for v in rows if "/attn-cp2-zigzag/" in v["case"]]  # SGLang prefill CP 2 vs native CP 1
    assert len(cps) == sglang_served
    assert all(cp["identical_prefix"] == [72] * 8 and cp["cp_ranks_that_split"] == 2 for cp in cps)
    identical = [v for v in rows if v["case"].startswith("serving/attn-tp2-dp1/ffn-tp2/")]
    assert len(identical) == 1 and identical[0]["identical_prefix"] == [72] * 8  # native TP 2
    two_models = [v for v in rows if "concurrent_models" in v]  # the DP rows: two models on one pool
    assert len(two_models) == 2 and all(len(v["concurrent_models"]) == 2 for v in two_models)
