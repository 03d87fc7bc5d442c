#!/usr/bin/env bash
# The main job: install, prepare SmolLM2-135M, serve the example deployment, ask one chat question, stop.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
. .venv/bin/activate
crosspool models prepare smollm2-135m
log=$(mktemp)
crosspool daemon examples/smollm2.toml >"$log" 2> >(grep -E '^crosspool:' >&2) &
serve=$!
trap 'kill -TERM $serve 2>/dev/null || true; wait $serve 2>/dev/null || true; rm -f "$log"' EXIT
until grep -q '^crosspool: ready' "$log"; do
  kill -0 $serve 2>/dev/null || { echo "crosspool daemon failed" >&2; exit 1; }
  sleep 1
done
cat "$log"
curl -sf http://127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' -d '{
  "model": "smollm2-135m", "temperature": 0, "max_tokens": 32,
  "messages": [{"role": "user", "content": "What is the capital of France?"}]}' |
  python -c 'import json,sys; print("answer:", json.load(sys.stdin)["choices"][0]["message"]["content"])'
