"""``kvroute plan`` against real vLLM (marker ``vllm``): its block count and its commands, checked by vLLM itself."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from loadtest import vllm_cluster
from loadtest.cluster import HTTP, Proc
from router import plan as P
from router.replicas.stats import parse_metrics
from support.paths import FIXTURES
from support.recipes import serve_commands as recipe_commands

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MODELS = FIXTURES / "models"

# vLLM's own parser for ``vllm serve``: the positional model, then every flag
PARSE = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
parser.add_argument("model_tag")
for argv in json.load(sys.stdin):
    assert argv[:2] == ["vllm", "serve"], argv
    ns = parser.parse_args(argv[2:])
    print(json.dumps({"model": ns.model_tag, "tp": ns.tensor_parallel_size, "pp": ns.pipeline_parallel_size,
                      "block_size": ns.block_size, "kv_events": ns.kv_events_config is not None}))
"""


@pytest.fixture(scope="module")
def home() -> Path:
    return vllm_cluster.setup()


@pytest.fixture(scope="module")
def sized_by_vllm(home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """A tiny replica whose cache vLLM sizes from VLLM_CPU_KVCACHE_SPACE=1 (no block override)."""
    procs = vllm_cluster.start([vllm_cluster.replica(home, num_gpu_blocks=None, name="vllm-sized",
                                                     log_dir=tmp_path_factory.mktemp("vllm-sized"))])
    yield procs[0]
    procs[0].stop(timeout=15)


def test_the_planner_predicts_the_num_gpu_blocks_vllm_reports(home, sized_by_vllm):
    p = P.plan(vllm_cluster.model_dir(home), P.Target("cpu", kv_cache_space_gib=1, max_model_len=4096))
    reported = parse_metrics(HTTP.get(sized_by_vllm.url + "/metrics", timeout=10).text)
    assert p.chosen is not None
    assert reported.block_size == p.block_size == 128
    assert p.chosen.num_gpu_blocks == reported.num_gpu_blocks


def plans() -> list[P.Plan]:
    targets = [("gemma-2-9b", P.Target("gaudi2", tp=8)),
               ("deepseek-v3", P.Target("gaudi3", dtype="fp8", max_model_len=32768)),
               ("gemma-2-9b", P.Target("aurora-pvc", tp=4)),
               ("llama-3.1-405b", P.Target("gaudi2", nodes=2, max_model_len=131072)),
               ("gemma-2-9b", P.Target("cuda", dtype="fp8", kv_cache_dtype="fp8")),
               ("gemma-2-9b", P.Target("cpu"))]
    return [P.plan(MODELS / f"{name}.json", t) for name, t in targets]


def parse_with_vllm(home: Path, commands: list[list[str]]) -> list[dict]:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    r = subprocess.run([str(home / "venv" / "bin" / "python"), "-c", PARSE], input=json.dumps(commands),
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    parsed = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(parsed) == len(commands)
    return parsed


def test_every_vllm_serve_command_the_planner_prints_parses_with_vllms_own_parser(home):
    commands = [(p, argv) for p in plans() for _env, argv in P.serve_commands(p)]
    parsed = parse_with_vllm(home, [a for _, a in commands])
    for (p, _argv), ns in zip(commands, parsed):
        assert ns["tp"] == p.chosen.tp and ns["pp"] == p.chosen.pp and ns["block_size"] == p.block_size
        assert ns["kv_events"] and ns["model"] == str(MODELS)


def test_every_vllm_serve_command_of_the_gaudi_and_aurora_recipes_parses_with_vllms_own_parser(home):
    commands = recipe_commands()
    parsed = parse_with_vllm(home, commands)
    assert [(ns["tp"], ns["pp"], ns["block_size"]) for ns in parsed] == [(8, 1, 128), (4, 1, 64), (8, 2, 64)]
    assert all(ns["kv_events"] for ns in parsed)
