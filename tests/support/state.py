"""What a stand-in replica and a router say about themselves: counters, faults, the admin view, the
prompt keys, a replica's running requests."""

from __future__ import annotations

from loadtest.cluster import HTTP, Proc
from router.replicas.stats import parse_metrics

from .waiting import wait_until


def sim_state(sim: Proc) -> dict:
    return HTTP.get(sim.url + "/sim/state", timeout=2).json()["counters"]


def set_faults(sim: Proc, **faults: object) -> None:
    HTTP.post(sim.url + "/sim/faults", json=faults, timeout=2).raise_for_status()


def replica_names(router_proc: Proc) -> set[str]:
    """The names of the replicas a router holds now (any state)."""
    return {r["name"] for r in HTTP.get(router_proc.url + "/admin/replicas", timeout=5).json()["replicas"]}


def replicas_view(router_proc: Proc, headers: dict[str, str] | None = None) -> dict[str, dict]:
    body = HTTP.get(router_proc.url + "/admin/replicas", headers=headers, timeout=2).json()
    return {r["url"]: r for r in body["replicas"]}


def prompt_keys(router_proc: Proc) -> dict:
    """How the router keys each model's prompts (``/admin/replicas``' ``prompt_keys``)."""
    return HTTP.get(router_proc.url + "/admin/replicas", timeout=2).json()["prompt_keys"]


def wait_keyed_by_tokens(router_proc: Proc, timeout: float, model: str = "tiny") -> None:
    """Until the router has found ``model``'s tokenizer (it looks in the background, after the first health
    check)."""
    wait_until(lambda: prompt_keys(router_proc).get(model, {}).get("mode") == "tokens", timeout)


def running(url: str) -> float:
    """A replica's ``vllm:num_requests_running`` now (summed over engines), by the router's own line scan."""
    return parse_metrics(HTTP.get(url + "/metrics", timeout=5).text).running
