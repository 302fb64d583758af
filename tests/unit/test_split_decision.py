"""When a request is split into a prefill and a decode, and the bodies of its halves (vLLM's KV-transfer
protocol), on a pool of replicas marked ready (no process: pure decisions)."""

import json

import pytest
from pydantic import ValidationError

from router.config import RouterConfig
from router.disaggregation import LOCAL, SPLIT, WHOLE, Splitter, decode_body, prefill_body, request_object, transfer_params
from router.gateway import Gateway
from router.policy import Role, TransferPair
from router.request import RouteRequest
from router.view import ReplicaView

PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
          "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "10.0.0.1", "remote_port": 5600,
          "tp_size": 8}


def splitter(roles: list[str], **settings) -> tuple[Splitter, Gateway]:
    """Replicas of the given roles (``role`` or ``role:platform``), named by role and number."""
    replicas = []
    for i, spec in enumerate(roles):
        role, _, platform = spec.partition(":")
        replicas.append({"name": f"{role}{i}", "url": f"http://127.0.0.1:{9 + i}", "models": ["m"], "role": role,
                         "platform": platform or "cuda"})
    config = RouterConfig.model_validate({"replicas": replicas, "disaggregation": settings})
    gw = Gateway(config)
    for r in gw.pool:
        gw.pool.health.mark_success(r)
    return Splitter(gw.pool, config.disaggregation, gw.events), gw


def request(prompt_tokens: int = 0, cached: dict[str, int] | None = None, endpoint: str = "/v1/completions",
            model: str = "m") -> RouteRequest:
    r = RouteRequest(model=model, request_id="r", endpoint=endpoint)
    r.prompt_tokens, r.cached = prompt_tokens, dict(cached or {})
    return r


def test_a_fleet_of_role_both_only_never_splits():
    s, _ = splitter(["both", "both"])
    assert s.decide(request(100_000)) == WHOLE


def test_requests_on_a_fleet_without_one_phase_replicas_are_not_keyed_ahead_of_their_decision():
    s, _ = splitter(["both", "both"])
    assert not s.possible(request())
    s, _ = splitter(["both", "prefill", "decode"])
    assert s.possible(request()) and not s.possible(request(endpoint="/v1/embeddings"))


def test_without_a_replica_of_role_both_a_long_prompt_and_an_unkeyed_one_are_split():
    s, _ = splitter(["prefill", "decode"], min_uncached_tokens=1000)
    assert s.decide(request(0)) == SPLIT and s.decide(request(1000)) == SPLIT


def test_without_a_replica_of_role_both_a_short_prompt_goes_whole_to_a_decode_replica():
    s, _ = splitter(["prefill", "decode"], min_uncached_tokens=1000, max_local_tokens=128)
    assert s.decide(request(127)) == LOCAL
    # longer, its prefill there would stall the streams the decode replica serves
    assert s.decide(request(128)) == SPLIT and s.decide(request(999)) == SPLIT


def test_a_prompt_nearly_all_on_a_decode_replica_is_decoded_there_without_a_prefill():
    # the next turn of a conversation: the decode replica holds its earlier turns
    s, _ = splitter(["both", "prefill", "decode"], min_uncached_tokens=1000, max_local_tokens=128)
    assert s.decide(request(9000, {"decode2": 8900})) == LOCAL
    assert s.decide(request(9000, {"decode2": 8500})) == SPLIT
    # a replica of role both holding enough is preferred: it is made for whole requests
    assert s.decide(request(9000, {"decode2": 8900, "both0": 8500})) == WHOLE
    s, _ = splitter(["prefill", "decode"], max_local_tokens=0)
    assert s.decide(request(9000, {"decode1": 8999})) == SPLIT  # 0: a decode replica never prefills


def test_a_long_uncached_prompt_is_split_and_a_short_one_is_not():
    s, _ = splitter(["both", "prefill", "decode"], min_uncached_tokens=1000)
    assert s.decide(request(1000)) == SPLIT and s.decide(request(999)) == WHOLE


def test_a_prompt_mostly_cached_on_a_replica_of_role_both_goes_whole():
    s, _ = splitter(["both", "prefill", "decode"], min_uncached_tokens=1000)
    assert s.decide(request(5000, {"both0": 4500})) == WHOLE
    # the prefill replica's cache does not count against splitting: the split would use it
    assert s.decide(request(5000, {"prefill1": 4500})) == SPLIT


def test_other_endpoints_pinned_requests_and_unknown_models_go_whole():
    s, _ = splitter(["prefill", "decode"])
    assert s.decide(request(5000, endpoint="/v1/embeddings")) == WHOLE
    assert s.decide(request(5000, model="other")) == WHOLE
    pinned = request(5000)
    pinned.pinned = "decode1"
    assert s.decide(pinned) == WHOLE


def test_switched_off_nothing_is_split():
    s, _ = splitter(["prefill", "decode"], enabled=False)
    assert s.decide(request(5000)) == WHOLE


