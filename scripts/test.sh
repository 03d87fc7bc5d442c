#!/usr/bin/env bash
# Install everything, then run lint, type check and the whole test suite (real vLLM engines).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
. .venv/bin/activate
ruff check src tests
ruff format --check src tests
mypy
python -m pytest -q -p no:cacheprovider "$@"
