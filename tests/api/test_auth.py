"""Client keys and the admin key."""

import pytest

from loadtest.cluster import HTTP

BODY = {"model": "tiny", "prompt": "x", "max_tokens": 1}


@pytest.fixture
def secured(cluster):
    sim = cluster.sim("--ttft-ms", "1", "--itl-ms", "1", "--api-key", "upstream-secret")
    rt = cluster.router([], config={
        "replicas": [{"url": sim.url, "api_key": "upstream-secret"}],
        "auth": {"api_keys": ["client-1", "client-2"], "admin_key": "admin-key"},
    })
    return sim, rt


def bearer(key):
    return {"authorization": f"Bearer {key}"}


def test_missing_client_key_is_401(secured):
    _, rt = secured
    r = HTTP.post(rt.url + "/v1/completions", json=BODY)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert r.headers["www-authenticate"] == "Bearer"


def test_wrong_client_key_is_401(secured):
    _, rt = secured
    assert HTTP.post(rt.url + "/v1/completions", json=BODY, headers=bearer("nope")).status_code == 401
    assert HTTP.get(rt.url + "/v1/models", headers=bearer("nope")).status_code == 401


def test_any_configured_client_key_is_accepted(secured):
    _, rt = secured
    for key in ("client-1", "client-2"):
        assert HTTP.post(rt.url + "/v1/completions", json=BODY, headers=bearer(key)).status_code == 200


def test_upstream_gets_the_configured_key_not_the_clients(secured):
    sim, rt = secured
    HTTP.post(rt.url + "/v1/completions", json=BODY, headers=bearer("client-1")).raise_for_status()
    seen = HTTP.get(sim.url + "/sim/state").json()["counters"]["last_headers"]
    assert seen["authorization"] == "Bearer upstream-secret"


def test_admin_needs_the_admin_key(secured):
    _, rt = secured
    assert HTTP.get(rt.url + "/admin/replicas").status_code == 401
    assert HTTP.get(rt.url + "/admin/replicas", headers=bearer("wrong")).status_code == 401
    r = HTTP.get(rt.url + "/admin/replicas", headers=bearer("client-1"))
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert HTTP.get(rt.url + "/admin/replicas", headers=bearer("admin-key")).status_code == 200


def test_health_ready_and_metrics_need_no_key(secured):
    _, rt = secured
    for path in ("/health", "/ready", "/metrics"):
        assert HTTP.get(rt.url + path).status_code == 200


def test_keys_never_reach_the_logs(secured):
    _, rt = secured
    HTTP.post(rt.url + "/v1/completions", json=BODY, headers=bearer("client-1"))
    HTTP.post(rt.url + "/v1/completions", json=BODY, headers=bearer("wrong-key-xyz"))
    HTTP.get(rt.url + "/admin/replicas", headers=bearer("admin-key"))
    rt.stop()
    log = rt.log_tail(10**6)
    assert "/v1/completions" in log
    for secret in ("client-1", "wrong-key-xyz", "admin-key", "upstream-secret"):
        assert secret not in log


def test_admin_without_a_key_refuses_requests_relayed_by_a_local_proxy(cluster):
    """A reverse proxy on the same host connects from loopback; the client behind it is not local."""
    sim = cluster.sim("--ttft-ms", "1", "--itl-ms", "1")
    rt = cluster.router([sim])
    assert HTTP.get(rt.url + "/admin/replicas").status_code == 200
    for header in ({"x-forwarded-for": "203.0.113.7"}, {"forwarded": "for=203.0.113.7"}):
        assert HTTP.get(rt.url + "/admin/replicas", headers=header).status_code == 403
