"""Claims on the shared load picture: a router that places a long prefill publishes it and reads the other
routers' figures on that replica in one round trip, so that of two routers deciding within the same few
milliseconds the second learns of the first before its request is sent. Real Redis (and Redis Cluster), the
router's own SharedLoad and LoadTable, in process."""

import asyncio

from router.config import SharedLoadConfig
from router.load import LoadTable
from router.metrics import Metrics
from router.shared_load import SharedLoad, new_host_id
from router.store import Store

REPLICAS = ["r1", "r2"]


class Router:
    """One router host's share of the picture: its load table and its SharedLoad, on ``url``."""

    def __init__(self, url: str) -> None:
        self.store = Store(url)
        self.load = LoadTable(REPLICAS, Metrics())
        self.shared = SharedLoad(self.store, self.load, SharedLoadConfig(), new_host_id())

    def place(self, replica: str, tokens: int) -> None:
        assert self.load.take(replica, 256)
        self.load.add_pending(replica, tokens)

    async def close(self) -> None:
        await self.shared.close()
        await self.store.close()


def run(url, body):
    async def main():
        routers = [Router(url), Router(url)]
        try:
            return await body(*routers)
        finally:
            for r in routers:
                await r.close()
    return asyncio.run(main())


def test_of_two_claims_on_one_replica_the_second_sees_the_first(shared_url):
    async def body(a, b):
        a.place("r1", 2000)
        b.place("r1", 3000)
        first = await a.shared.claim("r1")
        second = await b.shared.claim("r1")
        return first, second, b.shared.others("r1")

    first, second, pictured = run(shared_url, body)
    assert first == (0, 0)
    assert second == (1, 2000)
    assert pictured == (1, 2000)  # the figures join the picture the next decision weighs


def test_a_claim_reads_only_the_other_hosts_figures(shared_url):
    async def body(a, b):
        a.place("r1", 2000)
        await a.shared.claim("r1")
        return await a.shared.claim("r1")

    assert run(shared_url, body) == (0, 0)


def test_a_claim_given_up_leaves_redis_at_the_next_round(shared_url):
    async def body(a, b):
        await a.shared.tick()  # published: nothing on r1
        a.place("r1", 2000)
        await a.shared.claim("r1")  # r1 claimed in Redis, then the request moved elsewhere
        a.load.add_pending("r1", -2000)
        a.load.release("r1")
        a.place("r2", 2000)
        await a.shared.tick()
        await b.shared.tick()
        return b.shared.others("r1"), b.shared.others("r2")

    assert run(shared_url, body) == ((0, 0), (1, 2000))


def test_routers_know_when_another_shares_the_picture(shared_url):
    async def body(a, b):
        await a.shared.tick()
        alone = a.shared.contended()
        await b.shared.tick()
        await a.shared.tick()
        return alone, a.shared.contended(), b.shared.contended()

    assert run(shared_url, body) == (False, True, True)
