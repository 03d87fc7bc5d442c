"""vLLM's half of the offline harness (`crosspool.integrations.offline`): greedy generation on
token-id prompts with `vllm.LLM`, run in the harness's child process."""

from __future__ import annotations

import time

from crosspool.config import ModelConfig
from crosspool.integrations.offline import child_main
from crosspool.integrations.vllm.launch import engine_kwargs


def offline_env(in_process_engine: bool) -> dict[str, str]:
    # An in-process EngineCore steps only when generate() drives it, so every request of a
    # batch is scheduled together.
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if in_process_engine else {}


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    model = ModelConfig.model_validate(job["model"])
    kwargs = engine_kwargs(model, job["max_batched_tokens"])
    if job.get("first_logits"):  # "logprobs" then carry the raw logits of the whole vocabulary
        kwargs.update(max_logprobs=-1, logprobs_mode="raw_logits")
    llm = LLM(**kwargs, skip_tokenizer_init=True, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    results: dict = {"runs": []}
    if job.get("first_logits"):
        # The first step's logits over the whole vocabulary, per prompt (one prompt per batch).
        first = SamplingParams(temperature=0.0, max_tokens=1, logprobs=-1)
        results["first_logits"] = []
        for prompt in job["first_logits"]:
            (out,) = llm.generate([{"prompt_token_ids": prompt}], first, use_tqdm=False)  # type: ignore[arg-type]
            steps = out.outputs[0].logprobs
            assert steps is not None and len(steps) == 1
            results["first_logits"].append([steps[0][t].logprob for t in range(len(steps[0]))])
    for batch in job["batches"]:
        prompts = [{"prompt_token_ids": p} for p in batch]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)  # type: ignore[arg-type]
        seconds = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        results["runs"].append({"tokens": tokens, "seconds": seconds, "generated": sum(map(len, tokens))})
    return results


if __name__ == "__main__":
    child_main(run)
