"""The gateway's own Prometheus metrics, all prefixed ``kvroute_``."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, disable_created_metrics,
                               generate_latest)

# A "_created" series beside every counter and histogram doubled /metrics and told nothing a scrape needs
disable_created_metrics()

# Buckets for time to first byte and end-to-end latency: from a cached-prefix hit (ms) to long
# generations (minutes).
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_CHILDREN = 4096  # bound label children kept per gateway
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    """One registry per gateway instance, so several can live in one process (tests, embedding).

    With several worker processes (``PROMETHEUS_MULTIPROC_DIR`` set by :mod:`router.workers`) every
    worker writes its values to files in that folder, and :meth:`render` adds them up: counters and
    histograms are summed, in-flight and queue gauges summed over live workers, replica gauges
    (readiness, drained, engine figures) the value a live worker set last. The router shows as one.
    """

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.requests = Counter(
            "kvroute_requests", "Requests answered, by model, replica ('none' if the router answered) and HTTP status.",
            ["model", "replica", "status"], registry=r)
        self.ttfb = Histogram(
            "kvroute_time_to_first_byte_seconds", "From request arrival to the first response byte sent on.",
            ["replica"], buckets=_LATENCY_BUCKETS, registry=r)
        self.latency = Histogram(
            "kvroute_request_duration_seconds", "From request arrival to the last response byte.",
            ["replica"], buckets=_LATENCY_BUCKETS, registry=r)
        self.inflight = Gauge(
            "kvroute_inflight_requests", "Requests this router has in flight on each replica.", ["replica"], registry=r,
            multiprocess_mode="livesum")
        self.retries = Counter(
            "kvroute_retries", "Requests sent again to another replica, by the reason of the failed attempt.",
            ["reason"], registry=r)
        self.disaggregated = Counter(
            "kvroute_disaggregated_requests", "Requests split into a prefill and a decode, by how the split went: "
            "split (the decode read the prefill's KV), no_transfer_params (the prefill named none: the decode "
            "computed the prompt), prefill_failed (no prefill replica answered: the decode computed it), "
            "prefill_again (a decode attempt failed after it may have read the KV: prefilled once more); and "
            "local: not split, sent whole to a decode replica holding nearly all its prompt (computing the rest); "
            "no_transfer_pair: prefilled, but no decode replica left that can read KV from that platform (one "
            "computed the prompt).",
            ["outcome"], registry=r)
        self.upstream_errors = Counter(
            "kvroute_upstream_errors", "Failures talking to a replica, by kind.", ["replica", "kind"], registry=r)
        # process_resident_memory_bytes, process_open_fds, ...: what a soak or a leak shows first
        ProcessCollector(registry=r)
        self.tasks = Gauge("kvroute_event_loop_tasks", "asyncio tasks alive in the process that answers the "
                           "scrape (one per request in flight, plus a few per replica).", registry=r,
                           multiprocess_mode="livesum")
        if not self._multiprocess_dir:
            self.tasks.set_function(_tasks_alive)
        self.stream_failovers = Counter(
            "kvroute_stream_failovers", "Streams a replica broke after they started, by what followed: completed "
            "(another replica generated the rest), failed (no replica could), not_resumable (the request does not "
            "qualify, or proxy.stream_failover is off).", ["outcome"], registry=r)
        self.queue_length = Gauge(
            "kvroute_queue_length", "Requests waiting for a replica with free capacity.", registry=r,
            multiprocess_mode="livesum")
        self.queue_wait = Histogram(
            "kvroute_queue_wait_seconds", "Time requests waited in the router queue (admitted or not).",
            buckets=_QUEUE_BUCKETS, registry=r)
        self.queue_rejected = Counter(
            "kvroute_queue_rejected", "Requests refused with 429 because the queue was full or the wait too long.",
            ["reason"], registry=r)
        self.replica_ready = Gauge(
            "kvroute_replica_ready", "1 if the replica is ready to take requests.", ["replica"], registry=r,
            multiprocess_mode="livemostrecent")
        self.replica_draining = Gauge(
            "kvroute_replica_draining", "1 if the replica is drained by an operator.", ["replica"], registry=r,
            multiprocess_mode="livemostrecent")
        self.health_routers = Gauge(
            "kvroute_health_routers", "Routers sharing the health checks and scrapes through Redis (1: this "
            "router checks every replica itself).", registry=r, multiprocess_mode="livemax")
        self.health_owned = Gauge(
            "kvroute_health_owned_replicas", "Replicas whose checks this router owns: it checks them at the "
            "configured rates and the others take its verdicts.", registry=r, multiprocess_mode="livesum")
        self.replica_ejections = Counter(
            "kvroute_replica_ejections", "Times a replica was taken out of rotation for failing requests in a row "
            "(health.eject_after).", ["replica"], registry=r)
        self.replica_restarts = Counter(
            "kvroute_replica_restarts", "Replica restarts seen (new process start time or counter reset).",
            ["replica"], registry=r)
        self.replica_engine_load = Gauge(
            "kvroute_replica_engine_requests", "Running plus waiting requests reported by the replica's /metrics.",
            ["replica"], registry=r, multiprocess_mode="livemostrecent")
        self.replica_kv_usage = Gauge(
            "kvroute_replica_kv_cache_usage", "KV cache usage (0..1) reported by the replica's /metrics.",
            ["replica"], registry=r, multiprocess_mode="livemostrecent")

        self.prompt_tokens = Counter(
            "kvroute_prompt_tokens", "Prompt tokens of routed requests (estimated in byte mode).", ["model"],
            registry=r)
        self.prompt_keys = Counter(
            "kvroute_prompt_keys", "Prompts keyed, by mode: tokens (the ids the replica computes), bytes (the model "
            "has no tokenizer here, or this request's ids cannot be known: see reason), none (nothing to key).",
            ["mode", "reason"], registry=r)
        self.cached_tokens = Counter(
            "kvroute_predicted_cached_tokens", "Prompt tokens predicted to be in the chosen replica's prefix cache.",
            ["model"], registry=r)
        self.decisions = Counter(
            "kvroute_routing_decisions", "Routing decisions by reason: cache (went where the longest cached "
            "prefix is), load (no cached prefix, or load outweighed it), fallback (shared index unavailable).",
            ["reason"], registry=r)
        self.claims = Counter(
            "kvroute_shared_load_claims", "Placements of a long prefill published and checked against the other "
            "routers' figures before the request was sent (shared_load.claim_min_tokens), by outcome: kept (no other "
            "router placed prefill there unseen), moved (one had: chosen again, elsewhere), stayed (one had, and the "
            "replica was still the best), unanswered (Redis did not answer in time).", ["outcome"], registry=r)
        self.index_lookup = Histogram(
            "kvroute_index_lookup_seconds", "Prefix index lookup time per request.",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1), registry=r)
        self.decision = Histogram(
            "kvroute_decision_seconds", "Time to decide where a request goes, per request: its prompt key, the index "
            "lookup, the candidates and their scores (a wait in the queue not included).",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25), registry=r)
        self.index_blocks = Gauge(
            "kvroute_index_blocks", "Blocks the prefix index holds for each replica (this router's view).",
            ["replica"], registry=r, multiprocess_mode="livemax")
        self.conversations_waiting = Gauge(
            "kvroute_conversations_waiting", "Conversations between turns this router expects back at each replica "
            "(answered prompts not continued yet, within conversations.window_s).",
            ["replica"], registry=r, multiprocess_mode="livesum")
        self.index_errors = Counter(
            "kvroute_index_errors", "Failed or too slow calls to the shared (Redis) index.", ["op"], registry=r)
        self.client_refused = Counter(
            "kvroute_client_refused", "Client connections or requests refused before they were read: header_timeout, "
            "header_too_large, too_many_connections, too_many_from_address, body_timeout, send_timeout (took no bytes of its "
            "answer).", ["reason"], registry=r)
        self.index_fallback = Gauge(
            "kvroute_index_fallback", "1 while lookups are answered by the local index because Redis failed or was "
            "too slow (until a lookup reaches Redis again).", registry=r, multiprocess_mode="livemax")
        self.index_fallback_lookups = Counter(
            "kvroute_index_fallback_lookups", "Lookups the local index answered because Redis failed or was too slow "
            "(each such decision is counted with reason fallback).", registry=r)
        self.index_mode = Gauge(
            "kvroute_index_precise", "1 while the replica's KV-cache events feed the index (precise mode), 0 while "
            "the index predicts from routing decisions (approximate).", ["replica"], registry=r,
            multiprocess_mode="livemax")
        self.kv_events = Counter(
            "kvroute_kv_events", "KV-cache events applied, by type (types it does not use are counted per source in "
            "/admin/replicas, unknown_event_types).",
            ["replica", "type"], registry=r)
        self.kv_event_blocks = Counter(
            "kvroute_kv_event_blocks", "Blocks in applied events: stored, removed, reconfirmed (ancestors of stored "
            "blocks held again), orphaned (parent never seen: events were missed), unkeyed (model keyed in byte mode).",
            ["replica", "op"], registry=r)
        self.kv_event_recoveries = Counter(
            "kvroute_kv_event_recoveries", "Event stream recoveries: gap (missed batches), replay (recovered them), "
            "rebuild (could not: the replica's entries were dropped), restart (sequence went back), reconnect "
            "(silent while serving), bad_message.", ["replica", "kind"], registry=r)
        self.kv_event_lag = Histogram(
            "kvroute_kv_event_lag_seconds", "From the replica's batch timestamp to the batch applied to the index.",
            ["replica"], buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5), registry=r)
        self.kv_event_lease = Gauge(
            "kvroute_kv_event_lease", "1 while this router holds the replica's event lease (it consumes the events "
            "for every router on the shared index).", ["replica"], registry=r, multiprocess_mode="livemax")

        # tenants (router.tenants): labels are tenant names from the configuration or the admin API (bounded)
        self.tenant_requests = Counter(
            "kvroute_tenant_requests", "Requests per tenant and class, by what became of them at admission: admitted, "
            "requests_per_minute, tokens_per_minute, max_concurrent (refused by that limit), shed (a full queue made "
            "room for a more urgent class), queue_full, queue_timeout.", ["tenant", "class", "outcome"], registry=r)
        self.tenant_tokens = Counter(
            "kvroute_tenant_tokens", "Tokens served per tenant: prompt (as the router counts it) and completion (as "
            "the replica's usage says, else the stream's events).", ["tenant", "kind"], registry=r)
        self.tenant_inflight = Gauge(
            "kvroute_tenant_inflight", "Requests in flight per tenant on this router.", ["tenant"], registry=r,
            multiprocess_mode="livesum")
        self.class_queue_wait = Histogram(
            "kvroute_class_queue_wait_seconds", "Time requests waited in the router queue, per priority class.",
            ["class"], buckets=_QUEUE_BUCKETS, registry=r)

        self.ttft_ratio = Histogram(
            "kvroute_ttft_prediction_ratio", "Measured over predicted time to first token of each streamed answer "
            "(the prediction as routing used it, corrected): 1 is exact, 2 took twice as long as predicted.",
            ["replica", "platform"], buckets=(0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0), registry=r)
        self.ttft_error = Gauge(
            "kvroute_ttft_prediction_error", "Recent error of the predicted time to first token per replica: the "
            "average over about the last prediction.window answers of |predicted - measured| / measured.",
            ["replica"], registry=r, multiprocess_mode="livemax")
        self.ttft_fixed = Gauge(
            "kvroute_ttft_fixed_seconds", "The fixed part of a replica's predicted times to first token, learned "
            "online from its answers (set once prediction.min_samples came, its own or its kind's).",
            ["replica"], registry=r, multiprocess_mode="livemostrecent")
        self.ttft_slope = Gauge(
            "kvroute_ttft_model_slope", "What a replica's predicted prefill is multiplied by, learned online from its "
            "answers: above 1, the model prices its prefill too cheap.",
            ["replica"], registry=r, multiprocess_mode="livemostrecent")
        self.slo = Counter(
            "kvroute_slo_requests", "Requests with a latency target (x-slo-ttft-ms, x-slo-tpot-ms), per target, by "
            "outcome: met, missed (measured over the target), rejected (no replica predicted to meet it), routed (none "
            "predicted to, sent anyway: slo.on_miss route).",
            ["target", "outcome"], registry=r)

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, bound once: label lookups cost more than the increment.

        The cache is bounded (a client that sends many model names does not grow it past
        ``_CHILDREN``); past that, lookups go to the metric each time.
        """
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = metric.labels(*labels)
            if len(self._children) < _CHILDREN:
                self._children[key] = child
        return child

    def forget_replica(self, name: str) -> None:
        """Drop every series labelled with replica ``name`` (it was removed: its labels must not pile up)."""
        self._forget("replica", name)

    def forget_model(self, model: str) -> None:
        """Drop every series labelled with model ``model`` (no replica serves it any more)."""
        self._forget("model", model)

    def _forget(self, label: str, value: str) -> None:
        for metric in list(self.__dict__.values()):
            labelnames = getattr(metric, "_labelnames", ())
            if label not in labelnames:
                continue
            at = labelnames.index(label)
            for labels in list(getattr(metric, "_metrics", {})):
                if labels[at] == value:
                    metric.remove(*labels)
        self._children = {k: v for k, v in self._children.items() if value not in k[1]}

    def render(self) -> bytes:
        if self._multiprocess_dir:
            from prometheus_client import multiprocess

            self.tasks.set(_tasks_alive())  # this worker's count (the others' as they last answered)

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry, self._multiprocess_dir)
            ProcessCollector(registry=registry)  # the worker that answers
            return generate_latest(registry)
        return generate_latest(self.registry)


def _tasks_alive() -> float:
    try:
        return float(len(asyncio.all_tasks()))
    except RuntimeError:  # scraped outside the event loop (a test, a collector thread)
        return 0.0
