"""The store's client on a real Redis Cluster (3 masters, 3 replicas): commands reach the master of their
key's slot, and slots that move or masters that die are followed."""

import asyncio
import time

import pytest

from loadtest.cluster import RedisCluster, redis_server
from router.store import Redis, RedisError
from router.store.client import parse_url, slot


@pytest.fixture(scope="module")
def own_cluster(tmp_path_factory):
    """A cluster of this module's own: its tests move slots and kill masters."""
    c = RedisCluster(tmp_path_factory.mktemp("cluster")).start()
    yield c
    c.stop()


def run(coro):
    return asyncio.run(coro)


async def using(url, body):
    r = Redis(url, connect_timeout=1.0)
    try:
        return await body(r)
    finally:
        await r.close()


def master_of(cluster, key):
    s = slot(key)
    return next(port for port, ranges in cluster.masters().items() if any(a <= s <= b for a, b in ranges))


def node_id(cluster, port):
    return cluster.cli(port, "CLUSTER", "MYID").strip()


# -- keys and slots ----------------------------------------------------------------------------


def test_a_key_slot_is_crc16_of_its_hash_tag():
    assert slot("123456789") == 0x31C3 % 16384  # the CRC16 check value Redis's cluster spec gives
    assert slot("kvroute:{model}:r:a") == slot("kvroute:{model}:clock") == slot("model")
    assert slot("a{}b") == slot("a{}b")  # an empty tag: the whole key
    assert slot("a{}b") != slot("")


def test_a_url_names_several_seeds_with_one_set_of_credentials():
    seeds = parse_url("rediss://user:pw@h1:7000,h2:7001,[::1]:7002")
    assert [(a.host, a.port) for a in seeds] == [("h1", 7000), ("h2", 7001), ("::1", 7002)]
    assert all(a.tls and a.username == "user" and a.password == "pw" for a in seeds)


# -- a standalone server -----------------------------------------------------------------------


def test_a_server_without_cluster_support_gets_every_command(redis_proc):
    async def body(r):
        await r.execute("SET", "k", "v")
        return r.mode, await r.execute("GET", "k")
    assert run(using(f"redis://127.0.0.1:{redis_proc.port}/0", body)) == ("standalone", b"v")


# -- a cluster ---------------------------------------------------------------------------------


def test_commands_reach_the_master_of_their_slot_on_every_master(own_cluster):
    async def body(r):
        await asyncio.gather(*(r.execute("SET", f"key-{i}", i) for i in range(300)))
        got = await asyncio.gather(*(r.execute("GET", f"key-{i}") for i in range(300)))
        return r.mode, len(r.masters), got
    mode, masters, got = run(using(own_cluster.url, body))
    assert (mode, masters) == ("cluster", 3)
    assert got == [str(i).encode() for i in range(300)]
    sizes = [int(own_cluster.cli(port, "DBSIZE")) for port in own_cluster.masters()]
    assert sum(sizes) == 300 and min(sizes) > 50  # spread, not all on one


def test_one_reachable_seed_is_enough(own_cluster):
    dead = redis_server()  # never started: nothing listens there
    url = own_cluster.url.replace("redis://", f"redis://127.0.0.1:{dead.port},", 1)
    async def body(r):
        await r.execute("SET", "seeded", "yes")
        return await r.execute("GET", "seeded")
    assert run(using(url, body)) == b"yes"


def test_a_database_other_than_0_is_refused_on_a_cluster(own_cluster):
    first = own_cluster.url.split(",")[0]
    with pytest.raises(RedisError, match="database 0 only"):
        run(using(first + "/2", lambda r: r.execute("GET", "x")))


def test_a_script_a_master_never_saw_is_loaded_there(own_cluster):
    async def body(r):
        sha = r.script("return redis.call('INCR', KEYS[1])")
        keys = [f"counter-{i}" for i in range(30)]  # on every master
        await asyncio.gather(*(r.evalsha(sha, [k], []) for k in keys))
        for port in own_cluster.masters():
            own_cluster.cli(port, "SCRIPT", "FLUSH")
        return await asyncio.gather(*(r.evalsha(sha, [k], []) for k in keys))
    assert run(using(own_cluster.url, body)) == [2] * 30


def test_a_key_being_migrated_is_asked_for_where_it_went_and_a_moved_slot_is_followed(own_cluster):
    c = own_cluster

    async def body(r):
        await r.execute("SET", "{mig}moved", "there")
        await r.execute("SET", "{mig}stayed", "here")
        src = master_of(c, "{mig}")
        dst = next(p for p in c.masters() if p != src)
        s = slot("{mig}")
        c.cli(dst, "CLUSTER", "SETSLOT", str(s), "IMPORTING", node_id(c, src))
        c.cli(src, "CLUSTER", "SETSLOT", str(s), "MIGRATING", node_id(c, dst))
        c.cli(src, "MIGRATE", "127.0.0.1", str(dst), "", "0", "5000", "KEYS", "{mig}moved")
        during = (await r.execute("GET", "{mig}moved"), await r.execute("GET", "{mig}stayed"))  # ASK, and not
        c.cli(src, "MIGRATE", "127.0.0.1", str(dst), "", "0", "5000", "KEYS", "{mig}stayed")
        for port in c.masters():
            c.cli(port, "CLUSTER", "SETSLOT", str(s), "NODE", node_id(c, dst))
        after = (await r.execute("GET", "{mig}moved"), await r.execute("GET", "{mig}stayed"))  # MOVED
        await r.execute("SET", "{mig}new", "1")
        return during, after, int(c.cli(dst, "EXISTS", "{mig}new"))
    during, after, on_dst = run(using(c.url, body))
    assert during == (b"there", b"here")
    assert after == (b"there", b"here")
    assert on_dst == 1


def test_a_killed_master_fails_calls_at_once_and_its_promoted_replica_serves_them(tmp_path):
    c = RedisCluster(tmp_path).start()
    try:
        async def body(r):
            sha = r.script("return redis.call('GET', KEYS[1])")
            await r.execute("SET", "{dies}k", "kept")
            victim = master_of(c, "{dies}")
            await asyncio.sleep(0.5)  # replicated before its master dies
            c.proc(victim).kill()
            killed = time.monotonic()
            failed, slowest = 0, 0.0
            while time.monotonic() - killed < 20:
                t = time.monotonic()
                try:
                    async with asyncio.timeout(0.5):
                        value = await r.evalsha(sha, ["{dies}k"], [])
                    return failed, slowest, time.monotonic() - killed, value
                except (RedisError, TimeoutError):
                    failed += 1
                    slowest = max(slowest, time.monotonic() - t)
                    await asyncio.sleep(0.05)
            raise AssertionError("the promoted replica was never used")
        failed, slowest, took, value = run(using(c.url, body))
        assert value == b"kept"
        assert failed > 0 and slowest < 0.5  # each failed fast, none hung
        assert took < 10, took  # node timeout 1 s, then the promotion, then the client's refresh
    finally:
        c.stop()
