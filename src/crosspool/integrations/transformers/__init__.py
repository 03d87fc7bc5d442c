"""A Hugging Face transformers causal LM whose MLPs run in the FFN pool: the GPU end-to-end check
of the CUDA data plane, and the smallest reference integration.

`offload_mlps` swaps every decoder layer's `mlp` (gate/up/down, as Llama and Qwen3 have) for a
`PoolMlp` that calls `crosspool::ffn_shim`, and frees the MLP weights: the GPU FfnAgent loads
them from the checkpoint (`crosspool.agents.gpu_ffn_agent`). Transformers computes the gate and
up projections as two GEMMs and rounds SiLU and the product to the model dtype, so the agent
runs with `--split-gate-up` and `--activation-math dtype` (`AGENT_ARGS`).

`greedy` is a decode loop over a static KV cache: the prompt in one eager forward, then one token
per step, each step either eager or the replay of one CUDA graph captured per batch (the rank's
layer calls, their flags and copies included). Position and mask live in device tensors the graph
updates itself, so a replay needs no host work and no synchronisation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import PreTrainedModel, StaticCache

import crosspool.ops  # noqa: F401  (defines torch.ops.crosspool.ffn_shim)

AGENT_ARGS = ("--split-gate-up", "--activation-math", "dtype")


class PoolMlp(nn.Module):
    def __init__(self, layer: int) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = torch.empty_like(flat)
        torch.ops.crosspool.ffn_shim(flat, out, self.layer)
        return out.view(x.shape)


def offload_mlps(model: PreTrainedModel) -> int:
    """Replace every decoder layer's MLP by the pool's; the number of layers."""
    layers = model.model.layers
    assert isinstance(layers, nn.ModuleList)
    for i, layer in enumerate(layers):
        mlp = layer.get_submodule("mlp")
        assert {"gate_proj", "up_proj", "down_proj"} <= {n for n, _ in mlp.named_children()}, type(mlp)
        layer.mlp = PoolMlp(i)
    torch.cuda.empty_cache()
    return len(layers)


def _causal_mask(batch: int, rows: int, length: int, device: torch.device) -> torch.Tensor:
    """[batch, 1, rows, length] bool: query i sees keys 0..i (transformers takes a 4D mask as given)."""
    keys = torch.arange(length, device=device)
    return (keys[None, :] <= torch.arange(rows, device=device)[:, None]).expand(batch, 1, rows, length).contiguous()


@torch.inference_mode()
def greedy(
    model: PreTrainedModel,
    prompt: torch.Tensor,
    new_tokens: int,
    *,
    graph: bool,
    after_step: Callable[[], None] = lambda: None,
    step_times_ms: list[float] | None = None,
) -> torch.Tensor:
    """Greedy continuation of `prompt` [batch, length]: [batch, new_tokens]. `after_step` runs on
    the host after each step is enqueued (the pool's `raise_if_failed`); with `step_times_ms`, each
    decode step is timed with CUDA events (eager steps synchronise for it)."""
    batch, length = prompt.shape
    device = prompt.device
    max_len = length + new_tokens
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    mask = _causal_mask(batch, length, max_len, device)
    positions = torch.arange(length, device=device).expand(batch, length)
    logits = model(input_ids=prompt, position_ids=positions, attention_mask=mask, past_key_values=cache).logits
    after_step()
    token = logits[:, -1:].argmax(-1)
    step_mask = mask[:, :, -1:].clone()  # [batch, 1, 1, max_len]: the prompt's keys
    position = torch.full((batch, 1), length, device=device, dtype=torch.long)
    out = [token.clone()]

    def step() -> None:
        step_mask.scatter_(3, position.view(batch, 1, 1, 1), True)
        step_logits = model(
            input_ids=token, position_ids=position, attention_mask=step_mask, past_key_values=cache
        ).logits
        token.copy_(step_logits[:, -1:].argmax(-1))
        position.add_(1)

    replay: Callable[[], None] = step
    if graph and new_tokens > 1:
        step()  # eager once: warms cuBLAS and the allocator; capture records without running
        after_step()
        out.append(token.clone())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        replay = g.replay
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    while len(out) < new_tokens:
        if step_times_ms is not None:
            start.record()
        replay()
        if step_times_ms is not None:
            end.record()
            end.synchronize()
            step_times_ms.append(start.elapsed_time(end))
        after_step()
        out.append(token.clone())
    torch.cuda.synchronize()
    after_step()
    return torch.cat(out, dim=1)
