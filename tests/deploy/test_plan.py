"""``kvroute plan``: capacity arithmetic from published config.json values (fixtures in tests/fixtures/models)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from router import plan as P
from router.config import load_config
from support.paths import FIXTURES

MODELS = FIXTURES / "models"
LLAMA_405B = MODELS / "llama-3.1-405b.json"
DEEPSEEK_V3 = MODELS / "deepseek-v3.json"
GEMMA_2 = MODELS / "gemma-2-9b.json"


def shape(path: Path) -> P.ModelShape:
    return P.shape_of(P.read_config(path)[0])


def kvroute(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "router", *args], capture_output=True, text=True, timeout=60)


def test_llama_405b_bf16_matches_the_sources_example():
    p = P.plan(LLAMA_405B, P.Target("gaudi2", nodes=2, max_model_len=131072))
    assert round(p.weights.bytes / 1e9) == 812
    assert round(p.kv.per_sequence(131072) / 1e9, 1) == 67.6
    assert p.kv.per_token == 126 * 2 * 8 * 128 * 2


def test_grouped_query_attention_splits_kv_heads_over_the_tp_group():
    s = shape(LLAMA_405B)
    assert P.kv_bytes(s, 2, tp=8).per_token == 126 * 2 * 1 * 128 * 2
    assert P.kv_bytes(s, 2, tp=16).per_token == 126 * 2 * 1 * 128 * 2  # fewer KV heads than ranks: replicated


def test_mla_caches_one_latent_per_layer_on_every_device():
    s = shape(DEEPSEEK_V3)
    assert s.mla
    assert P.kv_bytes(s, 2).per_token == 61 * (512 + 64) * 2
    assert P.kv_bytes(s, 2, tp=8).per_token == 61 * (512 + 64) * 2
    assert round(P.parameters(s) / 1e9) == 671  # the published size of the main model


def test_sliding_window_layers_keep_only_their_window_of_a_sequence():
    s = shape(GEMMA_2)
    kv = P.kv_bytes(s, 2)
    per_layer = 2 * 8 * 256 * 2
    assert s.sliding_layers == 21 and kv.window == 4096
    assert kv.per_sequence(8192) == 21 * per_layer * 8192 + 21 * per_layer * 4096
    assert kv.per_sequence(1000) == 42 * per_layer * 1000
    assert round(P.parameters(s) / 1e9, 2) == 9.24  # tied embeddings, as Gemma's config implies


def test_a_tp_size_that_does_not_divide_the_heads_is_refused_with_the_reason():
    cfg = {**json.loads(GEMMA_2.read_text()), "num_attention_heads": 12, "num_key_value_heads": 4}
    p = P.plan(_write(cfg), P.Target("gaudi2", max_model_len=8192))
    fits = {o.tp: o.fits for o in p.options}
    assert fits == {1: True, 2: True, 4: True, 8: False}
    assert "12 attention heads do not divide by TP 8" in p.options[-1].why


def _write(cfg: dict) -> Path:
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="kvroute-plan-"))
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_fp8_on_aurora_is_refused_with_the_reason():
    r = kvroute("plan", str(GEMMA_2), "--platform", "aurora-pvc", "--dtype", "fp8")
    assert r.returncode == 2
    assert "FP8 is not supported on Intel PVC" in r.stderr


def test_a_model_too_large_for_one_node_gets_a_pipeline_parallel_replica_marked_slow():
    p = P.plan(LLAMA_405B, P.Target("gaudi2", nodes=2, max_model_len=131072))
    assert not any(o.fits for o in p.options if o.pp == 1)
    assert p.chosen is not None and (p.chosen.tp, p.chosen.pp) == (8, 2)
    assert "slow path" in p.chosen.why
    env, argv = P.serve_commands(p)[0]
    assert argv[argv.index("--pipeline-parallel-size") + 1] == "2"


def test_weights_come_from_the_safetensors_index_when_it_is_there():
    cfg = json.loads(GEMMA_2.read_text())
    d = _write({**cfg, "torch_dtype": "bfloat16"})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 18_000_000_000},
                                                                "weight_map": {}}))
    w = P.weights(shape(d / "config.json"), d, "bf16")
    assert w.bytes == 18_000_000_000 and "index" in w.source
    assert P.weights(shape(d / "config.json"), d, "fp8").bytes == 9_000_000_000


def test_more_replicas_per_node_with_smaller_tp_and_aurora_tp8_uses_eight_tiles():
    p = P.plan(GEMMA_2, P.Target("aurora-pvc", nodes=2, max_model_len=8192))
    per_node = {o.tp: o.replicas_per_node for o in p.options}
    assert per_node == {1: 12, 2: 6, 4: 3, 8: 1}
    blocks = [o.num_gpu_blocks for o in p.options]
    assert blocks == sorted(blocks)  # larger replicas hold more cache each
    assert p.chosen is not None and p.chosen.tp == 1


def test_the_printed_config_is_a_valid_kvroute_configuration(tmp_path):
    r = kvroute("plan", str(GEMMA_2), "--platform", "gaudi3", "--nodes", "2", "--format", "json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    path = tmp_path / "kvroute.yaml"
    path.write_text(yaml.safe_dump(out["kvroute_config"]).replace("NODE-", "node-"))
    cfg = load_config(path)
    assert len(cfg.replicas) == 2 * out["options"][0]["replicas_per_node"]
    assert {r.platform for r in cfg.replicas} == {"gaudi3"}
    assert all(r.num_gpu_blocks == out["options"][0]["num_gpu_blocks"] for r in cfg.replicas)


def test_prefill_nodes_give_their_replicas_role_prefill_and_the_rest_decode(tmp_path):
    r = kvroute("plan", str(GEMMA_2), "--platform", "gaudi2", "--nodes", "3", "--prefill-nodes", "1", "--tp", "8",
                "--format", "json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    path = tmp_path / "kvroute.yaml"
    path.write_text(yaml.safe_dump(out["kvroute_config"]).replace("NODE-", "node-"))
    assert [(r.name, r.role) for r in load_config(path).replicas] == [
        ("node0-r0", "prefill"), ("node1-r0", "decode"), ("node2-r0", "decode")]
    assert out["roles"] == ["prefill", "decode"]


@pytest.mark.parametrize(("platform", "buffer"), [("gaudi3", "hpu"), ("aurora-pvc", "xpu"), ("cuda", "cuda")])
def test_replicas_of_a_disaggregated_plan_run_the_nixl_connector_on_the_platforms_buffer(platform, buffer):
    r = kvroute("plan", str(GEMMA_2), "--platform", platform, "--nodes", "2", "--prefill-nodes", "1", "--format",
                "json")
    assert r.returncode == 0, r.stderr
    serve = json.loads(r.stdout)["vllm_serve"]
    for cmd in serve:
        config = json.loads(cmd["argv"][cmd["argv"].index("--kv-transfer-config") + 1])
        assert config == {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": buffer}
        assert cmd["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "$(hostname -i)"
    ports = [cmd["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] for cmd in serve]
    assert len(set(ports)) == len(serve)  # one side channel per replica of a node


def test_a_plan_without_prefill_nodes_has_no_roles_and_no_connector():
    out = json.loads(kvroute("plan", str(GEMMA_2), "--platform", "gaudi2", "--nodes", "2", "--format", "json").stdout)
    assert all("role" not in r for r in out["kvroute_config"]["replicas"]) and out["roles"] == ["both"]
    assert all("--kv-transfer-config" not in cmd["argv"] for cmd in out["vllm_serve"])


@pytest.mark.parametrize("n", ["2", "-1"])
def test_prefill_nodes_that_leave_no_decode_node_are_refused_naming_the_flag(n):
    r = kvroute("plan", str(GEMMA_2), "--platform", "gaudi2", "--nodes", "2", "--prefill-nodes", n)
    assert r.returncode == 2 and "--prefill-nodes" in r.stderr


def test_text_output_has_the_table_the_config_and_one_command_per_replica():
    r = kvroute("plan", str(DEEPSEEK_V3), "--platform", "gaudi3", "--nodes", "4", "--dtype", "fp8",
                "--max-model-len", "32768")
    assert r.returncode == 0, r.stderr
    assert "| TP x PP |" in r.stdout and "chosen: TP 8" in r.stdout
    commands = [line for line in r.stdout.splitlines() if "vllm serve" in line]
    assert len(commands) == 1 and "--quantization inc" in commands[0] and "PT_HPU_RECIPE_CACHE_CONFIG=" in commands[0]


def test_a_missing_model_is_an_error_that_says_nothing_is_downloaded(tmp_path):
    r = kvroute("plan", "meta-llama/Llama-3.1-8B", "--platform", "cuda")
    assert r.returncode == 2 and "nothing is downloaded" in r.stderr
