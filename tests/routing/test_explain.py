"""POST /admin/explain/<endpoint>: where a request would go and why, without sending it."""


from support.processes import FAST
from loadtest.cluster import HTTP
from support.state import sim_state

PROMPT = "The quick brown fox jumps over the lazy dog. " * 40  # about 28 blocks of 64 bytes
BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}


def two_replicas(cluster, **config):
    sims = [cluster.sim(*FAST) for _ in range(2)]
    rt = cluster.router([], config={**config, "replicas": [
        {"name": n, "url": s.url, "block_size": 16} for n, s in zip("ab", sims)]})
    return sims, rt


def explain(rt, body=BODY, path="/v1/completions", **kw):
    return HTTP.post(rt.url + "/admin/explain" + path, json=body, timeout=10, **kw)


def test_the_replica_holding_the_prompt_is_best_and_the_answer_says_by_how_much(cluster):
    _, rt = two_replicas(cluster)
    served = HTTP.post(rt.url + "/v1/completions", json=BODY, timeout=10).headers["x-kvroute-replica"]
    out = explain(rt).json()
    assert out["best"] == [served] and out["filtered"] == []
    holder, other = out["candidates"]  # best first
    assert holder["replica"] == served and holder["cached_tokens"] > 0 and other["cached_tokens"] == 0
    ttft = {c["replica"]: c["scorers"][0] for c in out["candidates"]}
    assert ttft[served]["name"] == "predicted-ttft"
    assert ttft[served]["prefill_s"] < ttft[other["replica"]]["prefill_s"]
    assert ttft[served]["cost_s"] < ttft[other["replica"]]["cost_s"]


def test_explaining_sends_nothing_and_records_nothing(cluster):
    sims, rt = two_replicas(cluster)
    for _ in range(3):
        out = explain(rt).json()
        assert all(c["cached_tokens"] == 0 for c in out["candidates"])  # no record of a routed prompt
    assert [sim_state(s)["received"] for s in sims] == [0, 0]


def test_a_drained_replica_is_listed_with_the_filter_that_left_it_out(cluster):
    _, rt = two_replicas(cluster)
    assert HTTP.post(rt.url + "/admin/replicas/a/drain").status_code == 200
    out = explain(rt).json()
    assert out["filtered"] == [{"replica": "a", "filter": "not-drained"}]
    assert [c["replica"] for c in out["candidates"]] == ["b"] and out["best"] == ["b"]


def test_a_chat_request_is_explained_like_the_chat_endpoint_keys_it(cluster):
    _, rt = two_replicas(cluster)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
    served = HTTP.post(rt.url + "/v1/chat/completions", json=chat, timeout=10).headers["x-kvroute-replica"]
    assert explain(rt, chat, "/v1/chat/completions").json()["best"] == [served]
    assert explain(rt, BODY).json()["candidates"][0]["cached_tokens"] == 0  # the same text as a completion: another key


def test_a_body_the_endpoint_would_refuse_is_refused_with_its_reason(cluster):
    _, rt = two_replicas(cluster)
    r = explain(rt, {"model": "tiny", "max_tokens": 2})
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
    r = explain(rt, path="/v1/unknown")
    assert r.status_code == 404 and "/v1/completions" in r.json()["error"]["message"]


def test_explaining_needs_the_admin_key(cluster):
    _, rt = two_replicas(cluster, auth={"api_keys": ["client-1"], "admin_key": "admin-key"})
    assert explain(rt).status_code == 401
    assert explain(rt, headers={"authorization": "Bearer client-1"}).status_code == 403
    assert explain(rt, headers={"authorization": "Bearer admin-key"}).status_code == 200
