"""Tenants: a key (and the tenant header) names who a request is for; each tenant's limits answer 429 with
Retry-After, hold across routers on one Redis, and change at run time through the admin API."""

import subprocess
import threading
import time

import pytest

from loadtest.cluster import HTTP
from support.waiting import wait_until

BODY = {"model": "tiny", "prompt": "hello tenants", "max_tokens": 2}
FAST = ("--ttft-ms", "1", "--itl-ms", "1")


def bearer(key, tenant=None):
    headers = {"authorization": f"Bearer {key}"}
    if tenant is not None:
        headers["x-kvroute-tenant"] = tenant
    return headers


def tenant_counts(rt, outcome="admitted"):
    """kvroute_tenant_requests_total per tenant for one outcome, from the router's /metrics."""
    out = {}
    for line in HTTP.get(rt.url + "/metrics").text.splitlines():
        if line.startswith("kvroute_tenant_requests_total{") and f'outcome="{outcome}"' in line:
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:line.index("}")].split(","))
            out[labels["tenant"].strip('"')] = out.get(labels["tenant"].strip('"'), 0) + float(line.split()[-1])
    return out


TENANTS = [
    {"name": "chat", "keys": ["key-chat", "key-shared"], "class": "interactive", "weight": 3},
    {"name": "evals", "keys": ["key-shared"], "class": "batch"},
    {"name": "open", "class": "standard"},
]


@pytest.fixture
def tenanted(cluster):
    sim = cluster.sim(*FAST)
    return cluster.router([sim], config={"tenants": TENANTS})


def test_a_key_names_its_tenant(tenanted):
    assert HTTP.post(tenanted.url + "/v1/completions", json=BODY, headers=bearer("key-chat")).status_code == 200
    assert tenant_counts(tenanted) == {"chat": 1}


def test_a_key_of_several_tenants_is_for_the_first_listed_unless_the_header_names_another(tenanted):
    HTTP.post(tenanted.url + "/v1/completions", json=BODY, headers=bearer("key-shared")).raise_for_status()
    HTTP.post(tenanted.url + "/v1/completions", json=BODY, headers=bearer("key-shared", "evals")).raise_for_status()
    assert tenant_counts(tenanted) == {"chat": 1, "evals": 1}


def test_a_request_without_a_tenant_key_is_the_default_tenants(tenanted):
    HTTP.post(tenanted.url + "/v1/completions", json=BODY).raise_for_status()
    HTTP.post(tenanted.url + "/v1/completions", json=BODY, headers=bearer("not-a-tenant-key")).raise_for_status()
    assert tenant_counts(tenanted) == {"default": 2}


def test_any_client_may_name_a_tenant_without_keys(tenanted):
    HTTP.post(tenanted.url + "/v1/completions", json=BODY, headers={"x-kvroute-tenant": "open"}).raise_for_status()
    assert tenant_counts(tenanted) == {"open": 1}


@pytest.mark.parametrize("key,named", [("key-chat", "evals"), (None, "chat"), ("key-chat", "nobody"),
                                       ("key-chat", "x" * 5000)])
def test_naming_a_tenant_the_key_may_not_use_is_403_without_echoing_it(tenanted, key, named):
    headers = bearer(key, named) if key else {"x-kvroute-tenant": named}
    r = HTTP.post(tenanted.url + "/v1/completions", json=BODY, headers=headers)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert named not in r.text
    assert tenant_counts(tenanted) == {}


def test_tenant_keys_are_client_keys_where_auth_needs_a_key(cluster):
    sim = cluster.sim(*FAST)
    rt = cluster.router([sim], config={"auth": {"api_keys": ["plain-client"]}, "tenants": TENANTS})
    assert HTTP.post(rt.url + "/v1/completions", json=BODY, headers=bearer("key-chat")).status_code == 200
    assert HTTP.post(rt.url + "/v1/completions", json=BODY, headers=bearer("plain-client")).status_code == 200
    assert HTTP.post(rt.url + "/v1/completions", json=BODY, headers=bearer("wrong")).status_code == 401
    assert HTTP.post(rt.url + "/v1/completions", json=BODY).status_code == 401


