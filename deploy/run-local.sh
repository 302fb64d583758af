#!/usr/bin/env bash
# Sets up kvroute and runs it on 127.0.0.1:8000 in front of three simulated vLLM replicas
# (ports 9001-9003) with the embedded defaults. Ctrl-C stops everything it started.
#   PORT=8000 REPLICAS=3 ./deploy/run-local.sh [extra kvroute serve flags]
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup-venv.sh
PORT=${PORT:-8000}
N=${REPLICAS:-3}
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM
# The replicas' model folder: the tiny model's tokenizer and chat template, so that the replicas count
# tokens as a real model would, publish KV-cache events with token ids, and kvroute (finding the folder
# by itself) runs its precise index.
root=$(.venv/bin/python -c "from pathlib import Path; from loadtest.tiny_model import write_tokenizer; \
print(write_tokenizer(Path('.venv/tiny-model').resolve()))")
flags=()
for i in $(seq 1 "$N"); do
  port=$((9000 + i))
  .venv/bin/python -m loadtest.simulator --port "$port" --model tiny --ttft-ms 50 --itl-ms 10 \
    --root "$root" --kv-events &
  pids+=($!)
  flags+=(--replica "replica-$i=http://127.0.0.1:$port")
done
.venv/bin/kvroute serve --port "$PORT" "${flags[@]}" "$@" &
pids+=($!)
echo "kvroute: http://127.0.0.1:$PORT/v1 in front of $N simulated replicas (Ctrl-C stops)" >&2
wait "${pids[-1]}"
