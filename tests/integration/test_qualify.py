"""`crosspool qualify --all --serving --lanes 2` as CI runs it: real FFN pool (FFN TP 1 and 2) against the
families' own transformers MLP / MoE modules, MoE routing, 1,000-call structural runs, and the
serving topology matrix through real vLLM engines (attention TP/DP x FFN TP x lanes)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(3000)  # ~15 min on a 2-core host: FFN cases, then engines for the serving rows
def test_qualify_all_passes(tiny_models, smollm2, no_leftovers):
    r = subprocess.run(
        [sys.executable, "-m", "crosspool", "qualify", "--all", "--serving", "--lanes", "2"],
        capture_output=True,
        text=True,
        timeout=3000,
    )
    verdicts = [json.loads(line) for line in r.stdout.splitlines()]
    assert r.returncode == 0, [v for v in verdicts if not v["pass"]] or r.stderr[-3000:]
    cases = {v["case"] for v in verdicts}
    # dense: 4 models x TP {1, 2} x layers {first, last} x rows {1, 32, 4096}, plus a structural run;
    # MoE (3 layers, all checked): 2 models x TP {1, 2} x (3 x 3 + 1), plus routing per MoE layer x rows
    routing = 3 * (1 + 2)  # Qwen3-MoE has one MoE layer, DeepSeek-V2 two
    assert len(cases) == 4 * 2 * (2 * 3 + 1) + 2 * 2 * (3 * 3 + 1) + routing + 6
    assert "ffn-numerics/smollm2-135m/tp2/layer29/rows4096" in cases
    assert "ffn-numerics/tiny-deepseek_v2/tp2/layer1/rows4096" in cases
    assert "moe-routing/tiny-qwen3_moe/layer1/rows4096" in cases
    serving = [v for v in verdicts if v["case"].startswith("serving/")]
    # attention (TP, DP) in {(1,1), (2,1), (1,2)} x FFN TP {1, 2}, lanes 2 (the DP rows are the
    # two-models-one-pool row); the lanes 1 half runs in `crosspool qualify --serving` (CI time)
    assert len(serving) == 6 and all(v["layer_calls"] >= 1000 for v in serving)
    identical = [v for v in serving if v["case"].startswith("serving/attn-tp2-dp1/ffn-tp2/")]
    assert all(v["identical_prefix"] == [72] * 8 for v in identical)  # native TP 2's arithmetic
    assert all(v["pass"] for v in verdicts)
