#!/usr/bin/env bash
# Creates .venv (Python >= 3.11) with kvroute installed; extra arguments are pip extras, e.g. "test".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "kvroute needs Python >= 3.11 (set PYTHON=/path/to/python3.11)" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv 2>/dev/null || {
    # Debian/Ubuntu ship venv separately
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
      apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
      "$PY" -m venv .venv
    else
      echo "python3 -m venv failed: install the python3-venv package" >&2
      exit 1
    fi
  }
fi
# A C compiler and Python's headers compile kvroute's word cutter (router/_wordscan.c); without them the install
# goes on and prompts are keyed in Python alone, a little slower.
if ! command -v cc >/dev/null || [ ! -f "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ]; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq gcc libc6-dev python3-dev >/dev/null || true
  else
    echo "no C compiler or Python headers: kvroute's C word cutter is not compiled (prompts keyed in Python)" >&2
  fi
fi
extras=""
[ $# -gt 0 ] && extras="[$(IFS=,; echo "$*")]"
stamp=".venv/.kvroute-installed$extras"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ router/_wordscan.c -nt "$stamp" ] \
    || { command -v cc >/dev/null && ! ls router/_wordscan.*.so >/dev/null 2>&1; }; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q -e ".$extras"
  touch "$stamp"
fi
