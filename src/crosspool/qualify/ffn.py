"""`crosspool qualify`: FFN numerics and structure through a real FFN pool.

Numerics: every case runs seeded bf16 hidden states (1, 32 and 4096 rows) through the pool's
layer calls (real agents, real shared memory, FFN TP 1 and 2) and compares them with the model
family's own HF transformers MLP / MoE module on the same weights, computed in fp32 (experts
chosen as that module chooses them in bf16): normalised RMSE <= 0.01 and max scaled error <= 0.10
(scaled error = |err| / max(|ref|, rms(ref))), at the first layer, both sides of every
dense<->MoE transition and the last layer.
Routing (MoE layers): the pool's router against the family's router on the same inputs: expert
ids identical per token after sorting, weights within atol 1e-4 / rtol 1e-3.
Structure: 1,000 consecutive layer calls of random sizes per FFN TP degree, zero errors.
One JSON verdict per case on stdout; the exit code is non-zero if any case fails.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
from pathlib import Path
from typing import Any

import torch

from crosspool import envs
from crosspool.agents.ffn.moe import RoutedMoeFfn
from crosspool.agents.ffn.weights import load_layers
from crosspool.config import parse_deployment
from crosspool.daemon.daemon import running_pool
from crosspool.integrations import ENGINES, kernels, serves
from crosspool.models.spec import ModelFfnSpec, MoeFfn, load_ffn_spec
from crosspool.resolve import resolve
from crosspool.transport.errors import FfnCallError
from crosspool.transport.mailbox import RankTransport

ROWS = (1, 32, 4096)
TP_DEGREES = (1, 2)
MAX_NRMSE, MAX_SCALED = 0.01, 0.10
ROUTE_ATOL, ROUTE_RTOL = 1e-4, 1e-3
STRUCTURAL_CALLS = 1000


class Reference:
    """The model family's own transformers modules on the checkpoint's weights. Experts are
    chosen as the family's module chooses them in the model dtype (its router's own precision),
    then every FFN (dense, routed experts, shared experts) is computed in fp32."""

    def __init__(self, spec: ModelFfnSpec) -> None:
        import transformers

        moe = any(isinstance(layer, MoeFfn) for layer in spec.layers)
        extra = {"experts_implementation": "eager"} if moe else {}
        model = transformers.AutoModelForCausalLM.from_pretrained(spec.path, dtype=torch.bfloat16, **extra)
        self.layers = model.model.layers

    def routing(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token the chosen experts (int64) and their weights (fp32, routed scaling included)."""
        with torch.no_grad():
            _, weights, ids = self.layers[layer].mlp.gate(x)
        return weights.float(), ids

    def output(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        mlp32 = copy.deepcopy(self.layers[layer].mlp).float()
        with torch.no_grad():
            if not hasattr(mlp32, "experts"):
                return mlp32(x.float())
            weights, ids = self.routing(layer, x)
            out = mlp32.experts(x.float(), ids, weights)
            return out + mlp32.shared_experts(x.float()) if hasattr(mlp32, "shared_experts") else out


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    err = out.float() - ref
    rms_ref = ref.pow(2).mean().sqrt()
    return {
        "nrmse": (err.pow(2).mean().sqrt() / rms_ref).item(),
        "max_scaled": (err.abs() / torch.clamp(ref.abs(), min=rms_ref.item())).max().item(),
    }


def _deployment(models: dict[str, Path], specs: dict[str, ModelFfnSpec], engines: tuple[str, ...]) -> str:
    """Each model at each FFN TP degree, once per engine that serves its family: the pool computes
    with that engine's kernels (`integrations.kernels`)."""
    text = "[limits]\nmax_batched_tokens = 4096\n"
    text += "".join(f'[[ffn_agent]]\nid = "ffn{i}"\nmemory_gib = 8\n' for i in range(max(TP_DEGREES)))
    for engine in engines:
        for name, path in models.items():
            for k in TP_DEGREES if serves(engine, specs[name].architecture) else ():
                text += f'[[model]]\nid = "{engine}-{name}-tp{k}"\npath = "{path}"\nengine = "{engine}"\nffn_tp = {k}\n'
    return text


def checked_layers(spec: ModelFfnSpec) -> list[int]:
    """The first layer, both sides of every dense<->MoE transition, the last layer."""
    kinds = [type(layer) for layer in spec.layers]
    transitions = {i + d for i in range(1, len(kinds)) if kinds[i] != kinds[i - 1] for d in (-1, 0)}
    return sorted({0, len(kinds) - 1} | transitions)


def _input(spec: ModelFfnSpec, layer: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, spec.hidden, generator=torch.Generator().manual_seed(rows * 1000 + layer)).to(
        torch.bfloat16
    )


def routing_verdicts(name: str, spec: ModelFfnSpec, engine: str, reference: Reference) -> list[dict[str, Any]]:
    """The pool's router (the engine integration's MoE kernel, run here on the same inputs) against
    the family's: expert ids identical per token after sorting, weights within tolerance."""
    verdicts = []
    moe_layers = [layer for layer in spec.layers if isinstance(layer, MoeFfn)]
    executors = load_layers(spec, "bfloat16", "dtype", kernels(engine), [m.layer for m in moe_layers])
    for moe in moe_layers:
        executor = executors[moe.layer]
        assert isinstance(executor, RoutedMoeFfn)
        for rows in ROWS:
            x = _input(spec, moe.layer, rows)
            weights, ids = executor.kernel.route(x)
            ref_weights, ref_ids = reference.routing(moe.layer, x)
            ours, theirs = ids.long().sort(dim=-1), ref_ids.sort(dim=-1)
            same = (ours.values == theirs.values).all(dim=-1)
            w = (weights * moe.routing.routed_scaling_factor).gather(1, ours.indices)
            close = torch.isclose(w, ref_weights.gather(1, theirs.indices), atol=ROUTE_ATOL, rtol=ROUTE_RTOL)
            verdicts.append(
                {
                    "case": f"moe-routing/{engine}/{name}/layer{moe.layer}/rows{rows}",
                    "pass": bool(same.all() and close.all()),
                    "tokens_with_other_experts": int((~same).sum()),
                    "weights_out_of_tolerance": int((~close).sum()),
                }
            )
    return verdicts


def qualify(models: dict[str, Path], engines: tuple[str, ...] = ("vllm",)) -> list[dict[str, Any]]:
    verdicts: list[dict[str, Any]] = []
    specs = {name: load_ffn_spec(path) for name, path in models.items()}
    with running_pool(resolve(parse_deployment(_deployment(models, specs, engines), "qualify"), "qualify")) as gen:
        for name, spec in specs.items():
            reference = Reference(spec)
            for engine in (e for e in engines if serves(e, spec.architecture)):
                for k in TP_DEGREES:
                    rank = RankTransport(gen.plan.rank_layout(f"{engine}-{name}-tp{k}", 0))
                    for layer in checked_layers(spec):
                        for rows in ROWS:
                            x = _input(spec, layer, rows)
                            out = torch.empty_like(x)
                            rank.call(layer, x, out)
                            e = errors(out, reference.output(layer, x))
                            verdicts.append(
                                {
                                    "case": f"ffn-numerics/{engine}/{name}/tp{k}/layer{layer}/rows{rows}",
                                    "pass": e["nrmse"] <= MAX_NRMSE and e["max_scaled"] <= MAX_SCALED,
                                    **{key: round(v, 6) for key, v in e.items()},
                                }
                            )
                    verdicts.append(_structural(rank, spec, f"structural/{engine}/{name}/tp{k}"))
                if any(isinstance(layer, MoeFfn) for layer in spec.layers):
                    verdicts += routing_verdicts(name, spec, engine, reference)
    return verdicts


def _structural(rank: RankTransport, spec: ModelFfnSpec, case: str) -> dict[str, Any]:
    rng = random.Random(0)
    failures: list[str] = []
    for _ in range(STRUCTURAL_CALLS):
        rows = rng.choice((1, 2, 7, 64, 300))
        x = torch.randn(rows, spec.hidden).to(torch.bfloat16)
        try:
            rank.call(rng.randrange(len(spec.layers)), x, torch.empty_like(x))
        except FfnCallError as e:
            failures.append(str(e))
            break
    return {"case": case, "pass": not failures, "calls": STRUCTURAL_CALLS, "errors": failures}


def default_models() -> dict[str, Path]:
    from crosspool.models.prepare import TINY_FAMILIES, make_tiny_checkpoint, prepare_smollm2
    from crosspool.models.spec import ModelSpecError

    cache = envs.cache_root() / "tiny"
    models = {f"tiny-{f}": make_tiny_checkpoint(f, cache / f"tiny-{f}", seed=0) for f in TINY_FAMILIES}
    try:
        models["smollm2-135m"] = prepare_smollm2()
    except (OSError, ModelSpecError) as e:
        print(f"crosspool qualify: SmolLM2-135M unavailable: {e}", file=sys.stderr)
    return models


def main(argv: list[str] | None = None) -> int:
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
        help="also the serving topology matrix through real vLLM engines (crosspool.qualify.serving)",
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
    args = p.parse_args(argv)
    for path in args.model:
        if not (path / "config.json").is_file():
            p.error(f"--model {path}: not a checkpoint directory (no config.json)")
    models = {path.name: path for path in args.model}
    if args.all or not models:
        models = {**default_models(), **models}
    verdicts = qualify(models, tuple(dict.fromkeys(args.engine)) if args.engine else ENGINES)
    for v in verdicts:
        print(json.dumps(v), flush=True)
    if args.serving:
        from crosspool.qualify.serving import default_model, qualify_serving

        lanes = tuple(sorted(set(args.lanes))) if args.lanes else (1, 2)
        modes = tuple(dict.fromkeys(args.mode)) if args.mode else ("eager", "compile")
        verdicts += qualify_serving(default_model(), lanes, modes)  # prints each verdict as it comes
    failed = [v["case"] for v in verdicts if not v["pass"]]
    print(f"crosspool qualify: {len(verdicts) - len(failed)} of {len(verdicts)} cases pass", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
