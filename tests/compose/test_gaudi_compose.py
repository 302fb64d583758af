"""The Gaudi recipe (``deploy/gaudi/docker-compose.yml``) started as on a node, with its head-node profile
(marker ``compose``).

The Gaudi vLLM image is replaced by a stand-in (``tests/compose/images/gaudi-vllm``: the simulated replica
behind a ``vllm serve`` command line, warming up before it listens as Gaudi does); everything else is the
recipe: its command line, environment, runtime name, volumes, health check, and the router, Redis and
Prometheus of the profile "router" on the host's network. The command line itself is checked by vLLM's own
parser in ``tests/vllm/test_plan_vllm.py``. The addresses (``kvroute.yaml``, ``targets/``) are the shipped
files with this machine's free ports in place of the nodes', as an operator fills them in.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
import yaml

from loadtest.cluster import free_port
from loadtest.tiny_model import write_tokenizer
from support.compose import Stack, engine_env
from support.paths import DEPLOY, ROOT
from support.recipes import env_example
from support.waiting import wait_until

pytestmark = [pytest.mark.compose, pytest.mark.timeout(1800)]

GAUDI = DEPLOY / "gaudi"
STAND_IN = "localhost/kvroute-test/gaudi-vllm:latest"
WARM_UP_S = 12  # the stand-in's, before it listens
SERVICES = ["vllm", "router", "redis", "prometheus"]
CLIENT = httpx.Client(timeout=30)


def addresses(tmp: Path, port: int, router_port: int) -> dict[str, str]:
    """The shipped kvroute.yaml and Prometheus targets, pointed at this machine's ports."""
    cfg = yaml.safe_load((GAUDI / "kvroute.yaml").read_text())
    cfg["replicas"] = [{**cfg["replicas"][0], "url": f"http://127.0.0.1:{port}"}]
    (tmp / "kvroute.yaml").write_text(yaml.safe_dump(cfg))
    targets = tmp / "targets"
    targets.mkdir()
    for job, address in (("kvroute", router_port), ("vllm", port)):
        groups = json.loads((GAUDI / "targets" / f"{job}.json").read_text())
        (targets / f"{job}.json").write_text(json.dumps([{**groups[0], "targets": [f"127.0.0.1:{address}"]}]))
    return {"KVROUTE_YAML": str(tmp / "kvroute.yaml"), "PROMETHEUS_TARGETS": str(targets)}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("gaudi")
    write_tokenizer(tmp / "model")  # the model folder both the replica and the router read
    port, router_port = free_port(), free_port()
    variables = {**env_example(), "GAUDI_VLLM_IMAGE": STAND_IN, "MODEL_DIR": str(tmp / "model"),
                 "PORT": str(port), "KV_EVENTS_PORT": str(free_port()), "KV_REPLAY_PORT": str(free_port()),
                 "ROUTER_PORT": str(router_port), "REDIS_PORT": str(free_port()),
                 "PROMETHEUS_PORT": str(free_port()), **addresses(tmp, port, router_port)}
    s = Stack(GAUDI / "docker-compose.yml", f"kvroute-gaudi-test-{os.getpid()}", engine_env(), variables,
              profiles=("router",))
    s.down()
    try:
        s.compose("build", "router", timeout=1500)
        s.engine("build", "-q", "-t", STAND_IN, "--build-arg", "KVROUTE_IMAGE=kvroute:local",
                 "--build-arg", f"WARMUP_S={WARM_UP_S}",
                 str(ROOT / "tests" / "compose" / "images" / "gaudi-vllm"), timeout=900)
        s.compose("up", "-d", *SERVICES, timeout=600)
        s.timings["up_at"] = time.monotonic()
        yield s
    finally:
        s.down()


def url(node: Stack, port: str) -> str:
    return f"http://127.0.0.1:{node.variables[port]}"


def replica_state(node: Stack) -> str:
    body = CLIENT.get(url(node, "ROUTER_PORT") + "/admin/replicas").json()
    (replica,) = body["replicas"]
    return replica["state"]


def test_the_replica_warming_up_is_starting_to_the_router_and_to_its_health_check(node: Stack, figure) -> None:
    wait_until(lambda: _answers(url(node, "ROUTER_PORT") + "/health"), timeout=60, interval=0.5)
    during = replica_state(node)
    node.check_health()
    health_during = node.health("vllm")
    wait_until(lambda: replica_state(node) == "ready", timeout=120, interval=0.5)
    ready_after_up = time.monotonic() - node.timings["up_at"]
    figure({"warm_up_s": WARM_UP_S, "ready_after_up_s": round(ready_after_up, 1)})
    assert during == "starting" and health_during == "starting"
    assert ready_after_up >= WARM_UP_S
    node.wait_healthy(SERVICES, timeout=60)


def test_a_chat_through_the_head_node_router_reaches_the_replica(node: Stack) -> None:
    node.wait_healthy(SERVICES, timeout=120)
    name = node.variables["SERVED_MODEL_NAME"]
    client = openai.OpenAI(base_url=url(node, "ROUTER_PORT") + "/v1", api_key="unused", max_retries=0, timeout=30)
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hello"}], max_tokens=8)
    assert chat.choices[0].message.content and chat.model == name


def test_the_router_follows_the_replicas_kv_events_on_the_recipes_ports(node: Stack) -> None:
    node.wait_healthy(SERVICES, timeout=120)

    def precise() -> bool:
        (replica,) = CLIENT.get(url(node, "ROUTER_PORT") + "/admin/replicas").json()["replicas"]
        return replica["index"]["mode"] == "precise"
    wait_until(precise, timeout=30, interval=0.5)


def test_head_node_prometheus_scrapes_the_router_and_the_replica_with_every_alert_rule(node: Stack) -> None:
    node.wait_healthy(SERVICES, timeout=120)
    prom = url(node, "PROMETHEUS_PORT")

    def jobs_up() -> dict[str, str]:
        data = CLIENT.get(prom + "/api/v1/targets").json()["data"]["activeTargets"]
        return {t["labels"]["job"]: t["health"] for t in data}
    wait_until(lambda: jobs_up() == {"kvroute": "up", "vllm": "up"}, timeout=30, interval=1.0)
    groups = CLIENT.get(prom + "/api/v1/rules").json()["data"]["groups"]
    written = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
    assert sorted(r["name"] for g in groups for r in g["rules"]) == sorted(r["alert"] for g in written
                                                                           for r in g["rules"])


def _answers(address: str) -> bool:
    try:
        return CLIENT.get(address, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
