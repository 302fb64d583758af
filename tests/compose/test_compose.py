"""The docker-compose stack as users run it (marker ``compose``: ``./tests/run.sh -m compose``).

``deploy/docker-compose.yml`` unchanged: its image built from ``deploy/Dockerfile``, its services brought up,
driven through both routers with the ``openai`` client, one replica container killed, and stopped. Grafana is
not packaged by Debian and no registry is reachable here, so every service but Grafana runs; its dashboard is
checked against the metrics in ``tests/deploy/test_compose_file.py``. The tests share one stack and run in
file order: the kill and the stop come last.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from typing import Iterator

import httpx
import openai
import pytest
import yaml

from loadtest.cluster import free_port
from support.compose import Stack, engine_env
from support.paths import DEPLOY
from support.waiting import wait_until

pytestmark = [pytest.mark.compose, pytest.mark.timeout(1800)]

FILE = DEPLOY / "docker-compose.yml"
SERVICES = yaml.safe_load(FILE.read_text())["services"]
RUNNING = [s for s in SERVICES if s != "grafana"]
ROUTERS = sorted(s for s in SERVICES if s.startswith("router-"))
REPLICAS = sorted(s for s in SERVICES if s.startswith("replica-"))
CLIENT = httpx.Client(timeout=30)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    ports = {"ROUTER_1_PORT": free_port(), "ROUTER_2_PORT": free_port(), "PROMETHEUS_PORT": free_port()}
    s = Stack(FILE, f"kvroute-test-{os.getpid()}", engine_env(), {k: str(v) for k, v in ports.items()})
    s.down()  # what an interrupted run of this process id left
    try:
        started = time.monotonic()
        # the routers and replicas run one image (image: kvroute:local): build it once
        s.compose("build", ROUTERS[0], timeout=1500)
        s.timings["build_s"] = time.monotonic() - started
        s.compose("up", "-d", *RUNNING, timeout=600)
        s.timings["healthy_after_up_s"] = s.wait_healthy(RUNNING, timeout=180)
        s.drive_health_checks()
        yield s
    finally:
        s.down()


def router_url(stack: Stack, router: str) -> str:
    return f"http://127.0.0.1:{stack.variables[router.upper().replace('-', '_') + '_PORT']}"


def prometheus(stack: Stack, path: str) -> dict:
    r = CLIENT.get(f"http://127.0.0.1:{stack.variables['PROMETHEUS_PORT']}{path}")
    r.raise_for_status()
    return r.json()["data"]


def test_every_service_but_grafana_builds_starts_and_reports_healthy(stack: Stack, figure) -> None:
    size = int(stack.engine("image", "inspect", "--format", "{{.Size}}", "kvroute:local").strip())
    figure({**{k: round(v, 1) for k, v in stack.timings.items()}, "image_mb": round(size / 1e6)})
    assert {s: stack.health(s) for s in RUNNING} == {s: "healthy" for s in RUNNING}


@pytest.mark.parametrize("router", ROUTERS)
def test_each_router_reaches_every_replica_by_its_service_name(stack: Stack, router: str) -> None:
    def ready() -> int:
        return CLIENT.get(router_url(stack, router) + "/ready").json().get("ready_replicas", 0)
    wait_until(lambda: ready() == len(REPLICAS), timeout=30, interval=0.5)


def test_the_routers_and_replicas_run_as_a_user_other_than_root(stack: Stack) -> None:
    for service in ROUTERS + REPLICAS:
        uid = stack.engine("exec", stack.container(service), "id", "-u").strip()
        assert uid != "0", service


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_and_completions_answer_through_each_router(stack: Stack, router: str, stream: bool) -> None:
    client = openai.OpenAI(base_url=router_url(stack, router) + "/v1", api_key="unused", max_retries=0, timeout=30)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=8, stream=stream)
    done = client.completions.create(model="tiny", prompt="hello there", max_tokens=8, stream=stream)
    if stream:
        chat_text = "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
        done_text = "".join(c.choices[0].text for c in done if c.choices)
    else:
        chat_text, done_text = chat.choices[0].message.content, done.choices[0].text
    assert chat_text and done_text


def test_a_prefix_routed_by_one_router_is_found_by_the_other_through_redis(stack: Stack) -> None:
    first, second = (router_url(stack, r) for r in ROUTERS)
    for i in range(3):
        prefix = f"{uuid.uuid4()} " + "a shared document that several requests begin with. " * 40
        a = CLIENT.post(first + "/v1/completions", json={"model": "tiny", "prompt": prefix + "first", "max_tokens": 4})
        b = CLIENT.post(second + "/v1/completions", json={"model": "tiny", "prompt": prefix + "second",
                                                          "max_tokens": 4})
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        assert int(a.headers["x-kvroute-cached-tokens"]) == 0  # new to both
        # the second router never saw the prefix: only the shared index can tell it where it is
        assert int(b.headers["x-kvroute-cached-tokens"]) > 0, i
        assert b.headers["x-kvroute-replica"] == a.headers["x-kvroute-replica"]


def test_prometheus_scrapes_both_routers_and_every_replica_and_loads_every_alert_rule(stack: Stack) -> None:
    def targets() -> dict[str, str]:
        return {t["labels"]["instance"]: t["health"] for t in prometheus(stack, "/api/v1/targets")["activeTargets"]}

    want = {f"{s}:8000": "up" for s in ROUTERS + REPLICAS}
    wait_until(lambda: targets() == want, timeout=30, interval=1.0)
    rules = [r["name"] for g in prometheus(stack, "/api/v1/rules")["groups"] for r in g["rules"]]
    written = [r["alert"] for g in yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
               for r in g["rules"]]
    assert sorted(rules) == sorted(written)


def test_requests_keep_succeeding_when_a_replica_container_is_killed(stack: Stack, figure) -> None:
    urls = [router_url(stack, r) + "/v1/completions" for r in ROUTERS]
    statuses: list[int] = []
    victim = stack.container(REPLICAS[0])
    for i in range(60):
        if i == 10:
            stack.engine("kill", victim)
        for url in urls:
            r = CLIENT.post(url, json={"model": "tiny", "prompt": f"request {i} of the kill test", "max_tokens": 4})
            statuses.append(r.status_code)
    figure({"requests": len(statuses), "failed": sum(s != 200 for s in statuses)})
    assert statuses == [200] * len(statuses)


def test_the_routers_exit_0_within_their_stop_grace_period(stack: Stack, figure) -> None:
    grace = float(SERVICES[ROUTERS[0]]["stop_grace_period"].removesuffix("s"))
    stack.stop_health_checks()
    started = time.monotonic()
    stack.compose("stop", *ROUTERS, timeout=grace * 3)
    took = time.monotonic() - started
    codes = {r: stack.state(r)["ExitCode"] for r in ROUTERS}
    # each router first answers 503 on /ready for two of the intervals its health check polled it at
    unready = {r: re.findall(r"/ready answers 503 for ([0-9.]+) s", stack.logs(r, 20)) for r in ROUTERS}
    figure({"stop_s": round(took, 1), "exit_codes": codes, "unready_s": unready})
    assert codes == {r: 0 for r in ROUTERS}
    assert took < grace
