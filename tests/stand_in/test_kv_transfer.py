"""The stand-in plays both sides of disaggregated prefill and decode as vLLM's NixlConnector does: the prefill side
keeps its blocks and answers kv_transfer_params, the decode side reads the prompt's KV instead of computing it."""

import json
import threading
import time

import httpx
import pytest

from support.paths import FIXTURES
from tests.support.processes import FAST

PROMPT = "the quick brown fox jumps over the lazy dog " * 40  # ~450 tokens at 4 bytes per token: 3 blocks of 128
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
NIXL = ("--kv-connector", "NixlConnector", *FAST)
ENGINE = ("--kv-connector", "NixlConnector", "--profile", "cpu", "--num-gpu-blocks", "64")


def prefill(url: str, prompt: str = PROMPT) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                                  "stream": False, "kv_transfer_params": REMOTE_DECODE}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def decode(url: str, params: dict, stream: bool = False, prompt: str = PROMPT) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 8,
                                                     "stream": stream, "kv_transfer_params": params}, timeout=10)


def state(url: str) -> dict:
    return httpx.get(url + "/sim/state", timeout=5).json()


def by_source(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            out[line.split('source="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.parametrize("mode", [NIXL, ENGINE], ids=["timed", "engine"])
def test_a_prefill_for_remote_decode_answers_the_parameters_a_decode_replica_needs(cluster, mode):
    p = cluster.sim(*mode)
    params = prefill(p.url)["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == state(p.url)["kv_transfer"]["engine_id"]
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", p.port)
    assert isinstance(params["remote_request_id"], str) and params["tp_size"] == 1
    assert len(params["remote_block_ids"]) == 1 and len(params["remote_block_ids"][0]) >= 3
    assert state(p.url)["kv_transfer"]["held"] == 1


def test_a_request_without_transfer_parameters_answers_none(cluster):
    p = cluster.sim(*NIXL)
    r = httpx.post(p.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1}, timeout=10)
    assert r.json()["kv_transfer_params"] is None and state(p.url)["kv_transfer"]["held"] == 0


@pytest.mark.parametrize("mode", [NIXL, ENGINE], ids=["timed", "engine"])
def test_a_decode_reads_the_prompt_from_the_prefill_replica_instead_of_computing_it(cluster, mode):
    p, d = cluster.sim(*mode), cluster.sim(*mode)
    params = prefill(p.url)["kv_transfer_params"]
    r = decode(d.url, params)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    sources = by_source(d.url)
    assert sources["external_kv_transfer"] == usage["prompt_tokens"]  # vLLM 0.32 counts the whole prompt as read
    assert sources["local_compute"] == 0 and sources["local_cache_hit"] == 0
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert usage["completion_tokens"] == 8
    # the prefill side freed the blocks once read, and the decode side's cache now holds the prompt
    assert state(p.url)["kv_transfer"]["held"] == 0 and state(p.url)["kv_transfer"]["sent_blocks"] >= 3
    assert state(d.url)["cached_blocks"] >= 3


def test_the_engine_keeps_a_prefills_blocks_in_use_until_they_are_read(cluster):
    p, d = cluster.sim(*ENGINE), cluster.sim(*ENGINE)
    params = prefill(p.url)["kv_transfer_params"]
    kept = state(p.url)["kv_transfer"]["kept_blocks"]
    assert kept == len(params["remote_block_ids"][0]) and state(p.url)["kv_blocks_in_use"] == kept
    assert decode(d.url, params).status_code == 200
    assert state(p.url)["kv_blocks_in_use"] == 0 and state(p.url)["kv_transfer"]["kept_blocks"] == 0


def test_blocks_nobody_reads_are_freed_when_their_lease_ends(cluster):
    p = cluster.sim(*ENGINE, "--kv-lease-s", "0.3")
    params = prefill(p.url)["kv_transfer_params"]
    assert state(p.url)["kv_transfer"]["held"] == 1
    time.sleep(0.5)
    httpx.post(p.url + "/sim/kv_pull", json={"remote_engine_id": "x", "remote_request_id": "y"}, timeout=5)
    s = state(p.url)
    assert s["kv_transfer"]["held"] == 0 and s["kv_transfer"]["expired"] == 1 and s["kv_blocks_in_use"] == 0
    r = httpx.post(p.url + "/sim/kv_pull", json={"remote_engine_id": params["remote_engine_id"],
                                                 "remote_request_id": params["remote_request_id"]}, timeout=5)
    assert r.status_code == 404


def test_a_decode_waiting_longer_than_the_lease_keeps_the_blocks_by_its_heartbeats(cluster):
    p = cluster.sim(*NIXL, "--kv-lease-s", "0.6")
    d = cluster.sim("--kv-connector", "NixlConnector", "--kv-lease-s", "0.6", "--max-num-seqs", "1",
                    "--ttft-ms", "1200", "--itl-ms", "1")
    params = prefill(p.url)["kv_transfer_params"]
    busy = threading.Thread(target=httpx.post, args=(d.url + "/v1/completions",),
                            kwargs={"json": {"model": "tiny", "prompt": "x", "max_tokens": 1}, "timeout": 10})
    busy.start()
    time.sleep(0.1)  # the decode replica's one slot is taken for 1.2 s: twice the lease
    r = decode(d.url, params)
    busy.join()
    assert r.status_code == 200, r.text
    assert state(d.url)["kv_transfer"]["heartbeats"] >= 3 and state(p.url)["kv_transfer"]["expired"] == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_decode_whose_blocks_are_gone_fails_as_vllm_does_by_default(cluster, stream):
    p, d = cluster.sim(*NIXL), cluster.sim(*NIXL)
    params = prefill(p.url)["kv_transfer_params"]
    assert decode(d.url, params).status_code == 200  # reads (and frees) them
    r = decode(d.url, params, stream=stream)  # a second read finds nothing
    if stream:
        assert r.status_code == 200 and '"InternalServerError"' in r.text and r.text.endswith("data: [DONE]\n\n")
    else:
        assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
    assert state(d.url)["kv_transfer"]["failed"] == 1


def test_with_recompute_a_decode_whose_blocks_are_gone_computes_its_prompt(cluster):
    p = cluster.sim(*NIXL)
    d = cluster.sim("--kv-connector", "NixlConnector", "--kv-load-failure-policy", "recompute", *FAST)
    params = prefill(p.url)["kv_transfer_params"]
    httpx.post(p.url + "/sim/kv_pull", json={"remote_engine_id": params["remote_engine_id"],
                                             "remote_request_id": params["remote_request_id"]}, timeout=5)
    r = decode(d.url, params)
    assert r.status_code == 200 and by_source(d.url)["external_kv_transfer"] == 0
    assert by_source(d.url)["local_compute"] == r.json()["usage"]["prompt_tokens"]


def test_parameters_lacking_a_field_are_ignored_and_the_prompt_computed(cluster):
    p, d = cluster.sim(*NIXL), cluster.sim(*NIXL)
    params = prefill(p.url)["kv_transfer_params"]
    del params["remote_request_id"]
    r = decode(d.url, params)
    assert r.status_code == 200 and by_source(d.url)["external_kv_transfer"] == 0
    assert state(d.url)["kv_transfer"]["ignored"] == 1
    assert state(p.url)["kv_transfer"]["held"] == 1  # nobody read them


def test_the_read_takes_the_links_time_for_the_prompts_kv(cluster):
    # 1 MB per token over 1 GB/s: ~450 tokens take ~0.45 s to read
    p = cluster.sim(*NIXL)
    d = cluster.sim("--kv-connector", "NixlConnector", "--kv-bytes-per-token", "1000000", "--kv-link-gbps", "1",
                    *FAST)
    params = prefill(p.url)["kv_transfer_params"]
    r = decode(d.url, params)
    tokens = r.json()["usage"]["prompt_tokens"]
    seconds = state(d.url)["kv_transfer"]["transfer_seconds"]
    assert tokens * 1e6 / 1e9 <= seconds < tokens * 1e6 / 1e9 + 0.3


@pytest.mark.parametrize("mode", [NIXL, ENGINE], ids=["timed", "engine"])
def test_the_prefill_answers_transfer_parameters_worded_as_vllm_0_32s(cluster, mode):
    real = json.loads((FIXTURES / "vllm-0.32" / "kv-transfer-prefill.json").read_text())
    got = prefill(cluster.sim(*mode).url)
    assert set(got) == set(real) and set(got["kv_transfer_params"]) == set(real["kv_transfer_params"])
    for key in ("do_remote_prefill", "do_remote_decode", "tp_size", "dcp_size", "pp_size",
                "remote_blocks_expiry_time", "transfer_mode", "remote_prefill_cached_tokens"):
        assert got["kv_transfer_params"][key] == real["kv_transfer_params"][key], key
    assert got["kv_transfer_params"]["remote_num_tokens"] == got["usage"]["prompt_tokens"]
    assert got["kv_transfer_params"]["remote_block_ids"][0][0] == 1  # block 0 is vLLM's null block


@pytest.mark.parametrize("mode", [NIXL, ENGINE], ids=["timed", "engine"])
def test_a_decode_counts_its_prompt_as_vllm_0_32_does_read_less_its_own_whole_blocks(cluster, mode):
    # real: 1,163 tokens read, then the same again with 9 of its 10 blocks held: 1,152 hit, 11 read, none computed
    p, d = cluster.sim(*mode), cluster.sim(*mode)
    params = prefill(p.url)["kv_transfer_params"]
    first = decode(d.url, params).json()["usage"]
    params = prefill(p.url)["kv_transfer_params"]
    second = decode(d.url, params).json()["usage"]
    n = first["prompt_tokens"]
    held = (n - 1) // 128 * 128
    assert by_source(d.url) == {"local_compute": 0, "local_cache_hit": held, "external_kv_transfer": 2 * n - held}
    assert first["prompt_tokens_details"]["cached_tokens"] == second["prompt_tokens_details"]["cached_tokens"] == 0