def test_requests_per_minute_refuses_past_the_bucket_with_retry_after(cluster):
    sim = cluster.sim(*FAST)
    rt = cluster.router([sim], config={"tenants": [{"name": "t", "keys": ["k"], "requests_per_minute": 60,
                                                    "burst_s": 3}]})
    codes = [HTTP.post(rt.url + "/v1/completions", json=BODY, headers=bearer("k")).status_code for _ in range(5)]
    assert codes[:3] == [200, 200, 200] and codes[3] == 429
    r = HTTP.post(rt.url + "/v1/completions", json=BODY, headers=bearer("k"))
    assert r.status_code == 429 and r.json()["error"]["code"] == "tenant_requests_per_minute"
    assert 1 <= int(r.headers["retry-after"]) <= 2
    time.sleep(1.1)  # a second refills one request
    assert HTTP.post(rt.url + "/v1/completions", json=BODY, headers=bearer("k")).status_code == 200
    assert tenant_counts(rt, "requests_per_minute") == {"t": 3}


def test_tokens_per_minute_counts_prompt_and_completion(cluster):
    sim = cluster.sim(*FAST)
    # 600 tokens a minute, a 5 s bucket: 50 tokens; one request of ~40 prompt tokens and 20 completion tokens
    # empties it, and the next waits for the refill of what it overdrew
    rt = cluster.router([sim], config={"tenants": [{"name": "t", "keys": ["k"], "tokens_per_minute": 600,
                                                    "burst_s": 5}]})
    body = {"model": "tiny", "prompt": "word " * 40, "max_tokens": 20, "ignore_eos": True}
    assert HTTP.post(rt.url + "/v1/completions", json=body, headers=bearer("k")).status_code == 200
    time.sleep(0.3)  # the completion tokens are taken just after the answer
    r = HTTP.post(rt.url + "/v1/completions", json=body, headers=bearer("k"))
    assert r.status_code == 429 and r.json()["error"]["code"] == "tenant_tokens_per_minute"
    assert int(r.headers["retry-after"]) >= 1
    tokens = {}
    for line in HTTP.get(rt.url + "/metrics").text.splitlines():
        if line.startswith("kvroute_tenant_tokens_total{"):
            tokens[line.split('kind="')[1].split('"')[0]] = float(line.split()[-1])
    assert tokens["completion"] == 20 and tokens["prompt"] >= 40


def test_max_concurrent_refuses_a_request_past_the_tenants_in_flight(cluster):
    sim = cluster.sim("--ttft-ms", "1500", "--itl-ms", "1")
    rt = cluster.router([sim], config={"tenants": [{"name": "t", "keys": ["k"], "max_concurrent": 1}]})
    held = threading.Thread(target=lambda: HTTP.post(rt.url + "/v1/completions", json=BODY, headers=bearer("k"),
                                                     timeout=10), daemon=True)
    held.start()
    wait_until(lambda: tenant_counts(rt).get("t") == 1, timeout=3)
    r = HTTP.post(rt.url + "/v1/completions", json=BODY, headers=bearer("k"))
    assert r.status_code == 429 and r.json()["error"]["code"] == "tenant_max_concurrent"
    assert HTTP.post(rt.url + "/v1/completions", json=BODY).status_code == 200  # other tenants are not held up
    held.join()
    assert HTTP.post(rt.url + "/v1/completions", json=BODY, headers=bearer("k")).status_code == 200


def test_a_request_rate_holds_across_two_routers_on_one_redis(cluster, shared_url):
    sim = cluster.sim(*FAST)
    config = {"tenants": [{"name": "t", "keys": ["k"], "requests_per_minute": 60, "burst_s": 4}]}
    routers = [cluster.router([sim], "--index", shared_url, config=config) for _ in range(2)]
    codes = [HTTP.post(routers[i % 2].url + "/v1/completions", json=BODY, headers=bearer("k")).status_code
             for i in range(10)]
    assert codes.count(200) == 4  # the one bucket: 4 s of 1 a second, however the requests are spread


