"""`crosspool qualify --all --serving --mode eager` as CI runs it: real FFN pool (FFN TP 1 and 2)
against the families' own transformers MLP / MoE modules with each engine's kernels, MoE routing,
1,000-call structural runs, and the serving topology matrix through real vLLM engines (attention
TP/DP x FFN TP x lanes 1 and 2). The compile-mode rows run in `crosspool qualify --serving`
(CI time); compile-mode token identity is in test_vllm_tokens.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(3000)  # ~20 min on a 2-core host: FFN cases, then engines for the serving rows
def test_qualify_all_passes(tiny_models, smollm2, no_leftovers, tmp_path):
    argv = [sys.executable, "-m", "crosspool", "qualify", "--all", "--serving", "--mode", "eager"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=3000)
    (tmp_path / "qualify.jsonl").write_text(r.stdout)  # the run's raw verdicts, kept by pytest's tmp dirs
    verdicts = [json.loads(line) for line in r.stdout.splitlines()]
    assert r.returncode == 0, [v for v in verdicts if not v["pass"]] or r.stderr[-3000:]
    cases = {v["case"] for v in verdicts}
    # dense, per engine serving the family (vLLM: 4 models, SGLang: Llama, Qwen2, Qwen3, SmolLM2):
    #   TP {1, 2} x layers {first, last} x rows {1, 32, 4096}, plus a structural run;
    # MoE (vLLM; 3 layers, all checked): 2 models x TP {1, 2} x (3 x 3 + 1), plus routing per MoE layer x rows
    routing = 3 * (1 + 2)  # Qwen3-MoE has one MoE layer, DeepSeek-V2 two
    serving = 3 * 2 * 2  # attention (TP, DP) in {(1,1), (2,1), (1,2)} x FFN TP {1, 2} x lanes {1, 2}
    assert len(cases) == (4 + 4) * 2 * (2 * 3 + 1) + 2 * 2 * (3 * 3 + 1) + routing + serving
    assert "ffn-numerics/vllm/smollm2-135m/tp2/layer29/rows4096" in cases
    assert "ffn-numerics/sglang/smollm2-135m/tp2/layer29/rows4096" in cases
    assert "ffn-numerics/vllm/tiny-deepseek_v2/tp2/layer1/rows4096" in cases
    assert "moe-routing/vllm/tiny-qwen3_moe/layer1/rows4096" in cases
    rows = [v for v in verdicts if v["case"].startswith("serving/")]
    assert all(v["layer_calls"] >= 1000 for v in rows)
    identical = [v for v in rows if v["case"].startswith("serving/attn-tp2-dp1/ffn-tp2/")]
    assert len(identical) == 2 and all(v["identical_prefix"] == [72] * 8 for v in identical)  # native TP 2
    two_models = [v for v in rows if "concurrent_models" in v]  # the DP rows: two models on one pool
    assert len(two_models) == 4 and all(len(v["concurrent_models"]) == 2 for v in two_models)
    assert all(v["pass"] for v in verdicts)
