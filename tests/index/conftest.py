"""The index tests' backends: each test taking ``run`` runs once in process, on a redis-server of this
module's own and on the session's Redis Cluster."""

import pytest

from loadtest.cluster import redis_server, wait_redis
from support.indexes import Runner


@pytest.fixture(scope="module")
def index_redis(tmp_path_factory):
    p = redis_server(log_dir=tmp_path_factory.mktemp("redis")).start()
    wait_redis(p)
    yield p
    p.stop()


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
def run(request, index_redis):
    if request.param == "memory":
        spec = "memory"
    elif request.param == "redis":
        spec = f"redis://127.0.0.1:{index_redis.port}/0"
    else:
        spec = request.getfixturevalue("redis_cluster").url
    return Runner(spec, f"t{abs(hash(request.node.name))}")