def test_the_roles_are_read_again_when_a_replica_becomes_unready():
    s, gw = splitter(["both", "prefill", "decode"])
    assert s.decide(request(10)) == WHOLE
    both = gw.pool.get("both0")
    assert both is not None
    gw.pool.health.mark_failure(both, "down", immediate=True)
    assert not both.ready and s.decide(request(0)) == SPLIT


def test_the_role_filter_keeps_both_for_every_phase_and_one_phase_replicas_for_theirs():
    keep = Role().keep
    r = request()
    views = {role: ReplicaView(name=role, role=role) for role in ("both", "prefill", "decode")}
    for phase, kept in (("whole", {"both"}), ("prefill", {"both", "prefill"}), ("decode", {"both", "decode"}),
                        ("local", {"both", "decode"})):
        r.phase = phase
        assert {n for n, v in views.items() if keep(r, v)} == kept


def test_the_prefill_half_asks_one_token_for_a_remote_decode_and_keeps_the_rest():
    body = json.dumps({"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True},
                       "max_tokens": 50, "max_completion_tokens": 50, "min_tokens": 5, "temperature": 0.3}).encode()
    request = request_object(body)
    sent = json.loads(prefill_body(request))
    assert sent["kv_transfer_params"]["do_remote_decode"] is True
    assert sent["kv_transfer_params"]["do_remote_prefill"] is False
    assert (sent["max_tokens"], sent["max_completion_tokens"], sent["stream"]) == (1, 1, False)
    assert "stream_options" not in sent and "min_tokens" not in sent
    assert sent["temperature"] == 0.3 and sent["messages"] == []
    assert json.loads(body) == request  # the client's request itself is left as it came
    assert request_object(b"[1, 2]") is None and request_object(b"{not json") is None


def test_the_decode_half_is_the_clients_request_with_the_prefills_parameters():
    body = json.dumps({"model": "m", "prompt": "x", "max_tokens": 50, "stream": True}).encode()
    request = request_object(body)
    sent = json.loads(decode_body(request, PARAMS))
    assert sent == {"model": "m", "prompt": "x", "max_tokens": 50, "stream": True, "kv_transfer_params": PARAMS}
    assert "kv_transfer_params" not in request


def test_transfer_parameters_are_taken_only_when_they_name_kv_to_read():
    answer = {"choices": [], "kv_transfer_params": PARAMS}
    assert transfer_params(json.dumps(answer).encode()) == PARAMS
    for broken in ({**PARAMS, "remote_request_id": None}, {**PARAMS, "do_remote_prefill": False},
                   {k: v for k, v in PARAMS.items() if k != "remote_host"}, {**PARAMS, "remote_block_ids": []},
                   "not a dict", None):
        assert transfer_params(json.dumps({"kv_transfer_params": broken}).encode()) is None
    assert transfer_params(b"not json") is None and transfer_params(b"[]") is None
    huge = {**PARAMS, "remote_block_ids": [list(range(20_000))]}
    assert transfer_params(json.dumps({"kv_transfer_params": huge}).encode()) is None


def test_a_fleet_whose_prefill_kv_no_decode_replica_can_read_is_not_split():
    s, _ = splitter(["prefill:cuda", "decode:gaudi2"], min_uncached_tokens=1000)
    assert s.decide(request(5000)) == LOCAL  # the decode replica computes the prompt itself
    s, _ = splitter(["prefill:cuda", "decode:gaudi2"], min_uncached_tokens=1000, transfers=["cuda>gaudi2"])
    assert s.decide(request(5000)) == SPLIT


def test_a_transfer_pair_goes_one_way_and_each_platform_reads_its_own():
    s, _ = splitter(["prefill:cuda", "prefill:gaudi2", "decode:gaudi2"], transfers=["cuda>gaudi2"])
    assert s.readers("cuda") == {"cuda", "gaudi2"} and s.readers("gaudi2") == {"gaudi2"}
    assert s.prefill_platforms(request(5000)) == {"cuda", "gaudi2"}
    s, _ = splitter(["prefill:gaudi2", "prefill:cuda", "decode:cuda"], transfers=["cuda>gaudi2"])
    assert s.prefill_platforms(request(5000)) == {"cuda"}  # no decode replica reads Gaudi's KV


@pytest.mark.parametrize("bad", ["cuda", "cuda>", "cuda>tpu"])
def test_transfer_pairs_are_two_known_platforms(bad):
    with pytest.raises(ValidationError) as e:
        RouterConfig.model_validate({"disaggregation": {"transfers": [bad]}})
    assert "disaggregation.transfers" in str(e.value)


def test_the_transfer_pair_filter_keeps_the_platforms_a_split_request_allows():
    keep = TransferPair().keep
    r = request()
    views = [ReplicaView(name=p, platform=p) for p in ("cuda", "gaudi2", "aurora-pvc")]
    assert all(keep(r, v) for v in views)
    r.platforms = frozenset({"gaudi2", "aurora-pvc"})
    assert [v.name for v in views if keep(r, v)] == ["gaudi2", "aurora-pvc"]