def test_max_concurrent_holds_across_two_routers(cluster, shared_url):
    sim = cluster.sim("--ttft-ms", "2000", "--itl-ms", "1")
    config = {"tenants": [{"name": "t", "keys": ["k"], "max_concurrent": 2}]}
    a, b = (cluster.router([sim], "--index", shared_url, config=config) for _ in range(2))
    threads = [threading.Thread(target=lambda: HTTP.post(a.url + "/v1/completions", json=BODY, headers=bearer("k"),
                                                         timeout=10), daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    wait_until(lambda: tenant_counts(a).get("t") == 2, timeout=3)
    time.sleep(0.3)  # A's figures published (at once) and read by B (within its shared_load.interval_s)
    r = HTTP.post(b.url + "/v1/completions", json=BODY, headers=bearer("k"))
    assert r.status_code == 429 and r.json()["error"]["code"] == "tenant_max_concurrent"
    for t in threads:
        t.join()


def test_a_tenant_set_through_one_routers_admin_api_holds_on_every_router(cluster, shared_url):
    sim = cluster.sim(*FAST)
    a, b = (cluster.router([sim], "--index", shared_url, "--set", "membership.sync_interval_s=0.2")
            for _ in range(2))
    r = HTTP.put(a.url + "/admin/tenants/team", json={"keys": ["key-team"], "class": "batch", "max_concurrent": 3})
    assert r.status_code == 200 and r.json()["keys"] == 1 and r.json()["class"] == "batch"
    wait_until(lambda: any(t["name"] == "team" for t in HTTP.get(b.url + "/admin/tenants").json()["tenants"]),
               timeout=3)
    HTTP.post(b.url + "/v1/completions", json=BODY, headers=bearer("key-team")).raise_for_status()
    assert tenant_counts(b) == {"team": 1}
    assert HTTP.delete(b.url + "/admin/tenants/team").status_code == 200
    wait_until(lambda: all(t["name"] != "team" for t in HTTP.get(a.url + "/admin/tenants").json()["tenants"]),
               timeout=3)


def test_the_admin_api_never_shows_a_tenants_keys(cluster, redis_proc):
    sim = cluster.sim(*FAST)
    rt = cluster.router([sim], "--index", f"redis://127.0.0.1:{redis_proc.port}", config={"tenants": TENANTS})
    HTTP.put(rt.url + "/admin/tenants/team", json={"keys": ["secret-team-key"]}).raise_for_status()
    listed = HTTP.get(rt.url + "/admin/tenants").text
    assert "key-chat" not in listed and "secret-team-key" not in listed
    stored = subprocess.run(["redis-cli", "-p", str(redis_proc.port), "HGETALL", "kvroute:tenants"],
                            capture_output=True, text=True, timeout=10).stdout
    assert "team" in stored and "key_digests" in stored and "secret-team-key" not in stored


def test_an_invalid_tenant_is_refused_naming_the_field(tenanted):
    r = HTTP.put(tenanted.url + "/admin/tenants/x", json={"class": "urgent"})
    assert r.status_code == 400 and "class" in r.json()["error"]["message"]
    r = HTTP.put(tenanted.url + "/admin/tenants/bad%20name", json={})
    assert r.status_code == 400 and "name" in r.json()["error"]["message"]
    assert HTTP.delete(tenanted.url + "/admin/tenants/nobody").status_code == 404


def test_with_redis_down_each_router_keeps_the_limits_on_its_own(cluster, redis_proc):
    sim = cluster.sim(*FAST)
    rt = cluster.router([sim], "--index", f"redis://127.0.0.1:{redis_proc.port}",
                        config={"tenants": [{"name": "t", "keys": ["k"], "requests_per_minute": 60, "burst_s": 2}]})
    redis_proc.stop()
    codes = [HTTP.post(rt.url + "/v1/completions", json=BODY, headers=bearer("k")).status_code for _ in range(4)]
    assert codes == [200, 200, 429, 429]
    assert HTTP.post(rt.url + "/v1/completions", json=BODY).status_code == 200  # unlimited tenants go on
    assert "budgets: Redis did not answer" in rt.log_tail(10**5)
