"""The Redis index behind a circuit breaker: Redis while it answers, this router's own index when not."""

import asyncio

from loadtest.cluster import free_port
from router.config import IndexConfig
from router.index.fallback import FallbackIndex
from router.index.memory import MemoryIndex
from router.index.redis import RedisIndex
from router.metrics import Metrics


def fallback(url, **cfg):
    cfg = IndexConfig(backend=url, timeout_s=0.2, retry_after_s=0.2, **cfg)
    return FallbackIndex(RedisIndex.from_url(url, namespace="fb", timeout_s=cfg.timeout_s), MemoryIndex(), cfg, Metrics())


async def settle(index, until, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not await until():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def test_records_reach_redis_and_withdrawals_take_them_back(redis_proc):
    url = f"redis://127.0.0.1:{redis_proc.port}/0"

    async def go():
        index = fallback(url)
        other = RedisIndex.from_url(url, namespace="fb")  # another router's view
        try:
            await index.start()
            receipt = await index.record("m", "a", [1, 2, 3], 100)
            await settle(index, lambda: _held(other, [1, 2, 3], 3))
            await index.withdraw(receipt)
            await settle(index, lambda: _held(other, [1, 2, 3], 0))
            probe = await index.probe("m", [1, 2, 3], ["a"])
            return probe.degraded, probe.matches["a"].blocks
        finally:
            await index.close()
            await other.close()

    assert asyncio.run(go()) == (False, 0)


async def _held(index, chain, blocks):
    return (await index.probe("m", chain, ["a"])).matches["a"].blocks == blocks


def test_without_redis_lookups_are_answered_by_the_local_index():
    async def go():
        index = fallback(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
        try:
            await index.start()
            await index.record("m", "a", [1, 2, 3], 100)
            probe = await index.probe("m", [1, 2, 3], ["a", "b"])
            return probe.degraded, {r: m.blocks for r, m in probe.matches.items()}, index.metrics.index_fallback._value.get()
        finally:
            await index.close()

    assert asyncio.run(go()) == (True, {"a": 3, "b": 0}, 1)


def test_a_lone_slow_lookup_shows_in_the_gauge_and_the_counter_until_redis_answers_again(redis_proc):
    import signal

    url = f"redis://127.0.0.1:{redis_proc.port}/0"

    async def go():
        index = fallback(url, trip_after=3)
        m = index.metrics
        try:
            await index.start()
            await index.record("m", "a", [1, 2, 3], 100)
            redis_proc.signal(signal.SIGSTOP)  # one answer too slow: not yet "down"
            try:
                slow = await index.probe("m", [1, 2, 3], ["a"])
            finally:
                redis_proc.signal(signal.SIGCONT)
            during = (slow.degraded, m.index_fallback._value.get(), m.index_fallback_lookups._value.get())
            await settle(index, lambda: _answered_by_redis(index))
            return during, m.index_fallback._value.get()
        finally:
            await index.close()

    assert asyncio.run(go()) == ((True, 1, 1), 0)


async def _answered_by_redis(index) -> bool:
    return not (await index.probe("m", [1, 2, 3], ["a"])).degraded
