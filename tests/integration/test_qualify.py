"""`crosspool qualify --all` as CI runs it: real FFN pool (FFN TP 1 and 2) against the families'
own transformers MLPs, and 1,000-call structural runs."""

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
    # 4 models x TP {1, 2} x layers {first, last} x rows {1, 32, 4096}, plus one structural run each
    assert len(cases) == 4 * 2 * (2 * 3 + 1)
    assert "ffn-numerics/smollm2-135m/tp2/layer29/rows4096" in cases
    assert all(v["pass"] for v in verdicts)
