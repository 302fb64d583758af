"""Running a test body against a fresh index (in process, Redis or Redis Cluster) in one event loop."""

import asyncio

from router.index import build_index


class Runner:
    """Runs a test body against a fresh index, inside one event loop."""

    def __init__(self, spec, namespace):
        self.spec, self.namespace = spec, namespace

    def __call__(self, body):
        async def main():
            idx = build_index(self.spec, namespace=self.namespace, timeout_s=1.0)
            try:
                return await body(idx)
            finally:
                await idx.close()
        return asyncio.run(main())
