"""SGLang's half of the offline harness (`crosspool.integrations.offline`): greedy generation on
token-id prompts with `sglang.Engine`, run in the harness's child process (a failing scheduler
SIGKILLs the process that created the Engine)."""

from __future__ import annotations

import json
import time

from crosspool.config import ModelConfig
from crosspool.integrations.offline import child_main
from crosspool.integrations.sglang.launch import engine_kwargs


def offline_env(in_process_engine: bool) -> dict[str, str]:
    # One generate() call with token ids reaches the scheduler as one batched request, so every
    # prompt of a batch is scheduled together without changing SGLang's process layout.
    return {}


def run(job: dict) -> dict:
    import sglang

    model = ModelConfig.model_validate(job["model"])
    kwargs = engine_kwargs(model, job["max_batched_tokens"])
    engine = sglang.Engine(**kwargs, skip_tokenizer_init=True, random_seed=0, log_level="error")
    greedy = {"temperature": 0.0, "max_new_tokens": job["max_tokens"], "ignore_eos": True}
    results: dict = {"runs": []}
    try:
        if job.get("first_logits"):
            # First-step log-probabilities over the whole vocabulary, per prompt (SGLang has no
            # raw-logits mode: log_softmax of the raw logits under greedy sampling).
            vocab = json.loads((model.path / "config.json").read_text())["vocab_size"]
            results["first_logits"] = []
            for prompt in job["first_logits"]:
                out = engine.generate(
                    input_ids=prompt,
                    sampling_params={**greedy, "max_new_tokens": 1},
                    return_logprob=True,
                    top_logprobs_num=vocab,
                )
                row = [0.0] * vocab
                for logprob, token, _ in out["meta_info"]["output_top_logprobs"][0]:
                    row[token] = logprob
                results["first_logits"].append(row)
        for batch in job["batches"]:
            start = time.perf_counter()
            outputs = engine.generate(input_ids=batch, sampling_params=greedy)
            seconds = time.perf_counter() - start
            tokens = [list(o["output_ids"]) for o in outputs]
            results["runs"].append({"tokens": tokens, "seconds": seconds, "generated": sum(map(len, tokens))})
    finally:
        engine.shutdown()
    return results


if __name__ == "__main__":
    child_main(run)
