"""Disaggregated prefill and decode: a request is split into a prefill on a replica of role prefill and a decode on
one of role decode, over vLLM's kv_transfer_params protocol, and only where that pays."""

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.support.processes import FAST
from tests.support.waiting import wait_until

NIXL = ("--kv-connector", "NixlConnector", *FAST)
LONG = "the quick brown fox jumps over the lazy dog " * 200  # 8,800 bytes: ~2,200 tokens in byte mode
SHORT = "hello there"


def fresh(i: int) -> str:
    """A long prompt no replica holds yet (a decode replica holding one takes it whole, prefilled nowhere)."""
    return f"request {i}: {LONG}"


def fleet(cluster, roles: list[str], sims: dict[str, tuple[str, ...]] | None = None, **settings):
    """Stand-ins of the given roles (``role``, or ``role:platform``; named by role and number) behind a router."""
    procs, replicas = {}, []
    for i, spec in enumerate(roles):
        role, _, platform = spec.partition(":")
        name = f"{role}{i}"
        procs[name] = cluster.sim(*(sims or {}).get(name, NIXL))
        replicas.append({"name": name, "url": procs[name].url, "role": role, "platform": platform or "cuda"})
    router = cluster.router([], config={"replicas": replicas, **settings})
    return router, procs


def complete(router, prompt: str = LONG, stream: bool = False, max_tokens: int = 6, timeout: float = 10) -> httpx.Response:
    return httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": prompt,
                                                            "max_tokens": max_tokens, "stream": stream},
                      timeout=timeout)


def state(proc) -> dict:
    return httpx.get(proc.url + "/sim/state", timeout=5).json()


