"""`crosspool <command>`: daemon/serve, status, top, config check, models prepare/tiny/spec, bench, qualify."""

from __future__ import annotations

import argparse
import errno
import json
import sys
from pathlib import Path

from crosspool import envs
from crosspool.config import ConfigError


def _fail(message: str, code: int = 2) -> int:
    for line in message.splitlines():
        print(f"crosspool: error: {line}", file=sys.stderr)
    return code


def cmd_daemon(args: argparse.Namespace) -> int:
    from crosspool.daemon.daemon import run_daemon
    from crosspool.ipc import die_with_supervisor
    from crosspool.resolve import resolve_file

    die_with_supervisor()  # only when started by a CrossPool process that set the variable (qualify)
    return run_daemon(resolve_file(args.file))


def _control_url(args: argparse.Namespace) -> str | None:
    """The daemon's control API: --url, or the deployment FILE's control port."""
    from crosspool.config import load_deployment

    if args.url:
        return str(args.url)
    if args.file is None:
        return None
    d = load_deployment(args.file)
    return f"http://{d.host}:{d.control}"


def cmd_status(args: argparse.Namespace) -> int:
    import httpx
    from rich.console import Console
    from rich.table import Table

    url = _control_url(args)
    if url is None:
        return _fail("give the deployment FILE or --url")
    try:
        status = httpx.get(url + "/status", timeout=5).json()
    except httpx.HTTPError as e:
        return _fail(f"no CrossPool daemon answers at {url}: {e}", 1)
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    console = Console()
    console.print(
        f"[bold]{status['deployment']}[/] generation {status['generation']} [bold]{status['phase']}[/] "
        f"(restarts {status['restarts']}) endpoint {status['endpoint']}"
    )
    if status["failure"]:
        console.print(f"[red]failure:[/] {status['failure']}")
    members = Table("member", "registered", "pid", "heartbeat age (s)")
    for m in status["members"]:
        members.add_row(
            m["name"], "yes" if m["registered"] else "no", str(m["pid"] or "-"), str(m["heartbeat_age_s"] or "-")
        )
    console.print(members)
    models = Table("model", "state", "Instance restarts", "engine", "FFN agents", "engine URL")
    for name, m in status["models"].items():
        models.add_row(name, m["state"], str(m["restarts"]), m["engine"], ", ".join(m["ffn_agents"]), m["url"])
    console.print(models)
    for name, m in status["models"].items():
        if m["failure"]:
            console.print(f"[yellow]{name} restarting after:[/] {m['failure']}")
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    import httpx

    from crosspool import top

    url = _control_url(args)
    if url is None:
        return _fail("give the deployment FILE or --url")
    try:
        top.run(url, args.interval, args.once)
    except httpx.HTTPError as e:
        return _fail(f"no CrossPool daemon answers at {url}: {e}", 1)
    except KeyboardInterrupt:
        pass
    return 0


def cmd_config_check(args: argparse.Namespace) -> int:
    from crosspool.resolve import resolve_file

    checked = resolve_file(args.file)
    deployment, specs, plan = checked.deployment, checked.specs, checked.plan()
    resolved = deployment.model_dump(mode="json")
    resolved["digest"] = deployment.digest()
    resolved["control_port"] = deployment.control
    resolved["ffn"] = {
        m.id: {
            "architecture": specs[m.id].architecture,
            "layers": len(specs[m.id].layers),
            "ffn_weight_mib": round(specs[m.id].weight_bytes(m.dtype) / 2**20, 2),
            "ffn_agents": _layer_ranges(plan.model(m.id).layer_agents),
            "attention_device": deployment.attention_of(m),
        }
        for m in deployment.model
    }
    resolved["cpus"] = {
        "control": plan.control_cpus,
        "ranks": {m.id: m.rank_cpus for m in plan.models},
        "ffn_agents": {a.id: a.cpus for a in plan.ffn_agents},
        "spin_us": {
            "ranks": {m.id: m.spin_us for m in plan.models},
            "ffn_agents": {a.id: a.spin_us for a in plan.ffn_agents},
        },
    }
    print(json.dumps(resolved, indent=2))
    return 0


