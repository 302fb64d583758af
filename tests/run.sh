#!/usr/bin/env bash
# Sets up the test environment and runs the tests; arguments go to pytest (e.g. -m vllm, -k name).
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup-venv.sh test
# Real services the tests start themselves: redis-server, and Debian's prometheus (with promtool).
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v redis-cli >/dev/null || missing+=(redis-tools)  # redis-cli --cluster create: the Redis Cluster tests
{ command -v prometheus >/dev/null && command -v promtool >/dev/null; } || missing+=(prometheus)
if [ ${#missing[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "missing: ${missing[*]}: install them (apt-get install ${missing[*]})" >&2
    exit 1
  fi
fi
exec .venv/bin/python -m pytest "$@"