def outcomes(router) -> dict[str, float]:
    out = {}
    for line in httpx.get(router.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("kvroute_disaggregated_requests_total{"):
            out[line.split('outcome="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def test_the_prefill_replica_gets_one_token_for_a_remote_decode_and_the_decode_replica_its_kv(cluster):
    router, sims = fleet(cluster, ["prefill", "decode"])
    r = complete(router)
    assert r.status_code == 200, r.text
    assert r.headers["x-kvroute-prefill-replica"] == "prefill0" and r.headers["x-kvroute-replica"] == "decode1"
    sent = state(sims["prefill0"])["counters"]["last_body"]
    assert sent["max_tokens"] == 1 and sent["stream"] is False and sent["kv_transfer_params"]["do_remote_decode"]
    decode = state(sims["decode1"])
    assert decode["counters"]["last_body"]["max_tokens"] == 6  # the client's own request
    assert decode["kv_transfer"]["transfers"] == 1
    assert decode["kv_transfer"]["received_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert r.json()["usage"]["completion_tokens"] == 6 and "kv_transfer_params" in r.json()
    assert outcomes(router) == {"split": 1.0}


def test_the_request_log_names_the_prefill_replica_and_how_long_the_prefill_took(cluster):
    replicas = [cluster.sim(*NIXL), cluster.sim(*NIXL)]
    router = cluster.router([], "--log-json", config={"replicas": [
        {"name": "prefill0", "url": replicas[0].url, "role": "prefill"},
        {"name": "decode1", "url": replicas[1].url, "role": "decode"}]})
    r = complete(router)
    assert r.status_code == 200
    rid = r.headers["x-request-id"]

    def line() -> dict | None:
        for text in router.log_tail(200_000).splitlines():
            if text.startswith("{") and f'"request_id":"{rid}"' in text and '"decision"' in text:
                return json.loads(text)
        return None

    wait_until(lambda: line() is not None, timeout=5)
    logged = line()
    assert logged["replica"] == "decode1" and logged["prefill_replica"] == "prefill0"
    assert logged["prefill_cached_tokens"] == 0 and 0 < logged["prefill_ms"] <= logged["ttfb_ms"]


def test_a_streamed_request_streams_the_decode_replicas_answer(cluster):
    router, sims = fleet(cluster, ["prefill", "decode"])
    r = complete(router, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text.count("data: ") == 7 and r.text.endswith("data: [DONE]\n\n")
    assert state(sims["prefill0"])["counters"]["last_body"]["stream"] is False
    assert state(sims["decode1"])["kv_transfer"]["transfers"] == 1


def test_a_short_prompt_goes_whole_to_a_replica_of_role_both(cluster):
    router, sims = fleet(cluster, ["both", "prefill", "decode"])
    r = complete(router, SHORT)
    assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "both0"
    assert "x-kvroute-prefill-replica" not in r.headers
    assert state(sims["prefill1"])["counters"]["received"] == 0 and state(sims["decode2"])["counters"]["received"] == 0


def test_a_long_uncached_prompt_is_split_although_a_replica_of_role_both_could_take_it(cluster):
    router, sims = fleet(cluster, ["both", "prefill", "decode"])
    r = complete(router)
    assert r.status_code == 200 and r.headers["x-kvroute-prefill-replica"] in ("both0", "prefill1")
    assert r.headers["x-kvroute-replica"] in ("both0", "decode2")


def test_a_fleet_without_replicas_of_role_both_splits_a_long_prompt(cluster):
    router, sims = fleet(cluster, ["prefill", "decode"])
    r = complete(router)
    assert r.status_code == 200 and r.headers["x-kvroute-prefill-replica"] == "prefill0"


def test_a_short_prompt_goes_whole_to_a_decode_replica_where_no_replica_takes_both(cluster):
    router, sims = fleet(cluster, ["prefill", "decode"])
    r = complete(router, SHORT)
    assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "decode1"
    assert "x-kvroute-prefill-replica" not in r.headers and state(sims["prefill0"])["counters"]["received"] == 0
    assert "kv_transfer_params" not in state(sims["decode1"])["counters"]["last_body"]
    assert outcomes(router) == {"local": 1.0}


def test_the_next_turn_of_a_conversation_decoded_on_a_decode_replica_is_prefilled_nowhere_else(cluster):
    router, sims = fleet(cluster, ["prefill", "prefill", "decode", "decode"])
    first = complete(router)
    decoded_on = first.headers["x-kvroute-replica"]
    assert first.headers["x-kvroute-prefill-replica"].startswith("prefill")
    follow_up = LONG + first.json()["choices"][0]["text"] + " and what came next?"
    r = complete(router, follow_up)
    assert r.status_code == 200 and r.headers["x-kvroute-replica"] == decoded_on
    assert "x-kvroute-prefill-replica" not in r.headers
    assert sum(state(sims[n])["counters"]["received"] for n in ("prefill0", "prefill1")) == 1
    assert outcomes(router) == {"split": 1.0, "local": 1.0}


def test_with_disaggregation_off_every_request_goes_whole_to_a_replica_of_role_both(cluster):
    router, sims = fleet(cluster, ["both", "prefill", "decode"], disaggregation={"enabled": False})
    assert all(complete(router).headers["x-kvroute-replica"] == "both0" for _ in range(3))
    assert state(sims["prefill1"])["counters"]["received"] == 0


def test_a_prefill_replica_that_fails_is_replaced_by_another(cluster):
    router, sims = fleet(cluster, ["prefill", "prefill", "decode"],
                         sims={"prefill0": ("--fail-status", "500", "--fail-count", "100", *NIXL),
                               "prefill1": ("--fail-status", "500", "--fail-count", "100", *NIXL)})
    httpx.post(sims["prefill1"].url + "/sim/faults", json={"fail_count": 0}, timeout=5)
    for i in range(4):
        r = complete(router, fresh(i))
        assert r.status_code == 200 and r.headers["x-kvroute-prefill-replica"] == "prefill1"
    assert state(sims["decode2"])["kv_transfer"]["transfers"] == 4


def test_a_prefill_that_names_no_kv_leaves_the_prompt_to_the_decode_replica(cluster):
    # a prefill replica started without a KV connector answers kv_transfer_params: null
    router, sims = fleet(cluster, ["prefill", "decode"], sims={"prefill0": FAST})
    r = complete(router)
    assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "decode1"
    assert "kv_transfer_params" not in state(sims["decode1"])["counters"]["last_body"]
    assert state(sims["decode1"])["kv_transfer"]["transfers"] == 0
    assert outcomes(router) == {"no_transfer_params": 1.0}


@pytest.mark.parametrize("garbage", ["a string", {"do_remote_prefill": True, "remote_block_ids": "1,2"},
                                     {"remote_engine_id": "x" * 5000}, [1, 2]])
def test_transfer_parameters_the_prefill_answers_malformed_leave_the_prompt_to_the_decode_replica(cluster, garbage):
    router, sims = fleet(cluster, ["prefill", "decode"])
    httpx.post(sims["prefill0"].url + "/sim/faults", json={"transfer_params": garbage}, timeout=5)
    r = complete(router)
    assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "decode1"
    assert "kv_transfer_params" not in state(sims["decode1"])["counters"]["last_body"]
    assert outcomes(router) == {"no_transfer_params": 1.0}


def test_the_clients_own_error_from_the_prefill_is_answered_as_it_is(cluster):
    router, sims = fleet(cluster, ["prefill", "decode"])
    r = complete(router, prompt="")
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
    assert state(sims["decode1"])["counters"]["received"] == 0


def test_a_client_that_leaves_during_the_prefill_aborts_it_on_the_replica(cluster):
    slow = ("--kv-connector", "NixlConnector", "--ttft-ms", "3000", "--itl-ms", "1")
    router, sims = fleet(cluster, ["prefill", "decode"], sims={"prefill0": slow})
    with pytest.raises(httpx.TimeoutException):
        complete(router, timeout=0.5)
    for _ in range(50):
        if state(sims["prefill0"])["counters"]["aborted"] == 1:
            break
        time.sleep(0.1)
    assert state(sims["prefill0"])["counters"]["aborted"] == 1
    assert state(sims["decode1"])["counters"]["received"] == 0


def test_a_decode_attempt_that_failed_after_its_request_went_out_is_prefilled_again(cluster):
    # decode1 answers 500 to every request it gets (the blocks it was to read may be gone: a new prefill first)
    router, sims = fleet(cluster, ["prefill", "decode", "decode"],
                         sims={"decode1": ("--fail-status", "500", "--fail-count", "1000", *NIXL)})
    sent = 0
    while state(sims["decode1"])["counters"]["failed"] == 0 and sent < 20:
        r = complete(router, fresh(sent))
        sent += 1
        assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "decode2", r.text
    failed = state(sims["decode1"])["counters"]["failed"]
    assert failed >= 1
    assert state(sims["prefill0"])["counters"]["received"] == sent + failed
    assert state(sims["decode2"])["kv_transfer"]["transfers"] == sent
    assert outcomes(router)["prefill_again"] == failed


def test_a_prefill_replica_killed_mid_prefill_is_replaced_by_another(cluster):
    slow = ("--kv-connector", "NixlConnector", "--ttft-ms", "3000", "--itl-ms", "1")
    router, sims = fleet(cluster, ["prefill", "prefill", "decode"], sims={"prefill0": slow, "prefill1": slow})
    answers: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answers.append(complete(router, timeout=30)))
    sender.start()
    busy = None
    for _ in range(50):
        busy = next((n for n in ("prefill0", "prefill1") if state(sims[n])["counters"]["running"]), None)
        if busy:
            break
        time.sleep(0.1)
    assert busy is not None
    os.kill(sims[busy].pid, signal.SIGKILL)
    sender.join(30)
    other = "prefill1" if busy == "prefill0" else "prefill0"
    assert answers[0].status_code == 200 and answers[0].headers["x-kvroute-prefill-replica"] == other
    assert state(sims["decode2"])["kv_transfer"]["transfers"] == 1


def test_a_decode_stream_broken_midway_goes_on_on_another_decode_replica(cluster):
    router, sims = fleet(cluster, ["prefill", "decode", "decode"],
                         sims={"decode1": ("--die-after-chunks", "3", *NIXL)}, health={"eject_after": 100})
    for i in range(20):
        r = complete(router, fresh(i), stream=True, max_tokens=8)
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text
        assert r.text.count('"text":') == 8
        if state(sims["decode1"])["counters"]["received"]:
            break
    assert state(sims["decode1"])["counters"]["received"] == 1
    # the continuation carries the text so far and no transfer parameters: decode2 computes that prompt
    assert "kv_transfer_params" not in state(sims["decode2"])["counters"]["last_body"]



def test_a_split_request_is_decoded_only_where_the_prefills_kv_can_be_read(cluster):
    router, sims = fleet(cluster, ["prefill:cuda", "decode:gaudi2", "decode:cuda"])
    for i in range(4):
        r = complete(router, fresh(i))
        assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "decode2"
    assert state(sims["decode1"])["counters"]["received"] == 0


def test_a_configured_transfer_pair_lets_another_platform_decode(cluster):
    router, sims = fleet(cluster, ["prefill:cuda", "decode:gaudi2"], disaggregation={"transfers": ["cuda>gaudi2"]})
    r = complete(router)
    assert r.status_code == 200 and r.headers["x-kvroute-prefill-replica"] == "prefill0"
    assert state(sims["decode1"])["kv_transfer"]["transfers"] == 1


def test_a_split_request_is_decoded_where_most_of_its_prompt_is_held_already(cluster):
    router, sims = fleet(cluster, ["prefill", "decode", "decode"])
    first = complete(router)
    held_by = first.headers["x-kvroute-replica"]
    for i in range(3):  # long enough a new part to be split again, on top of what that decode replica holds
        r = complete(router, LONG + f" and then part {i}: " + "a new paragraph follows here " * 300)
        assert r.headers["x-kvroute-prefill-replica"] == "prefill0" and r.headers["x-kvroute-replica"] == held_by
