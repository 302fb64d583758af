"""The deployment recipes' vllm serve commands and environments, as the tests read them."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import yaml

from .paths import DEPLOY

GAUDI_COMPOSE = DEPLOY / "gaudi" / "docker-compose.yml"
AURORA_SCRIPTS = (DEPLOY / "aurora" / "kvroute-replicas.pbs", DEPLOY / "aurora" / "pipeline-parallel-ray.pbs")


def env_example() -> dict[str, str]:
    out = {}
    for line in (DEPLOY / "gaudi" / "env.example").read_text().splitlines():
        if line and not line.startswith("#") and "=" in line:
            k, _, v = line.partition("=")
            out[k] = v or "image"
    return out


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?message}."""
    def one(m: re.Match[str]) -> str:
        name, op, rest = m.group(1), m.group(2), m.group(3)
        if env.get(name):
            return env[name]
        if op == ":-":
            return rest or ""
        raise KeyError(f"{name} is not set ({rest})")
    return re.sub(r"\$\{([A-Z_][A-Z0-9_]*)(?:(:-|:\?)([^}]*))?\}", one, text)


def gaudi_service(env: dict[str, str] | None = None) -> dict:
    return yaml.safe_load(interpolate(GAUDI_COMPOSE.read_text(), env or env_example()))["services"]["vllm"]


def aurora_command(script: Path, **env: str) -> list[str]:
    out = subprocess.run(["bash", str(script), "print-command"], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "KVROUTE_URL": "http://router:8000", "DRY_RUN": "0", "NODES": "2",
                              "VLLM_HOST_IP": "10.0.0.1", **env}, check=True).stdout
    return out.splitlines()


def serve_commands() -> list[list[str]]:
    """Every recipe's vllm serve argv."""
    return [[str(a) for a in gaudi_service()["command"]],
            *(aurora_command(s) for s in AURORA_SCRIPTS)]
