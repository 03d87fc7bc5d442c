"""`crosspool <command>`: serve, config check, models prepare/tiny/spec, bench."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from crosspool.config import ConfigError


def _fail(message: str, code: int = 2) -> int:
    for line in message.splitlines():
        print(f"crosspool: error: {line}", file=sys.stderr)
    return code


def cmd_serve(args: argparse.Namespace) -> int:
    from crosspool.daemon.serve import serve
    from crosspool.plan import plan_deployment

    deployment, _, plan = plan_deployment(args.file)
    return serve(deployment, plan)


def cmd_config_check(args: argparse.Namespace) -> int:
    from crosspool.plan import plan_deployment

    deployment, specs, _ = plan_deployment(args.file)
    resolved = deployment.model_dump(mode="json")
    resolved["digest"] = deployment.digest()
    resolved["ffn"] = {
        m.id: {
            "architecture": specs[m.id].architecture,
            "layers": len(specs[m.id].layers),
            "ffn_weight_mib": round(specs[m.id].weight_bytes(m.dtype) / 2**20, 2),
            "ffn_agent": deployment.ffn_of(m),
            "attention_device": deployment.attention_of(m),
        }
        for m in deployment.model
    }
    print(json.dumps(resolved, indent=2))
    return 0


def cmd_models_prepare(args: argparse.Namespace) -> int:
    from crosspool.models.prepare import prepare_smollm2

    print(prepare_smollm2(args.cache) if args.cache else prepare_smollm2())
    return 0


def cmd_models_tiny(args: argparse.Namespace) -> int:
    from crosspool.models.prepare import make_tiny_checkpoint

    print(make_tiny_checkpoint(args.family, args.out, seed=args.seed, layers=args.layers))
    return 0


def cmd_models_spec(args: argparse.Namespace) -> int:
    from crosspool.models.spec import ModelSpecError, load_ffn_spec

    try:
        spec = load_ffn_spec(args.path)
    except ModelSpecError as e:
        return _fail(f"{args.path}: {e}")
    first = spec.layers[0]
    print(
        json.dumps(
            {
                "architecture": spec.architecture,
                "hidden": spec.hidden,
                "layers": len(spec.layers),
                "kind": "gated_dense",
                "activation": first.activation,
                "intermediate": first.intermediate,
                "layer0_keys": list(first.keys),
                "ffn_weight_mib_bf16": round(spec.weight_bytes("bfloat16") / 2**20, 2),
            },
            indent=2,
        )
    )
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="crosspool", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="start a deployment and serve it until Ctrl-C / SIGTERM")
    s.add_argument("file", type=Path)
    s.set_defaults(func=cmd_serve)

    c = sub.add_parser("config", help="deployment files").add_subparsers(dest="config_command", required=True)
    s = c.add_parser("check", help="validate a deployment file and print it resolved")
    s.add_argument("file", type=Path)
    s.set_defaults(func=cmd_config_check)

    m = sub.add_parser("models", help="local checkpoints").add_subparsers(dest="models_command", required=True)
    s = m.add_parser("prepare", help="build a local checkpoint of a known model")
    s.add_argument("name", choices=["smollm2-135m"])
    s.add_argument("--cache", type=Path, default=None, help="cache dir (default ~/.cache/crosspool/models)")
    s.set_defaults(func=cmd_models_prepare)
    s = m.add_parser("tiny", help="write a tiny random checkpoint (fixed seed) for tests")
    s.add_argument("family", choices=["llama", "qwen2", "qwen3"])
    s.add_argument("out", type=Path)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--layers", type=int, default=2)
    s.set_defaults(func=cmd_models_tiny)
    s = m.add_parser("spec", help="print the engine-neutral FFN spec of a checkpoint")
    s.add_argument("path", type=Path)
    s.set_defaults(func=cmd_models_spec)

    # Dispatched in main() before parsing, so every option reaches the benchmark's own parser.
    sub.add_parser("bench", help="native vLLM vs CrossPool overhead (`crosspool bench --help`)", add_help=False)
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from crosspool.bench import overhead

        sys.exit(overhead.main(argv[1:]))
    args = parser().parse_args(argv)
    try:
        code = args.func(args)
    except ConfigError as e:
        code = _fail(str(e))
    sys.exit(code)


if __name__ == "__main__":
    main()
