"""The hot path's Redis client (router/store) against real redis-server processes."""

import asyncio
import signal

import pytest

from loadtest.cluster import Proc, free_port, wait_redis
from router.store.resp import ConnectionLost, ReplyError, _Incomplete, encode, parse
from router.store import Redis


@pytest.fixture
def server(redis_proc):
    return redis_proc


def run(coro):
    return asyncio.run(coro)


# -- the protocol ------------------------------------------------------------------------------

REPLIES = [
    (b"+OK\r\n", b"OK"),
    (b":-42\r\n", -42),
    (b"$5\r\nhe\r\no\r\n", b"he\r\no"),
    (b"$-1\r\n", None),
    (b"*-1\r\n", None),
    (b"*3\r\n:1\r\n*2\r\n$1\r\na\r\n$0\r\n\r\n+x\r\n", [1, [b"a", b""], b"x"]),
]


@pytest.mark.parametrize("raw, value", REPLIES)
def test_replies_parse_whole_and_not_before_their_last_byte(raw, value):
    assert parse(raw, 0) == (value, len(raw))
    for cut in range(1, len(raw)):
        with pytest.raises(_Incomplete):
            parse(raw[:cut], 0)


def test_an_error_reply_is_a_value_not_a_crash():
    err, end = parse(b"-NOSCRIPT No matching script\r\n", 0)
    assert isinstance(err, ReplyError) and str(err).startswith("NOSCRIPT") and end == 30


def test_commands_are_encoded_as_bulk_strings():
    assert encode(("SET", b"k\r\n", 7)) == b"*3\r\n$3\r\nSET\r\n$3\r\nk\r\n\r\n$1\r\n7\r\n"


# -- against redis-server ----------------------------------------------------------------------


def test_concurrent_calls_on_one_connection_each_get_their_own_reply(server):
    async def go():
        r = Redis(f"redis://127.0.0.1:{server.port}/0")
        try:
            await asyncio.gather(*(r.execute("SET", f"k{i}", i) for i in range(300)))
            return await asyncio.gather(*(r.execute("GET", f"k{i}") for i in range(300)))
        finally:
            await r.close()
    assert run(go()) == [str(i).encode() for i in range(300)]


def test_a_script_the_server_forgot_is_loaded_again(server):
    async def go():
        r = Redis(f"redis://127.0.0.1:{server.port}/0")
        try:
            sha = r.script("return tonumber(ARGV[1]) + 1")
            first = await r.evalsha(sha, [], [41])
            await r.execute("SCRIPT", "FLUSH")
            return first, await r.evalsha(sha, [], [1])
        finally:
            await r.close()
    assert run(go()) == (42, 2)


def test_password_and_database_from_the_url(tmp_path):
    port = free_port()
    p = Proc("redis-auth", ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                            "--appendonly", "no", "--requirepass", "s3cret"], port, log_path=tmp_path / "r.log").start()
    try:
        async def go():
            db3 = Redis(f"redis://:s3cret@127.0.0.1:{port}/3")
            db0 = Redis(f"redis://:s3cret@127.0.0.1:{port}/0")
            wrong = Redis(f"redis://:nope@127.0.0.1:{port}/0")
            try:
                await db3.execute("SET", "where", "three")
                seen = (await db3.execute("GET", "where"), await db0.execute("GET", "where"))
                with pytest.raises(ReplyError):
                    await wrong.execute("PING")
                return seen
            finally:
                for c in (db3, db0, wrong):
                    await c.close()
        for _ in range(50):  # the server may still be starting
            try:
                assert run(go()) == (b"three", None)
                return
            except (ConnectionLost, OSError):
                asyncio.run(asyncio.sleep(0.1))
        raise AssertionError("redis-server with a password did not come up")
    finally:
        p.stop()


def test_calls_work_again_after_the_server_restarts(server):
    async def go():
        r = Redis(f"redis://127.0.0.1:{server.port}/0")
        try:
            await r.execute("PING")
            server.restart()
            wait_redis(server)
            for _ in range(3):
                try:
                    return await r.execute("PING")
                except ConnectionLost:  # the old connection's loss is noticed by the first call
                    pass
        finally:
            await r.close()
    assert run(go()) == b"PONG"


def test_a_server_that_stops_answering_bounds_the_waiting_calls(server):
    async def go():
        r = Redis(f"redis://127.0.0.1:{server.port}/0", max_pending=16, stall_s=0.3)
        try:
            await r.execute("PING")
            server.signal(signal.SIGSTOP)
            timed_out = 0
            for _ in range(40):
                try:
                    async with asyncio.timeout(0.02):
                        await r.execute("PING")
                except (TimeoutError, ConnectionLost):
                    timed_out += 1
            pending = sum(n.waiting for n in r._nodes.values())
            await asyncio.sleep(0.35)
            with pytest.raises(ConnectionLost):  # the stalled connection is given up...
                await r.execute("PING")
            server.signal(signal.SIGCONT)
            return timed_out, pending, await r.execute("PING")  # ...and a new one works
        finally:
            server.signal(signal.SIGCONT)
            await r.close()
    timed_out, pending, pong = run(go())
    assert timed_out == 40 and pending <= 16 and pong == b"PONG"
