"""The hot path's HTTP/1.1 client to replicas (router/upstream.py) against a real stand-in replica."""

import json

import uvloop

from support.processes import FAST
from router.upstream import UpstreamPool

BODY = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 1}).encode()
HEADERS = b"content-type: application/json\r\n"


async def _complete(pool):
    resp = await pool.request(b"POST", "/v1/completions", HEADERS, BODY, 10)
    try:
        await resp.read(1 << 20, 10)
        return resp.status
    finally:
        resp.release()


class _ClosedHandle:
    """A kept-alive connection's transport as uvloop leaves it when the replica died a moment ago: the
    handle is closed, the protocol not told yet, and a write raises (seen on a killed vLLM replica)."""

    def __init__(self, real):
        self.real = real

    def write(self, data):
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

    def is_closing(self):
        return False  # what the pool sees before the loop gets round to it

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_a_kept_alive_connection_whose_write_fails_is_replaced_not_an_error(cluster):
    sim = cluster.sim(*FAST)

    async def go():
        pool = UpstreamPool(sim.url, 2.0)
        try:
            first = await _complete(pool)
            (idle,) = pool._idle
            idle.transport = _ClosedHandle(idle.transport)
            return first, await _complete(pool)
        finally:
            pool.close()

    assert uvloop.run(go()) == (200, 200)
