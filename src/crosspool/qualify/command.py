"""`crosspool qualify`: FFN numerics, MoE routing and structure through a real FFN pool
(qualify/ffn.py), and with `--serving` the serving topology matrix through real engines
(qualify/serving.py).

The cases are planned from the matrix before anything runs (`--list` prints them); a planned
case that produced no verdict is reported as failed, and so is a verdict nobody planned. One
JSON verdict per case on stdout; the exit code is non-zero if any case fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from crosspool import host
from crosspool.integrations import ENGINES, launcher
from crosspool.ipc import sigterm_unwinds
from crosspool.models.spec import load_ffn_spec
from crosspool.qualify import ffn, serving


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(
        prog="crosspool qualify", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="every family (tiny Llama, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V2) and SmolLM2-135M",
    )
    p.add_argument("--model", type=Path, action="append", default=[], help="a checkpoint dir (repeatable)")
    p.add_argument(
        "--engine",
        choices=ENGINES,
        action="append",
        help="FFN numerics with this engine's kernels, for the families it serves (repeatable; default: all)",
    )
    p.add_argument(
        "--serving",
        action="store_true",
        help="also the serving topology matrix through real engines: vLLM topologies and SGLang prefill CP "
        "(crosspool.qualify.serving)",
    )
    p.add_argument(
        "--lanes",
        type=int,
        choices=(1, 2),
        action="append",
        help="only the serving rows with these executor lanes (repeatable; default: 1 and 2)",
    )
    p.add_argument(
        "--mode",
        choices=("eager", "compile"),
        action="append",
        help="only the serving rows in this vLLM execution mode (repeatable; default: both)",
    )
    p.add_argument("--list", action="store_true", help="print the planned case names (JSON) and run nothing")
    p.add_argument(
        "--out", type=Path, default=None, help="also write a JSON report: host, arguments, summary, verdicts"
    )
    args = p.parse_args(argv)
    sigterm_unwinds()
    for path in args.model:
        if not (path / "config.json").is_file():
            p.error(f"--model {path}: not a checkpoint directory (no config.json)")
    models = {path.name: path for path in args.model}
    if args.all or not models:
        models = {**ffn.default_models(), **models}
    specs = {name: load_ffn_spec(path) for name, path in models.items()}
    engines = tuple(dict.fromkeys(args.engine)) if args.engine else ENGINES
    for engine in engines:
        for problem in launcher(engine).host_problems():
            print(f"crosspool qualify: {engine} left out on this host: {problem}", file=sys.stderr)
    for name, spec in specs.items():
        if not ffn.engines_of(spec, engines):
            p.error(f"{name}: {spec.architecture} is served by none of {', '.join(engines)} on this host")
    lanes = tuple(sorted(set(args.lanes))) if args.lanes else (1, 2)
    modes = tuple(dict.fromkeys(args.mode)) if args.mode else ("eager", "compile")
    planned = ffn.planned_cases(specs, engines) + (serving.planned_cases(lanes, modes) if args.serving else [])
    if args.list:
        print(json.dumps(planned, indent=1))
        return 0
    verdicts: list[dict[str, Any]] = []
    runs = [ffn.qualify(specs, engines)]
    if args.serving:
        runs.append(serving.qualify_serving(serving.default_model(), lanes, modes))
    for run in runs:
        for verdict in run:
            verdicts.append(verdict)
            print(json.dumps(verdict), flush=True)
    seen = {v["case"] for v in verdicts}
    for case in (c for c in planned if c not in seen):
        verdicts.append({"case": case, "pass": False, "failure": "planned but not run"})
        print(json.dumps(verdicts[-1]), flush=True)
    for verdict in (v for v in verdicts if v["case"] not in planned):
        verdict.update({"pass": False, "failure": "not a planned case"})
        print(json.dumps(verdict), flush=True)
    failed = [v["case"] for v in verdicts if not v["pass"]]
    print(f"crosspool qualify: {len(verdicts) - len(failed)} of {len(verdicts)} cases pass", file=sys.stderr)
    if args.out:
        summary = {"cases": len(verdicts), "passed": len(verdicts) - len(failed), "failed": failed}
        report = {"host": host.describe(), "argv": argv, "summary": summary, "verdicts": verdicts}
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
