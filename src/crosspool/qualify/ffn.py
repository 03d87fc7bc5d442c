"""`crosspool qualify`: FFN numerics and structure through a real FFN pool.

Numerics: every case runs seeded bf16 hidden states (1, 32 and 4096 rows) through the pool's
layer calls (real agents, real shared memory, FFN TP 1 and 2) and compares them with the model
family's own HF transformers MLP / MoE module on the same weights, computed in fp32: normalised
RMSE <= 0.01 and max scaled error <= 0.10 (scaled error = |err| / max(|ref|, rms(ref))), at the
first layer, both sides of every dense<->MoE transition and the last layer.
Routing (MoE layers): the family's router module selects experts from the router logits the
engine computes (its router GEMM, in the model dtype), and the pool must choose the same experts
per token (ids identical after sorting) with weights within atol 1e-4 / rtol 1e-3. The FFN
numerics reference routes the same way, then computes every expert in fp32.
Structure: 1,000 consecutive layer calls of random sizes per FFN TP degree, zero errors.

`crosspool qualify` (qualify/command.py) plans the cases from the matrix before anything runs.
"""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from crosspool import envs
from crosspool.agents.ffn.moe import RoutedMoeFfn
from crosspool.agents.ffn.weights import load_layers
from crosspool.config import parse_deployment
from crosspool.daemon.daemon import running_pool
from crosspool.integrations import kernels, launcher, serves
from crosspool.models.spec import ModelFfnSpec, MoeFfn
from crosspool.resolve import resolve
from crosspool.transport.errors import FfnCallError
from crosspool.transport.mailbox import RankTransport

ROWS = (1, 32, 4096)
TP_DEGREES = (1, 2)
MAX_NRMSE, MAX_SCALED = 0.01, 0.10
ROUTE_ATOL, ROUTE_RTOL = 1e-4, 1e-3
STRUCTURAL_CALLS = 1000


@contextlib.contextmanager
def _router_logits(logits: torch.Tensor) -> Iterator[None]:
    """Within, `F.linear` returns `logits`: the family's router module then selects experts from
    the logits the engine computed, with its own softmax / grouping / top-k code."""

    def engine_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        assert bias is None and x.shape[0] == logits.shape[0] and weight.shape[0] == logits.shape[1]
        return logits.to(x.dtype)

    with mock.patch.object(torch.nn.functional, "linear", engine_gemm):
        yield


class Reference:
    """The model family's own transformers modules on the checkpoint's weights. Experts are
    chosen by the family's router on the engine's router logits (`_router_logits`), then every
    FFN (dense, routed experts, shared experts) is computed in fp32."""

    def __init__(self, spec: ModelFfnSpec) -> None:
        import transformers

        moe = any(isinstance(layer, MoeFfn) for layer in spec.layers)
        extra = {"experts_implementation": "eager"} if moe else {}
        model = transformers.AutoModelForCausalLM.from_pretrained(spec.path, dtype=torch.bfloat16, **extra)
        self.layers = model.model.layers

    def routing(self, layer: int, x: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token the chosen experts (int64) and their weights (fp32, routed scaling included)."""
        with torch.no_grad(), _router_logits(logits):
            _, weights, ids = self.layers[layer].mlp.gate(x)
        return weights.float(), ids

    def output(self, layer: int, x: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
        """The layer's FFN in fp32; `logits` (the engine's router logits) for MoE layers."""
        mlp32 = copy.deepcopy(self.layers[layer].mlp).float()
        with torch.no_grad():
            if not hasattr(mlp32, "experts"):
                return mlp32(x.float())
            assert logits is not None
            weights, ids = self.routing(layer, x, logits)
            out = mlp32.experts(x.float(), ids, weights)
            return out + mlp32.shared_experts(x.float()) if hasattr(mlp32, "shared_experts") else out


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    err = out.float() - ref
    rms_ref = ref.pow(2).mean().sqrt()
    return {
        "nrmse": (err.pow(2).mean().sqrt() / rms_ref).item(),
        "max_scaled": (err.abs() / torch.clamp(ref.abs(), min=rms_ref.item())).max().item(),
    }


def engines_of(spec: ModelFfnSpec, engines: tuple[str, ...]) -> list[str]:
    """The engines whose kernels the pool computes this model with: those serving its family on
    this host (`crosspool qualify` says which engines the host leaves out, and why)."""
    return [e for e in engines if serves(e, spec.architecture) and not launcher(e).host_problems()]


def _deployment(models: dict[str, Path], specs: dict[str, ModelFfnSpec], engines: tuple[str, ...]) -> str:
    """Each model at each FFN TP degree, once per engine that serves its family: the pool computes
    with that engine's kernels (`integrations.kernels`)."""
    text = "[limits]\nmax_batched_tokens = 4096\n"
    text += "".join(f'[[ffn_agent]]\nid = "ffn{i}"\nmemory_gib = 8\n' for i in range(max(TP_DEGREES)))
    for name, path in models.items():
        for engine in engines_of(specs[name], engines):
            for k in TP_DEGREES:
                text += f'[[model]]\nid = "{engine}-{name}-tp{k}"\npath = "{path}"\nengine = "{engine}"\nffn_tp = {k}\n'
    return text


def checked_layers(spec: ModelFfnSpec) -> list[int]:
    """The first layer, both sides of every dense<->MoE transition, the last layer."""
    kinds = [type(layer) for layer in spec.layers]
    transitions = {i + d for i in range(1, len(kinds)) if kinds[i] != kinds[i - 1] for d in (-1, 0)}
    return sorted({0, len(kinds) - 1} | transitions)


