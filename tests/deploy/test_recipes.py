"""Deployment recipes for Gaudi and Aurora: what they set is what vLLM and the platform's sources name."""

from __future__ import annotations

import json
import re
import subprocess


from support.recipes import AURORA_SCRIPTS, GAUDI_COMPOSE, aurora_command, gaudi_service
from router import plan as P
from support.paths import FIXTURES

# Every environment variable a recipe sets, and where it is named.
NAMED = {
    "PT_HPU_RECIPE_CACHE_CONFIG": "reference/vllm.md, Gaudi notes (recipe cache: <dir>,<delete?>,<MB>)",
    "VLLM_DECODE_BS_BUCKET_MAX": "vllm-gaudi bucketing settings (decode batch-size buckets)",
    "VLLM_DECODE_BLOCK_BUCKET_MAX": "vllm-gaudi bucketing settings (decode block buckets)",
    "HABANA_VISIBLE_DEVICES": "Habana container runtime (which cards the container sees)",
    "OMPI_MCA_btl_vader_single_copy_mechanism": "Gaudi container docs (shared-memory transport in containers)",
    "HF_HOME": "Hugging Face hub cache location",
    "HF_HUB_OFFLINE": "Hugging Face hub: never download",
    "VLLM_HOST_IP": "issue and reference: the node address vLLM advertises",
    "ZE_AFFINITY_MASK": "oneAPI Level Zero: the GPU tiles a process sees (GPU.tile)",
    "PYTHONPATH": "dry runs only: the stand-in replica from this checkout",
    "HABANA_VISIBLE_MODULES": "Habana runtime: the cards (modules) one process uses",
    "QUANT_CONFIG": "vllm-gaudi FP8 (Intel Neural Compressor measurement config)",
    "CUDA_VISIBLE_DEVICES": "CUDA runtime: the GPUs one process uses",
    "VLLM_TARGET_DEVICE": "reference/vllm.md: the CPU build",
    "VLLM_CPU_KVCACHE_SPACE": "reference/vllm.md: the CPU build's KV cache size in GiB",
}


def test_every_environment_variable_a_recipe_sets_is_named_in_the_sources():
    names = set(gaudi_service()["environment"])
    for script in AURORA_SCRIPTS:
        for line in script.read_text().splitlines():
            if line.lstrip().startswith("export "):  # what vLLM (and Ray) inherit
                names |= set(re.findall(r"export ([A-Z][A-Z0-9_]+)=", line))
            elif line.rstrip().endswith("\\") and len(re.findall(r"(?:^|\s)[A-Z][A-Z0-9_]+=", line)) >= 2:
                # assignments in front of a replica's command, on the line before it
                names |= set(re.findall(r"(?:^|\s)([A-Z][A-Z0-9_]+)=", line))
    assert {"ZE_AFFINITY_MASK", "VLLM_HOST_IP"} <= names
    unknown = sorted(n for n in names if n not in NAMED)
    assert not unknown, unknown


def test_the_gaudi_replica_is_tp8_with_block_128_prefix_caching_events_and_a_persistent_recipe_cache():
    svc = gaudi_service()
    cmd = [str(a) for a in svc["command"]]
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "8"
    assert cmd[cmd.index("--block-size") + 1] == "128"
    assert "--enable-prefix-caching" in cmd
    events = json.loads(cmd[cmd.index("--kv-events-config") + 1])
    assert events["publisher"] == "zmq" and events["replay_endpoint"].startswith("tcp://*:")
    cache_dir = svc["environment"]["PT_HPU_RECIPE_CACHE_CONFIG"].split(",")
    assert cache_dir[1] == "False"  # reuse what an earlier start compiled
    assert any(v.startswith("recipe-cache:" + cache_dir[0]) for v in svc["volumes"])


def test_the_gaudi_health_check_waits_longer_than_a_cold_fp8_warm_up():
    start = gaudi_service()["healthcheck"]["start_period"]
    assert start.endswith("s") and int(start[:-1]) > 504  # the sources' FP8 warm-up without the recipe cache


def test_aurora_replicas_get_their_own_tiles_and_ports():
    out = subprocess.run(["bash", "-c", f"source <(sed -n '/^tiles()/,/^}}/p' {AURORA_SCRIPTS[0]}); "
                          "tiles 0 4; tiles 4 4; tiles 8 4; tiles 6 1"], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0.0,0.1,1.0,1.1", "2.0,2.1,3.0,3.1", "4.0,4.1,5.0,5.1", "3.0"]
    cmd = aurora_command(AURORA_SCRIPTS[0], TP="2", BASE_PORT="9000")
    assert cmd[cmd.index("--port") + 1] == "9000" and cmd[cmd.index("--tensor-parallel-size") + 1] == "2"


def test_the_pipeline_parallel_recipe_is_marked_as_the_slow_path():
    text = AURORA_SCRIPTS[1].read_text()
    assert "SLOW PATH" in text and "0.05-0.1 token/s" in text
    cmd = aurora_command(AURORA_SCRIPTS[1], NODES="3")
    assert cmd[cmd.index("--pipeline-parallel-size") + 1] == "3"
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "ray"
    assert GAUDI_COMPOSE.exists()


def test_every_environment_variable_the_planner_prints_is_named_in_the_sources():
    config = FIXTURES / "models" / "gemma-2-9b.json"
    targets = [P.Target("gaudi2", dtype="fp8"), P.Target("gaudi3"), P.Target("aurora-pvc", tp=2), P.Target("cuda"),
               P.Target("cpu")]
    names = {k for t in targets for env, _ in P.serve_commands(P.plan(config, t)) for k in env}
    assert {"PT_HPU_RECIPE_CACHE_CONFIG", "ZE_AFFINITY_MASK", "VLLM_HOST_IP"} <= names
    assert not sorted(names - set(NAMED))
