"""The routing core as a whole, in real processes: tickets that withdraw failed records, sessions shared
through Redis, and pipelines built from configuration."""

import collections
import time


from support.processes import FAST
from loadtest.cluster import HTTP
from support.state import set_faults

PROMPT = "The quick brown fox jumps over the lazy dog. " * 40  # about 28 blocks of 64 bytes


def complete(rt, prompt=PROMPT, headers=None):
    return HTTP.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2},
                      headers=headers, timeout=10)


def test_a_failed_first_attempt_does_not_draw_its_prefix_to_that_replica(cluster):
    sims = [cluster.sim(*FAST) for _ in range(2)]
    rt = cluster.router([], config={"proxy": {"max_attempts": 1}, "replicas": [
        {"name": f"r{i}", "url": s.url, "block_size": 16} for i, s in enumerate(sims)]})
    for s in sims:
        set_faults(s, fail_status=503, fail_count=1)
    failed = complete(rt)
    assert failed.status_code == 503
    for s in sims:
        set_faults(s, fail_count=0)
    # the failed attempt's record was withdrawn: nobody is predicted to hold the prompt
    second = complete(rt)
    assert second.status_code == 200 and second.headers["x-kvroute-cached-tokens"] == "0"
    # a served attempt's record stays: the same prompt now goes where it is cached
    third = complete(rt)
    assert third.headers["x-kvroute-replica"] == second.headers["x-kvroute-replica"]
    assert int(third.headers["x-kvroute-cached-tokens"]) > 0


def test_two_routers_sharing_redis_keep_a_session_on_one_replica_with_least_loaded(cluster, shared_url):
    sims = [cluster.sim(*FAST) for _ in range(3)]
    routers = [cluster.router(sims, "--policy", "least-loaded", "--index", shared_url)
               for _ in range(2)]
    placed = {}
    for session in range(4):
        seen = []
        for turn in range(6):
            r = complete(routers[turn % 2], prompt=f"turn {turn}", headers={"x-session-id": f"conversation-{session}"})
            assert r.status_code == 200
            seen.append(r.headers["x-kvroute-replica"])
            time.sleep(0.05)  # a user's next turn
        placed[session] = seen
    assert all(len(set(seen)) == 1 for seen in placed.values()), placed


PLUGIN = '''
from pydantic import BaseModel

from router.policy import Scorer


class PreferParams(BaseModel):
    replica: str


class Prefer(Scorer):
    """Rates one named replica above the others."""

    Params = PreferParams

    def __call__(self, req, view):
        return 1.0 if view.name == self.params.replica else 0.0
'''


def test_a_scorer_added_through_configuration_changes_decisions(cluster, tmp_path):
    (tmp_path / "kvroute_plugins.py").write_text(PLUGIN)
    sims = [cluster.sim(*FAST) for _ in range(3)]
    replicas = [{"name": f"r{i}", "url": s.url} for i, s in enumerate(sims)]
    plain = cluster.router([], config={"replicas": replicas, "policy": {"scorers": [{"name": "load"}]}})
    custom = cluster.router([], config={"replicas": replicas, "policy": {"scorers": [
        {"name": "load"}, {"name": "kvroute_plugins:Prefer", "weight": 2, "replica": "r2"}]}},
        env={"PYTHONPATH": str(tmp_path)})
    spread = collections.Counter(complete(plain, "x").headers["x-kvroute-replica"] for _ in range(30))
    chosen = collections.Counter(complete(custom, "x").headers["x-kvroute-replica"] for _ in range(30))
    assert len(spread) == 3, spread
    assert chosen == {"r2": 30}