def _moe_layers(spec: ModelFfnSpec) -> list[int]:
    return [layer.layer for layer in spec.layers if isinstance(layer, MoeFfn)]


def planned_cases(specs: dict[str, ModelFfnSpec], engines: tuple[str, ...]) -> list[str]:
    """Every case `qualify` runs for these models, in the order it runs them."""
    cases = []
    for name, spec in specs.items():
        for engine in engines_of(spec, engines):
            for k in TP_DEGREES:
                cases += [
                    f"ffn-numerics/{engine}/{name}/tp{k}/layer{layer}/rows{rows}"
                    for layer in checked_layers(spec)
                    for rows in ROWS
                ]
                cases.append(f"structural/{engine}/{name}/tp{k}")
            routed = _moe_layers(spec)
            cases += [f"moe-routing/{engine}/{name}/layer{layer}/rows{rows}" for layer in routed for rows in ROWS]
    return cases


def _input(spec: ModelFfnSpec, layer: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, spec.hidden, generator=torch.Generator().manual_seed(rows * 1000 + layer)).to(
        torch.bfloat16
    )


class EngineRouter:
    """The MoE layers of a model with one engine's kernels in this process: the router logits the
    engine computes, and the routing the pool's kernel chooses from them."""

    def __init__(self, spec: ModelFfnSpec, engine: str) -> None:
        executors = load_layers(spec, "bfloat16", "dtype", kernels(engine), _moe_layers(spec))
        self.kernels = {}
        for layer, executor in executors.items():
            assert isinstance(executor, RoutedMoeFfn)
            self.kernels[layer] = executor.kernel

    def logits(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        kernel = self.kernels.get(layer)
        return None if kernel is None else kernel.router_logits(x)


def routing_verdicts(
    name: str, spec: ModelFfnSpec, engine: str, reference: Reference, router: EngineRouter
) -> list[dict[str, Any]]:
    """The pool's router (the engine integration's MoE kernel, run here on the same inputs) against
    the family's router on the same logits: expert ids identical per token after sorting, weights
    within tolerance."""
    verdicts = []
    for moe in (layer for layer in spec.layers if isinstance(layer, MoeFfn)):
        for rows in ROWS:
            x = _input(spec, moe.layer, rows)
            weights, ids = router.kernels[moe.layer].route(x)
            logits = router.logits(moe.layer, x)
            assert logits is not None
            ref_weights, ref_ids = reference.routing(moe.layer, x, logits)
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


def qualify(specs: dict[str, ModelFfnSpec], engines: tuple[str, ...] = ("vllm",)) -> Iterator[dict[str, Any]]:
    """The verdicts of `planned_cases(specs, engines)`, as they come."""
    paths = {name: spec.path for name, spec in specs.items()}
    with running_pool(resolve(parse_deployment(_deployment(paths, specs, engines), "qualify"), "qualify")) as gen:
        for name, spec in specs.items():
            reference = Reference(spec)
            for engine in engines_of(spec, engines):
                router = EngineRouter(spec, engine)
                for k in TP_DEGREES:
                    rank = RankTransport(gen.plan.rank_layout(f"{engine}-{name}-tp{k}", 0))
                    for layer in checked_layers(spec):
                        for rows in ROWS:
                            x = _input(spec, layer, rows)
                            out = torch.empty_like(x)
                            rank.call(layer, x, out)
                            e = errors(out, reference.output(layer, x, router.logits(layer, x)))
                            yield {
                                "case": f"ffn-numerics/{engine}/{name}/tp{k}/layer{layer}/rows{rows}",
                                "pass": e["nrmse"] <= MAX_NRMSE and e["max_scaled"] <= MAX_SCALED,
                                **{key: round(v, 6) for key, v in e.items()},
                            }
                    yield _structural(rank, spec, f"structural/{engine}/{name}/tp{k}")
                yield from routing_verdicts(name, spec, engine, reference, router)


def _structural(rank: RankTransport, spec: ModelFfnSpec, case: str) -> dict[str, Any]:
    """Consecutive calls of random sizes and layers: the protocol, not the arithmetic (the
    numerics cases cover 4096 rows; a 300-row bf16 SmolLM2 call cost ~40 ms on an AVX2 host)."""
    rng = random.Random(0)
    failures: list[str] = []
    for _ in range(STRUCTURAL_CALLS):
        rows = rng.choice((1, 2, 7, 33, 64))
        x = torch.randn(rows, spec.hidden).to(torch.bfloat16)
        try:
            rank.call(rng.randrange(len(spec.layers)), x, torch.empty_like(x))
        except FfnCallError as e:
            failures.append(str(e))
            break
    return {"case": case, "pass": not failures, "calls": STRUCTURAL_CALLS, "errors": failures}


def default_models() -> dict[str, Path]:
    """Every tiny family and SmolLM2-135M; building any of them may fail, never silently."""
    from crosspool.models.prepare import TINY_FAMILIES, make_tiny_checkpoint, prepare_smollm2

    cache = envs.cache_root() / "tiny"
    models = {f"tiny-{f}": make_tiny_checkpoint(f, cache / f"tiny-{f}", seed=0) for f in TINY_FAMILIES}
    models["smollm2-135m"] = prepare_smollm2()
    return models
