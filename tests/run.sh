#!/usr/bin/env bash
# Sets up the test environment and runs the tests; arguments go to pytest (e.g. -m vllm, -k name).
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup-venv.sh test
if ! command -v redis-server >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
  else
    echo "redis-server is missing: install it (apt-get install redis-server)" >&2
    exit 1
  fi
fi
exec .venv/bin/python -m pytest "$@"
