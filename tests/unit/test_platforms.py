"""Platforms come from one table (router/platforms.py): a platform added there alone is configured, planned,
started and routed to like the built-in ones."""

from __future__ import annotations

from typing import Iterator

import pytest

from router import plan as P
from router import platforms
from router.config import ReplicaConfig
from router.platforms import GB, Launch, Platform
from router.policy import build_policy
from router.request import RouteRequest
from router.view import ReplicaView
from support.paths import FIXTURES

LLAMA_70B = FIXTURES / "models" / "llama-3.1-70b.json"


def _npu(r: Launch) -> tuple[dict[str, str], list[str]]:
    return {"NPU_VISIBLE_DEVICES": ",".join(str(d) for d in range(r.index * r.tp, (r.index + 1) * r.tp))}, \
        ["--npu-graphs"]


@pytest.fixture
def npu() -> Iterator[Platform]:
    made_up = platforms.register(Platform("npu-x", block_size=32, device_speed=4.0, prefill_tokens_per_s=32000,
                                          memory_bytes=192 * GB, devices_per_node=4, tp_sizes=(1, 2, 4),
                                          reserve_bytes=4 * GB, launch=_npu, source="a made-up NPU"))
    yield made_up
    del platforms.PLATFORMS["npu-x"]


def view(cfg: ReplicaConfig) -> ReplicaView:
    return ReplicaView(name=cfg.name, ready=True, drained=False, models=frozenset({"m"}),
                       max_num_seqs=cfg.max_num_seqs, capacity=cfg.capacity,
                       block_size=platforms.get(cfg.platform).block_size, kv_blocks=16384,
                       prefill_rate=cfg.prefill_rate, max_num_batched_tokens=cfg.max_num_batched_tokens)


def test_a_replica_on_a_new_platform_takes_its_figures_from_the_table(npu):
    cfg = ReplicaConfig(url="http://n:8000", platform="npu-x", tensor_parallel_size=2)
    assert cfg.relative_speed == 8.0 and cfg.prefill_rate == 64000


def test_a_new_platform_is_routed_to_when_its_prefill_is_faster(npu):
    slow = ReplicaConfig(name="gaudi", url="http://g:8000", platform="gaudi2")
    fast = ReplicaConfig(name="npu", url="http://n:8000", platform="npu-x")
    request = RouteRequest(model="m", request_id="r", endpoint="/v1/completions", exclude={})
    request.prompt_tokens = 4000
    policy = build_policy("cache-aware")
    assert {policy.choose(request, [view(slow), view(fast)])[0].name for _ in range(5)} == {"npu"}


def test_a_new_platform_is_planned_and_started_with_its_own_environment(npu):
    p = P.plan(LLAMA_70B, P.Target("npu-x", max_model_len=8192))
    assert p.block_size == 32 and p.chosen is not None and p.chosen.tp in (1, 2, 4)
    env, argv = P.serve_commands(p)[0]
    assert env["NPU_VISIBLE_DEVICES"] == ",".join(str(d) for d in range(p.chosen.tp))
    assert "--npu-graphs" in argv and argv[argv.index("--block-size") + 1] == "32"


def test_an_unknown_platform_is_an_error_everywhere():
    with pytest.raises(ValueError, match="unknown platform 'npu-x'"):
        ReplicaConfig(url="http://n:8000", platform="npu-x")
    with pytest.raises(P.PlanError, match="--platform 'npu-x': one of gaudi2"):
        P.plan(LLAMA_70B, P.Target("npu-x"))
