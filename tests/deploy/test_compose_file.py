"""The docker-compose stack agrees with itself and with the code, checked without starting it.

``tests/compose/`` (marker ``compose``) builds and runs the stack; these check in a second what can drift
(commands, flags, service names, ports, metric names, health checks) against the real parsers.
"""

import json
import re
import subprocess
import sys

import yaml

from loadtest.simulator import parser as simulator_parser
from router.metrics import Metrics
from support.paths import DEPLOY, ROOT

COMPOSE = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def services(prefix):
    return sorted(n for n in SERVICES if n.startswith(prefix))


def test_stack_has_redis_routers_replicas_prometheus_and_grafana():
    assert {"redis", "prometheus", "grafana"} <= set(SERVICES)
    assert len(services("router-")) == 2 and len(services("replica-")) == 3


def test_router_command_and_environment_form_a_valid_configuration():
    for name in services("router-"):
        svc = SERVICES[name]
        args = svc["command"]
        assert args[0] == "serve"
        env = {"PATH": "", **svc["environment"]}
        out = subprocess.run([sys.executable, "-m", "router", "check-config", *args[1:]], capture_output=True,
                             text=True, env=env, timeout=30)
        assert out.returncode == 0, out.stderr
        cfg = yaml.safe_load(out.stdout)
        assert cfg["index"]["backend"] == "redis://redis:6379/0"
        hosts = {re.match(r"http://([^:]+):", r["url"]).group(1) for r in cfg["replicas"]}
        assert hosts == set(services("replica-"))


def test_replica_commands_parse():
    for name in services("replica-"):
        args = simulator_parser().parse_args(SERVICES[name]["command"])
        assert args.host == "0.0.0.0" and args.port == 8000


def test_prometheus_scrapes_every_router_and_replica():
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {f"{n}:8000" for n in services("router-") + services("replica-")}


def test_dashboard_queries_only_metrics_that_exist():
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "kvroute.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    ours = {m.name for m in Metrics().registry.collect()}
    for name in set(re.findall(r"kvroute_[a-z_]+", exprs)):
        base = re.sub(r"_(total|bucket|sum|count)$", "", name)
        assert base in ours, name
    sim_text = (ROOT / "loadtest" / "simulator.py").read_text()
    for name in set(re.findall(r"vllm:[a-z_]+", exprs)):
        assert name in sim_text, name


def test_dockerfile_copies_what_exists():
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (DEPLOY.parent / src).exists(), src


def test_every_service_has_a_health_check_and_waits_for_healthy_dependencies():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    for name, svc in SERVICES.items():
        from_image = "build" in svc and "HEALTHCHECK" in dockerfile
        assert "healthcheck" in svc or from_image, name
        for dep, how in (svc.get("depends_on") or {}).items():
            assert how == {"condition": "service_healthy"}, (name, dep)


def test_the_kvroute_processes_run_under_an_init_and_not_as_root():
    assert "\nUSER kvroute" in (DEPLOY / "Dockerfile").read_text()
    for name in services("router-") + services("replica-"):
        assert SERVICES[name]["init"] is True, name


def test_the_build_context_leaves_out_tests_caches_and_results():
    ignored = set((DEPLOY.parent / ".dockerignore").read_text().split())
    assert {".git", ".venv", "tests", "loadtest/results", "**/__pycache__"} <= ignored
