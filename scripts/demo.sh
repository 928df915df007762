#!/usr/bin/env bash
# The main job: a local stack (target, draft, coordinator as three processes) with the bundled
# default model, and one generation streamed through it. Stops the stack on exit.
set -euo pipefail
PROMPT=${1:-"Add type hints and a docstring to this function and return the whole code: def mean(xs): return sum(xs) / len(xs)"}
PORT=${SPECD_DEMO_PORT:-50050}

specd up --port "$PORT" --target-port $((PORT + 2)) --draft-port $((PORT + 1)) &
UP=$!
trap 'kill -TERM $UP 2>/dev/null; wait $UP 2>/dev/null || true' EXIT
python3 -c "from specd.grpc_server import wait_healthy; wait_healthy('127.0.0.1:$PORT', 600)"
echo "--- streaming from the coordinator at 127.0.0.1:$PORT ---"
specd generate --address "127.0.0.1:$PORT" "$PROMPT" --chat --max-tokens 160
