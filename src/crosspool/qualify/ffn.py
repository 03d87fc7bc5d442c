"""`crosspool qualify`: FFN numerics and structure through a real FFN pool.

Numerics: every case runs seeded bf16 hidden states (1, 32 and 4096 rows) through the pool's
layer calls (real agents, real shared memory, FFN TP 1 and 2) and compares them with the model
family's own HF transformers MLP module on the same weights, computed in fp32:
normalised RMSE <= 0.01 and max scaled error <= 0.10 (scaled error = |err| / max(|ref|, rms(ref))),
at the first layer and the last (dense families have no dense/MoE transitions).
Structure: 1,000 consecutive layer calls of random sizes per FFN TP degree, zero errors.
One JSON verdict per case on stdout; the exit code is non-zero if any case fails.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from crosspool.config import parse_deployment
from crosspool.daemon.daemon import running_pool
from crosspool.models.spec import ModelFfnSpec, load_ffn_spec
from crosspool.plan import resolve
from crosspool.transport.mailbox import RankTransport

ROWS = (1, 32, 4096)
TP_DEGREES = (1, 2)
MAX_NRMSE, MAX_SCALED = 0.01, 0.10
STRUCTURAL_CALLS = 1000


def hf_mlp(spec: ModelFfnSpec, layer: int) -> nn.Module:
    """The family's own transformers MLP with this layer's checkpoint weights, in fp32."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

    families: dict[str, type[nn.Module]] = {
        "LlamaForCausalLM": LlamaMLP,
        "Qwen2ForCausalLM": Qwen2MLP,
        "Qwen3ForCausalLM": Qwen3MLP,
    }
    mlp = families[spec.architecture](transformers.AutoConfig.from_pretrained(spec.path)).float()
    ffn = spec.layers[layer]
    for name, key in (("gate_proj", ffn.gate_key), ("up_proj", ffn.up_key), ("down_proj", ffn.down_key)):
        with safe_open(spec.path / spec.key_files[key], framework="pt") as f:
            getattr(mlp, name).weight.data.copy_(f.get_tensor(key).float())
    return mlp.eval()


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    err = out.float() - ref
    rms_ref = ref.pow(2).mean().sqrt()
    return {
        "nrmse": (err.pow(2).mean().sqrt() / rms_ref).item(),
        "max_scaled": (err.abs() / torch.clamp(ref.abs(), min=rms_ref.item())).max().item(),
    }


def _deployment(models: dict[str, Path]) -> str:
    text = "[limits]\nmax_batched_tokens = 4096\n"
    text += "".join(f'[[ffn_agent]]\nid = "ffn{i}"\nmemory_gib = 8\n' for i in range(max(TP_DEGREES)))
    for name, path in models.items():
        for k in TP_DEGREES:
            text += f'[[model]]\nid = "{name}-tp{k}"\npath = "{path}"\nengine = "vllm"\nffn_tp = {k}\n'
    return text


def qualify(models: dict[str, Path]) -> list[dict[str, Any]]:
    verdicts: list[dict[str, Any]] = []
    specs = {name: load_ffn_spec(path) for name, path in models.items()}
    with running_pool(resolve(parse_deployment(_deployment(models), "qualify"), "qualify")) as gen:
        for name, spec in specs.items():
            last = len(spec.layers) - 1
            references = {layer: hf_mlp(spec, layer) for layer in sorted({0, last})}
            for k in TP_DEGREES:
                rank = RankTransport.attach(gen.plan, f"{name}-tp{k}", 0)
                for layer, mlp in references.items():
                    for rows in ROWS:
                        gen_x = torch.Generator().manual_seed(rows * 1000 + layer)
                        x = torch.randn(rows, spec.hidden, generator=gen_x).to(torch.bfloat16)
                        out = torch.empty_like(x)
                        rank.call(layer, x, out)
                        with torch.no_grad():
                            ref = mlp(x.float())
                        e = errors(out, ref)
                        verdicts.append(
                            {
                                "case": f"ffn-numerics/{name}/tp{k}/layer{layer}/rows{rows}",
                                "pass": e["nrmse"] <= MAX_NRMSE and e["max_scaled"] <= MAX_SCALED,
                                **{key: round(v, 6) for key, v in e.items()},
                            }
                        )
                verdicts.append(_structural(rank, spec, f"structural/{name}/tp{k}"))
    return verdicts


def _structural(rank: RankTransport, spec: ModelFfnSpec, case: str) -> dict[str, Any]:
    rng = random.Random(0)
    failures: list[str] = []
    for _ in range(STRUCTURAL_CALLS):
        rows = rng.choice((1, 2, 7, 64, 300))
        x = torch.randn(rows, spec.hidden).to(torch.bfloat16)
        try:
            rank.call(rng.randrange(len(spec.layers)), x, torch.empty_like(x))
        except RuntimeError as e:
            failures.append(str(e))
            break
    return {"case": case, "pass": not failures, "calls": STRUCTURAL_CALLS, "errors": failures}


def default_models() -> dict[str, Path]:
    from crosspool.models.prepare import TINY_FAMILIES, make_tiny_checkpoint, prepare_smollm2
    from crosspool.models.spec import ModelSpecError

    cache = Path.home() / ".cache" / "crosspool" / "tiny"
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
    p.add_argument("--all", action="store_true", help="every dense family (tiny Llama, Qwen2, Qwen3) and SmolLM2-135M")
    p.add_argument("--model", type=Path, action="append", default=[], help="a checkpoint dir (repeatable)")
    args = p.parse_args(argv)
    models = {path.name: path for path in args.model}
    if args.all or not models:
        models = {**default_models(), **models}
    verdicts = qualify(models)
    for v in verdicts:
        print(json.dumps(v))
    failed = [v["case"] for v in verdicts if not v["pass"]]
    print(f"crosspool qualify: {len(verdicts) - len(failed)} of {len(verdicts)} cases pass", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
