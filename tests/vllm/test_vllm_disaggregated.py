"""Disaggregated prefill and decode on real vLLM (marker ``vllm``): two CPU replicas of the tiny Llama, both with
vLLM's NixlConnector (NIXL over UCX in host memory), one of role prefill and one of role decode behind kvroute.

The decode replica must report the prompt as read from the prefill replica (vLLM's own
``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}``), not computed, and the answer must be the one
a replica computing the whole request gives, token for token (greedy).
"""

from __future__ import annotations

import json
from typing import Iterator

import httpx
import pytest

from support.processes import Cluster
from loadtest import vllm_cluster
from loadtest.cluster import Proc

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 128


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    home = vllm_cluster.setup()
    log_dir = tmp_path_factory.mktemp("vllm-pd")
    procs = vllm_cluster.start([vllm_cluster.replica(home, log_dir=log_dir, name=role, block_size=BLOCK,
                                                     kv_transfer=True, extra=("--enable-prompt-tokens-details",))
                                for role in ("prefill", "decode")])
    yield dict(zip(("prefill", "decode"), procs))
    for p in procs:
        p.stop(timeout=15)


@pytest.fixture(scope="module")
def gateway(pair: dict[str, Proc], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    c = Cluster(tmp_path_factory.mktemp("router"))
    replicas = [{"name": role, "url": p.url, "role": role} for role, p in pair.items()]
    # these tests judge the protocol, not stall detection: a CPU replica on this 2-core machine once took a chat
    # request and counted no token for 7 s (health.stall_s), and the router rightly sent it on, whole, to the
    # decode replica
    yield c.router([], config={"replicas": replicas, "health": {"stall_s": 60}}, wait_ready=True)
    c.stop_all()


def prompt(topic: str) -> str:
    """A prompt of about 1,700 tokens (13 blocks), its own for each test so that no cache holds it before."""
    return f"{topic}: " + " ".join(f"{topic} item {i} is ready." for i in range(110))


def by_source(replica: Proc) -> dict[str, float]:
    return {k.split('source="')[1].split('"')[0]: v for k, v in _samples(replica).items()
            if k.startswith("vllm:prompt_tokens_by_source_total{")}


def _samples(replica: Proc) -> dict[str, float]:
    out = {}
    for line in httpx.get(replica.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name.replace('engine="0",', "").replace('model_name="tiny",', "").replace(",}", "}")] = float(value)
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def stream_text(response: httpx.Response) -> tuple[str, dict]:
    """The text of a completions stream and its usage chunk."""
    text, usage = "", {}
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            text += "".join(c["text"] for c in chunk["choices"])
            usage = chunk.get("usage") or usage
    return text, usage


def test_the_decode_replica_reads_the_prompt_from_the_prefill_replica_instead_of_computing_it(gateway, pair):
    before = by_source(pair["decode"])
    r = httpx.post(gateway.url + "/v1/completions", json={"model": "tiny", "prompt": prompt("harbour"),
                                                          "max_tokens": 8, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["x-kvroute-prefill-replica"] == "prefill" and r.headers["x-kvroute-replica"] == "decode"
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    got = delta(by_source(pair["decode"]), before)
    assert got == {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": prompt_tokens}


def test_a_split_stream_is_the_answer_of_the_whole_request_token_for_token(gateway, pair):
    body = {"model": "tiny", "prompt": prompt("meadow"), "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    before = by_source(pair["decode"])
    r = httpx.post(gateway.url + "/v1/completions", json={**body, "stream": True,
                                                          "stream_options": {"include_usage": True}}, timeout=120)
    assert r.status_code == 200 and r.headers["x-kvroute-prefill-replica"] == "prefill"
    text, usage = stream_text(r)
    assert delta(by_source(pair["decode"]), before)["external_kv_transfer"] >= 1000  # read, not computed
    # the same request computed whole by the prefill replica, without any transfer (its prefix cache now holds
    # the prompt, which changes no token of a greedy answer)
    whole = httpx.post(pair["prefill"].url + "/v1/completions", json=body, timeout=120).json()
    assert text == whole["choices"][0]["text"]
    assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]  # the prompt counted once
    assert usage["completion_tokens"] == 24


def test_a_chat_request_is_split_and_answered(gateway, pair):
    before = by_source(pair["decode"])
    r = httpx.post(gateway.url + "/v1/chat/completions", json={
        "model": "tiny", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "system", "content": prompt("orchard")}, {"role": "user", "content": "and then?"}]},
        timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["x-kvroute-prefill-replica"] == "prefill" and r.headers["x-kvroute-replica"] == "decode"
    assert r.json()["choices"][0]["message"]["content"]
    assert delta(by_source(pair["decode"]), before)["external_kv_transfer"] >= 1000