def _layer_ranges(layer_agents: list[list[str]]) -> dict[str, str]:
    """{"ffn0": "0-14", "ffn1": "15-29"}: where each layer of a model runs, as ranges."""
    ranges: dict[str, list[str]] = {}
    start = 0
    for layer in range(1, len(layer_agents) + 1):
        if layer == len(layer_agents) or layer_agents[layer] != layer_agents[start]:
            span = f"{start}" if layer - 1 == start else f"{start}-{layer - 1}"
            for agent in layer_agents[start]:
                ranges.setdefault(agent, []).append(span)
            start = layer
    return {agent: ",".join(spans) for agent, spans in ranges.items()}


def cmd_models_prepare(args: argparse.Namespace) -> int:
    from crosspool.models.prepare import prepare_smollm2

    print(prepare_smollm2(args.cache))
    return 0


def cmd_models_tiny(args: argparse.Namespace) -> int:
    from crosspool.models.prepare import make_tiny_checkpoint

    print(make_tiny_checkpoint(args.family, args.out, seed=args.seed, layers=args.layers, tokenizer=args.tokenizer))
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
                "kinds": [type(layer).__name__ for layer in spec.layers],
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

    for name in ("daemon", "serve"):
        s = sub.add_parser(name, help="run a deployment's daemon: start, serve, supervise until Ctrl-C / SIGTERM")
        s.add_argument("file", type=Path)
        s.set_defaults(func=cmd_daemon)

    s = sub.add_parser("status", help="ask a running daemon for its status (members, generation, models)")
    s.add_argument("file", type=Path, nargs="?", help="the deployment file (finds the control port)")
    s.add_argument("--url", help="the daemon's control API, e.g. http://127.0.0.1:8001")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)

    s = sub.add_parser("top", help="live view of elastic KV: bytes backed, used and needed per Instance")
    s.add_argument("file", type=Path, nargs="?", help="the deployment file (finds the control port)")
    s.add_argument("--url", help="the daemon's control API, e.g. http://127.0.0.1:8001")
    s.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    s.add_argument("--once", action="store_true", help="print one view and exit")
    s.set_defaults(func=cmd_top)

    c = sub.add_parser("config", help="deployment files").add_subparsers(dest="config_command", required=True)
    s = c.add_parser("check", help="validate a deployment file and print it resolved")
    s.add_argument("file", type=Path)
    s.set_defaults(func=cmd_config_check)

    m = sub.add_parser("models", help="local checkpoints").add_subparsers(dest="models_command", required=True)
    s = m.add_parser("prepare", help="build a local checkpoint of a known model")
    s.add_argument("name", choices=["smollm2-135m"])
    where = f"where to write it (default: ${envs.CACHE}/models; ${envs.CACHE} defaults to ~/.cache/crosspool)"
    s.add_argument("--cache", type=Path, default=None, help=where)
    s.set_defaults(func=cmd_models_prepare)
    s = m.add_parser("tiny", help="write a tiny random checkpoint (fixed seed) for tests")
    s.add_argument("family", choices=["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v2"])
    s.add_argument("out", type=Path)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--layers", type=int, default=2, help="decoder layers (MoE families: at least 3)")
    s.add_argument("--tokenizer", type=Path, default=None, help="copy this checkpoint's tokenizer (and vocab size)")
    s.set_defaults(func=cmd_models_tiny)
    s = m.add_parser("spec", help="print the engine-neutral FFN spec of a checkpoint")
    s.add_argument("path", type=Path)
    s.set_defaults(func=cmd_models_spec)

    # Dispatched in main() before parsing, so every option reaches the benchmark's own parser.
    sub.add_parser(
        "bench",
        help="benchmarks: overhead, executor, serve, elastic-kv, kv-transfer (`crosspool bench --help`)",
        add_help=False,
    )
    sub.add_parser(
        "qualify", help="FFN numerics and structure against references (`crosspool qualify --help`)", add_help=False
    )
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["qualify"]:
        from crosspool.qualify import command

        sys.exit(command.main(argv[1:]))
    if argv[:1] == ["bench"]:
        from crosspool.bench import command as bench

        sys.exit(bench.main(argv[1:]))
    args = parser().parse_args(argv)
    try:
        code = args.func(args)
    except ConfigError as e:
        code = _fail(str(e))
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        code = _fail(f"{e.strerror}" + (f": {e.filename}" if e.filename else ""))
    sys.exit(code)


if __name__ == "__main__":
    main()
