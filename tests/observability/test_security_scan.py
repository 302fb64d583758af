"""After a run with keys, prompts and hostile requests: no key and no prompt text in the router's logs, metrics,
error bodies or Redis; /admin refuses without its key; nothing a client sends picks the host the router reaches."""

from __future__ import annotations

import asyncio
import socket
import uuid

import httpx

from loadtest.cluster import HTTP
from router.store import Redis

CLIENT_KEY = "client-key-" + uuid.uuid4().hex
ADMIN_KEY = "admin-key-" + uuid.uuid4().hex
REPLICA_KEY = "replica-key-" + uuid.uuid4().hex
PROMPT = "prompt-text-" + uuid.uuid4().hex


def redis_contents(port: int) -> bytes:
    """Every key and value in the Redis, whatever its type."""
    async def dump() -> bytes:
        r = Redis(f"redis://127.0.0.1:{port}/0")
        out = bytearray()
        try:
            cursor = b"0"
            while True:
                cursor, keys = await r.execute("SCAN", cursor, "COUNT", 1000)
                for key in keys:
                    kind = await r.execute("TYPE", key)
                    read = {b"string": ("GET",), b"hash": ("HGETALL",), b"list": ("LRANGE", 0, -1),
                            b"set": ("SMEMBERS",), b"zset": ("ZRANGE", 0, -1, "WITHSCORES")}.get(kind)
                    value = await r.execute(read[0], key, *read[1:]) if read else b""
                    out += key + b"=" + repr(value).encode() + b"\n"
                if cursor in (b"0", 0):
                    return bytes(out)
        finally:
            await r.close()
    return asyncio.run(dump())


def test_keys_and_prompts_never_leave_the_request(cluster, redis_proc):
    sim = cluster.sim("--api-key", REPLICA_KEY)
    config = {"auth": {"api_keys": [CLIENT_KEY], "admin_key": ADMIN_KEY},
              "replicas": [{"url": sim.url, "api_key": REPLICA_KEY}],
              "index": {"backend": f"redis://127.0.0.1:{redis_proc.port}/0"}}
    rt = cluster.router([], config=config, wait_ready=False)
    rt.wait_http("/ready", timeout=15)
    auth = {"authorization": f"Bearer {CLIENT_KEY}"}
    bodies: list[bytes] = []
    with httpx.Client(base_url=rt.url, timeout=10) as http:
        for i in range(10):
            r = http.post("/v1/chat/completions", headers=auth, json={
                "model": "tiny", "messages": [{"role": "user", "content": f"{PROMPT} {i} " * 40}], "max_tokens": 2})
            assert r.status_code == 200
        for headers, body in [
            ({}, {"model": "tiny", "prompt": PROMPT}),  # no key
            ({"authorization": f"Bearer {CLIENT_KEY}x"}, {"model": "tiny", "prompt": PROMPT}),  # wrong key
            (auth, {"model": "no-such-model", "prompt": PROMPT}),  # unknown model
            (auth, {"model": "tiny", "prompt": PROMPT, "max_tokens": 10**9}),  # the replica refuses
        ]:
            bodies.append(http.post("/v1/completions", headers=headers, json=body).content)
        bodies.append(http.post("/v1/completions", headers=auth, content=PROMPT.encode() + b"{").content)
        bodies.append(http.get("/admin/replicas", headers=auth).content)  # a client key is not an admin key
        assert http.get("/admin/replicas", headers={"authorization": f"Bearer {ADMIN_KEY}"}).status_code == 200
        metrics = http.get("/metrics").text
    log = rt.log_tail(10_000_000)
    redis = redis_contents(redis_proc.port)
    for secret in (CLIENT_KEY, ADMIN_KEY, REPLICA_KEY):
        for where, text in (("log", log), ("metrics", metrics), ("redis", redis.decode(errors="replace")),
                            ("error bodies", b"".join(bodies).decode(errors="replace"))):
            assert secret not in text, f"{secret[:12]}... in {where}"
    for where, text in (("log", log), ("metrics", metrics), ("redis", redis.decode(errors="replace"))):
        assert PROMPT not in text, f"prompt text in {where}"
    assert redis  # the index was written: the scan saw something


def test_the_admin_api_refuses_without_its_key_even_from_loopback_and_relayed_requests_without_one(cluster):
    sim = cluster.sim()
    keyed = cluster.router([sim], config={"auth": {"admin_key": ADMIN_KEY}})
    assert HTTP.get(keyed.url + "/admin/replicas").status_code == 401
    assert HTTP.post(keyed.url + "/admin/replicas", json={"url": "http://127.0.0.1:1"}).status_code == 401
    open_ = cluster.router([sim])  # no admin key: loopback only, and a relayed request is not loopback
    assert HTTP.get(open_.url + "/admin/replicas").status_code == 200
    assert HTTP.get(open_.url + "/admin/replicas", headers={"x-forwarded-for": "127.0.0.1"}).status_code == 403


def test_nothing_a_client_sends_changes_the_host_the_router_reaches(cluster):
    sim = cluster.sim()
    rt = cluster.router([sim])
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(8)
    trap.settimeout(0.5)
    elsewhere = f"127.0.0.1:{trap.getsockname()[1]}"
    try:
        for headers in ({"host": elsewhere}, {"x-forwarded-host": elsewhere}, {"forwarded": f"host={elsewhere}"},
                        {"x-original-url": f"http://{elsewhere}/v1/completions"}):
            r = HTTP.post(rt.url + "/v1/completions", headers=headers, timeout=10,
                           json={"model": "tiny", "prompt": "x", "max_tokens": 1})
            assert r.status_code == 200 and r.headers["x-kvroute-replica"] == f"127.0.0.1:{sim.port}"
        raw = socket.create_connection(("127.0.0.1", rt.port), timeout=5)
        body = b'{"model": "tiny", "prompt": "x", "max_tokens": 1}'
        raw.sendall(b"POST http://%s/v1/completions HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (elsewhere.encode(), elsewhere.encode(), len(body), body))
        raw.settimeout(5)
        answer = raw.recv(65536)
        raw.close()
        assert answer.startswith(b"HTTP/1.1 ") and b"x-kvroute-replica: 127.0.0.1:%d" % sim.port in answer.lower() \
            or not answer.startswith(b"HTTP/1.1 200")
        try:
            conn, _ = trap.accept()
            conn.close()
            raise AssertionError("the router connected to the host a client named")
        except socket.timeout:
            pass
    finally:
        trap.close()
