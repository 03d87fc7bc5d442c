"""`crosspool qualify --all` as CI runs it: real FFN pool (FFN TP 1 and 2) against the families'
own transformers MLP / MoE modules, MoE routing, and 1,000-call structural runs."""

from __future__ import annotations

import json
import subprocess
import sys


def test_qualify_all_passes(tiny_models, smollm2, no_leftovers):
    r = subprocess.run(
        [sys.executable, "-m", "crosspool", "qualify", "--all"], capture_output=True, text=True, timeout=900
    )
    verdicts = [json.loads(line) for line in r.stdout.splitlines()]
    assert r.returncode == 0, [v for v in verdicts if not v["pass"]] or r.stderr[-3000:]
    cases = {v["case"] for v in verdicts}
    # dense: 4 models x TP {1, 2} x layers {first, last} x rows {1, 32, 4096}, plus a structural run;
    # MoE (3 layers, all checked): 2 models x TP {1, 2} x (3 x 3 + 1), plus routing per MoE layer x rows
    routing = 3 * (1 + 2)  # Qwen3-MoE has one MoE layer, DeepSeek-V2 two
    assert len(cases) == 4 * 2 * (2 * 3 + 1) + 2 * 2 * (3 * 3 + 1) + routing
    assert "ffn-numerics/smollm2-135m/tp2/layer29/rows4096" in cases
    assert "ffn-numerics/tiny-deepseek_v2/tp2/layer1/rows4096" in cases
    assert "moe-routing/tiny-qwen3_moe/layer1/rows4096" in cases
    assert all(v["pass"] for v in verdicts)
