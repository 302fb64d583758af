"""The configuration's sections and :class:`RouterConfig`, which holds them: each field with its default,
its bounds and what it means (``kvroute config-reference`` prints them all)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from .. import platforms
from ..store.client import parse_url
from .fields import _Model
from .replica import ReplicaConfig
from .tenants import TenancyConfig, TenantConfig, check_tenants


class HealthConfig(_Model):
    interval_s: float = Field(1.0, gt=0, description="seconds between health checks of a replica")
    timeout_s: float = Field(2.0, gt=0, description="seconds each request of a health check (/health, then "
                             "/v1/models) and each /metrics scrape may take, whole answer included")
    fail_threshold: int = Field(2, ge=1, description="consecutive failed checks that make a ready replica unready")
    rise_threshold: int = Field(2, ge=1, description="consecutive good checks that bring an ejected replica back")
    metrics_interval_s: float = Field(1.0, gt=0, description="seconds between scrapes of a replica's /metrics")
    max_requests_per_s: float = Field(80.0, gt=0, description="health-check and /metrics requests this router sends "
                                      "per second over the whole fleet, at most: a fleet that would need more at "
                                      "interval_s and metrics_interval_s (3 per replica per second at the defaults) "
                                      "is checked less often, every replica alike (1,024 replicas: every 28 s; "
                                      "past the budget /v1/models is read with every 5th check only); fewer where "
                                      "max_idle_cpu says so")
    max_idle_cpu: float = Field(0.04, gt=0, le=1, description="share of a core the router may spend idle, checking "
                                "and scraping the fleet: what a control request costs is measured while no client "
                                "request is served (0.3-0.7 ms of CPU each, by machine), and a large fleet gets "
                                "this share divided by that many requests a second (at most max_requests_per_s, at "
                                "least 10); /admin/replicas shows the budget under health_checks")
    eject_after: int = Field(5, ge=1, description="requests in a row that fail on a replica (no answer, 5xx, a broken "
                             "or silent stream) take it out of rotation, however its /health answers")
    eject_s: float = Field(30.0, gt=0, description="how long such a replica stays out; doubled each time it is taken "
                           "out again soon after (at most 10 times this)")
    stall_s: float = Field(7.0, gt=0, description="a replica that has answered none of the requests waiting on it "
                           "for this long, while its /metrics show its engine making no progress (accepts requests, "
                           "answers none), is taken out like an ejected one, and the requests waiting on it are sent "
                           "to another replica (out within stall_s plus one metrics_interval_s, on a large fleet too: "
                           "such a replica is scraped at that interval however far apart the control budget spaces "
                           "the others; raise it where an "
                           "engine may compile for longer without counting a token, as Gaudi's lazy mode can on a "
                           "new shape)")
    shared: bool = Field(True, description="with a Redis index: the routers on it share the checks. Each replica "
                         "has one owner among them, which checks and scrapes it at the rates above and publishes "
                         "its verdict; the others check it as many times less often as there are routers and "
                         "take it out of rotation (and back) on the owner's word (see Large fleets)")
    shared_interval_s: float = Field(1.0, gt=0, le=60, description="seconds between a router's rounds on the "
                                     "shared checks: it says it takes part and reads the routers that do and the "
                                     "verdicts that changed; a router silent for 3 of these loses its replicas to "
                                     "the others")
    startup_timeout_s: float = Field(900.0, gt=0, description="a replica not yet ready this long after it was added "
                                     "is reported as failed to start; until then it is starting, not failing (Gaudi "
                                     "warm-ups take up to ~10 minutes)")


class ProxyConfig(_Model):
    connect_timeout_s: float = Field(2.0, gt=0, description="TCP connect timeout to a replica")
    request_timeout_s: float = Field(600.0, gt=0, description="longest wait for a non-streaming response")
    stream_idle_timeout_s: float = Field(60.0, gt=0, description="a stream silent this long is ended with an SSE error "
                                         "event (or continued on another replica, stream_failover)")
    stream_failover: bool = Field(True, description="a stream whose replica breaks it (or falls silent) after it "
                                  "started goes on on another replica: chat and completions with one choice, no "
                                  "logprobs, no structured output; false: it ends with an SSE error event")
    stream_headers_timeout_s: float = Field(15.0, gt=0, description="longest wait for a streaming answer's headers "
                                            "(vLLM sends them as soon as it accepts the request); then another "
                                            "replica is tried")
    max_attempts: int = Field(3, ge=1, le=10, description="replicas tried per request (connection errors, 5xx, 429)")
    retry_backoff_s: float = Field(0.02, ge=0, description="base backoff between attempts (doubles each time, with jitter)")
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024, description="larger request bodies get 413")
    upstream_idle_s: float = Field(4.0, gt=0, description="idle upstream connections are closed after this "
                                   "(keep it below the replicas' keep-alive timeout, 5 s in vLLM)")


class IndexConfig(_Model):
    backend: str = Field("memory", description="memory, or where routers share their state: redis://[USER:PASSWORD@]"
                         "HOST:PORT/DB (rediss:// for TLS, unix:///PATH?db=N); a Redis Cluster is found by itself, "
                         "from one node or several (redis://HOST:PORT,HOST:PORT)")
    namespace: str = Field("kvroute", min_length=1, description="prefix of every Redis key")
    timeout_s: float = Field(0.05, gt=0, description="a Redis call slower than this falls back to the local index")
    retry_after_s: float = Field(1.0, gt=0, description="once Redis looks down, use only the local index this long")
    trip_after: int = Field(3, ge=1, description="timeouts in a row after which Redis counts as down (any other "
                            "error counts at once); a lone timeout only sends that request to the local index")
    default_blocks: int = Field(16384, ge=1, description="KV blocks assumed for a replica whose size is unknown")

    @property
    def background_timeout_s(self) -> float:
        """Limit of Redis calls off the request's path (connects, records, forgets): never under 1 s."""
        return max(1.0, self.timeout_s)

    @field_validator("backend")
    @classmethod
    def _check_backend(cls, v: str) -> str:
        if v != "memory" and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must be 'memory' or a redis:// URL")
        if v != "memory":
            try:
                parse_url(v)
            except ValueError as e:
                raise ValueError(f"not a Redis URL: {e}") from None
        return v


class PrefixConfig(_Model):
    bytes_per_token: float = Field(4, ge=1, le=16, description="in byte mode, the bytes a token counts as until the "
                                   "replicas' answers (usage.prompt_tokens) have taught the model's real figure")
    tokenizer: str | None = Field("auto", description="auto: each model's tokenizer and chat template from this "
                                  "host only (the root folder /v1/models reports, else the Hugging Face cache), "
                                  "byte mode for a model with none; a tokenizer.json or model folder for every "
                                  "model; none: byte mode")
    tokenizers: dict[str, str] = Field(default_factory=dict, description="model name -> tokenizer.json or model "
                                       "folder, for models that need their own")


class KvEventsConfig(_Model):
    """The precise index: replicas' KV-cache events (see docs/routing.md)."""

    enabled: bool = Field(True, description="use the KV-cache events of replicas that publish them (their "
                          "/kv_event_sources, or replicas[].kv_events); others keep the approximate index")
    provisional_ttl_s: float = Field(2.0, gt=0, description="a routing decision holds the prompt's blocks on the "
                                     "chosen replica this long unless its events confirm them first")
    slow_medium_weight: float = Field(0.5, ge=0, le=1, description="how much a block held only on a slower medium "
                                      "(vLLM's CPU offload) counts as cached, against 1 on the device")
    silence_s: float = Field(10.0, gt=0, description="a replica that computed new KV blocks (its /metrics: more than a "
                             "block of prompt tokens per request) over two such silences in a row, yet sent no event "
                             "batch, is reconnected to; one serving only prompts it holds whole publishes nothing "
                             "and is left alone")
    replay_timeout_s: float = Field(2.0, gt=0, description="longest wait for each answer of a replay request")
    lease_s: float = Field(5.0, gt=0, description="with a Redis index, one router consumes each replica's events "
                           "under a lease this long, renewed at a third of it; another takes over within two")


class SharedLoadConfig(_Model):
    enabled: bool = Field(True, description="with a Redis index: every router publishes its requests in flight and "
                          "pending prefill per replica there, and weighs the other routers' as its own (see Large "
                          "fleets); false: the others' load is seen only through the replicas' /metrics")
    interval_s: float = Field(0.1, gt=0, le=10, description="seconds between a router's publications (and reads "
                              "of the others' figures) while its own figures do not change: how stale the picture "
                              "of the other routers' load may be")
    min_interval_s: float = Field(0.01, ge=0, le=10, description="a change of this router's figures (a request "
                                  "placed or finished) is published this soon after the last publication, not an "
                                  "interval_s later, so that the others do not place onto it unawares")
    max_age_s: float = Field(0.02, ge=0, le=10, description="a decision first reads the other routers' figures "
                             "again where they are older than this (beside its prefix lookup, waiting at most "
                             "index.timeout_s), so it sees what they placed since")
    ttl_s: float = Field(3.0, gt=0, le=600, description="a router's figures expire this long after its last "
                         "publication: a router that stops leaves no phantom load for longer")
    claim_min_tokens: int | None = Field(512, ge=0, description="a decision that puts at least this many "
                                         "uncached prompt tokens on a replica, while other routers share the picture, "
                                         "publishes its placement and reads the others' figures there in one round "
                                         "trip before the request is sent, and chooses again where another router "
                                         "placed prefill there unseen (two decisions within the same few "
                                         "milliseconds); null: never")


class CandidatesConfig(_Model):
    """Which replicas a cache-aware decision weighs (see :mod:`router.candidates`)."""

    scan_up_to: int = Field(32, ge=1, description="a model served by at most this many ready replicas is decided "
                            "among all of them; on a larger fleet among those that hold the prompt's prefix, the "
                            "least loaded and a few drawn at random, so a decision costs the same on any fleet")
    holders: int = Field(16, ge=0, description="on a large fleet: replicas weighed that hold the prompt's prefix, "
                         "those of the longest first")
    least_loaded: int = Field(8, ge=0, description="on a large fleet: replicas weighed that have the least load "
                              "for their capacity (a ranking at most ranking_s old)")
    sampled: int = Field(4, ge=0, description="on a large fleet: replicas weighed that are drawn at random")
    ranking_s: float = Field(0.05, gt=0, le=10, description="seconds a ranking of the replicas by load is used "
                             "before it is made again (each decision still reads the live load of those it weighs)")
    ranking_cpu: float = Field(0.01, gt=0, le=1, description="share of a core the rankings may take: where making "
                               "one every ranking_s would take more (a fleet of thousands), it is made less often")


class CacheAwareConfig(_Model):
    """Knobs of the cache-aware cost (see docs/routing.md)."""

    load_weight_tokens: float = Field(32_000, ge=0, description="cost of a replica at full capacity (load term), "
                                      "as the seconds it takes to prefill this many prompt tokens: weighed in "
                                      "the same unit as the cache hits it competes with, on any platform")
    load_weight_s: float | None = Field(None, ge=0, description="seconds of cost for a replica at full capacity, "
                                        "whatever its prefill rate (instead of load_weight_tokens)")
    kv_weight_s: float = Field(0.5, ge=0, description="seconds of cost for a replica whose KV cache is full")
    kv_threshold: float = Field(0.9, ge=0, lt=1, description="KV cache usage below which the KV term is 0; it "
                                "grows linearly to kv_weight_s at full usage")
    session_bonus_s: float = Field(0.05, ge=0, description="cost taken off the replica that served the session last")
    evict_weight: float = Field(3.0, ge=0, description="cost of evicting cached prefixes, per unit of prefill: the "
                                "uncached tokens that do not fit in the free part of a replica's cache (as the "
                                "index sees it) count this many times more, since the prefixes they push out will "
                                "be recomputed later; 0 turns it off")
    occupancy_weight_tokens: float = Field(256, ge=0, description="cost of a replica whose cache the index sees "
                                           "full, as the seconds it takes to prefill this many prompt tokens: new "
                                           "prefixes go where they evict least, and a cached prefix longer than "
                                           "this outweighs it on any platform")
    occupancy_weight_s: float | None = Field(None, ge=0, description="seconds of cost for a replica whose cache the "
                                             "index sees full, whatever its prefill rate (instead of "
                                             "occupancy_weight_tokens)")
    returning_weight: float = Field(1.0, ge=0, description="a conversation waiting at a replica between turns weighs "
                                    "this many requests in flight there (load term), times the share of answered "
                                    "prompts whose next turn came and grew the history by a whole block; 0 turns "
                                    "it off")
    turns_ahead_max: float = Field(8.0, ge=0, description="a prompt that holds no earlier prompt's end (it may "
                                   "start a conversation) weighs each replica's load and waiting conversations "
                                   "(1 + t) times, t the further turns a conversation is expected to send (s / (1 - s), "
                                   "s the share of answered prompts whose next turn came), at most this many: its "
                                   "later turns stay where it starts (recompute_weight) and meet the load there, "
                                   "while a prefix it finds cached there saves prefill once; 0 turns it off")
    recompute_weight: float = Field(10.0, ge=0, description="prompt tokens a replica would compute that another "
                                    "replica holds cached cost this many times more, where the prompt holds the end "
                                    "of an earlier prompt (its own history: a conversation's next turn): computing "
                                    "them again spends prefill the fleet needs for other prompts (at saturation, "
                                    "throughput) and cache space. A prefix many prompts share (a system prompt) is not "
                                    "priced so: a copy on each replica is how they spread (but see "
                                    "prefill_recompute_weight). 0 weighs only this request's own time to first token")
    prefill_recompute_weight: float = Field(1.0, ge=0, description="on a split request's prefill, prompt tokens a "
                                            "replica would compute that another holds cached cost this many times more "
                                            "where the prompt shares that prefix with others (a system prompt): a "
                                            "prefill replica does nothing but prefill, so a copy computed there is "
                                            "time every request queued behind it waits, and a prefix is copied only "
                                            "when its holder's queue outweighs that too (disaggregated benchmark at "
                                            "70% load: hit rate 0.665 and TTFT p90 799-872 ms in eleven runs, against "
                                            "0.624-0.663 and 802-1,526 ms in eleven without). 0 weighs only this "
                                            "request's own time to first token")
    stall_weight: float = Field(0.3, ge=0, description="a prompt computed on a replica holds up each request running "
                                "there (chunked prefill puts its chunks in the steps that decode their tokens): its "
                                "uncached tokens beyond one step (the replica's max_num_batched_tokens) cost this many "
                                "times their prefill per request in flight there, so that long prompts go where few "
                                "streams decode. 0 turns it off")
    kv_read_cost: float = Field(0.0625, ge=0, le=1, description="the decode replica of a split request reads the "
                                "prompt's KV it lacks instead of computing it: a token read costs this share of a "
                                "token computed (1/16, about what a 70B model's 320 KiB per token over a Gaudi 2 "
                                "node's 300 GB/s of scale-out ports takes against its prefill rate), so the one "
                                "holding more of the prompt is preferred")


class ConversationsConfig(_Model):
    """Conversations between turns (see docs/routing.md)."""

    window_s: float = Field(60.0, gt=0, description="an answered prompt's conversation counts as waiting at its replica "
                            "this long, unless its next turn comes first; and a routed prompt's end is kept this long, "
                            "so that a prompt holding it is known as its history's next turn (cache_aware."
                            "recompute_weight)")
    max_tracked: int = Field(100_000, ge=1, description="waiting conversations this router keeps (oldest out), and "
                             "as many routed prompts' ends")


class SessionConfig(_Model):
    ttl_s: float = Field(3600.0, gt=0, description="with a Redis index, a session's replica (and a stored response's) "
                         "is kept in Redis this long after its last request")
    max_local: int = Field(100_000, ge=1, description="sessions (and stored responses' replicas) each router keeps in "
                           "memory (least recently used out); with several workers and no Redis, the slots of the table "
                           "they share")


class StageConfig(BaseModel):
    """A filter, scorer or picker of a policy: its registered name and its parameters."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(..., min_length=1, description="registered name, or module:Class of a plug-in")
    weight: float = Field(1.0, ge=0, description="weight of a scorer's [0, 1] rating in the sum")

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class DisaggregationConfig(_Model):
    """When a request is split into a prefill on one replica and a decode on another (see router.disaggregation)."""

    enabled: bool = Field(True, description="split requests where the fleet has prefill or decode replicas (roles); "
                          "off: every request goes whole to a replica of role both")
    min_uncached_tokens: int = Field(1024, ge=0, description="a request is split when every replica that could take "
                                     "it whole (role both, or decode, which computes what it lacks) would have to "
                                     "prefill at least this many of its prompt tokens (the index's prediction); "
                                     "else it goes whole to the one holding enough (role both first). 0: split "
                                     "every request")
    max_local_tokens: int = Field(128, ge=0, description="a request that is not split goes to a replica of role "
                                  "decode (which computes what it lacks) only when that is fewer than this many "
                                  "tokens: a prefill there stalls every stream it decodes (multi-turn benchmark, 70B "
                                  "on Gaudi 2: 640-token turns taken there put the inter-token latency p99 at 91 ms, "
                                  "split at 19). 0: never")
    transfers: list[str] = Field(default_factory=list, description="platforms able to move KV between them besides "
                                 "a platform to itself, as PREFILL>DECODE (e.g. cuda>gaudi2: vllm-gaudi's "
                                 "heterogeneous disaggregation, prefill on CUDA, decode on Gaudi). A request is split "
                                 "only between replicas of one platform or of a pair listed here")

    @field_validator("transfers")
    @classmethod
    def _check_transfers(cls, v: list[str]) -> list[str]:
        for pair in v:
            prefill, sep, decode = pair.partition(">")
            if not sep or not prefill.strip() or not decode.strip():
                raise ValueError(f"{pair!r}: PREFILL_PLATFORM>DECODE_PLATFORM, e.g. cuda>gaudi2")
            for name in (prefill.strip(), decode.strip()):
                platforms.get(name)  # raises, naming the known ones
        return v

    def pairs(self) -> frozenset[tuple[str, str]]:
        """(prefill platform, decode platform) pairs able to transfer, besides a platform to itself."""
        return frozenset((a.strip(), b.strip()) for a, _, b in (p.partition(">") for p in self.transfers))


class PolicyConfig(_Model):
    """A routing pipeline: filters in order, weighted scorers, a picker."""

    filters: list[str | StageConfig] | None = Field(None, description="filters in order; default: ready, "
                                                     "serves-model, role, transfer-pair, not-drained, not-tried, "
                                                     "meets-slo, below-capacity")
    scorers: list[StageConfig] = Field(default_factory=list, description="scorers and their weights")
    picker: str | StageConfig = Field("max-score", description="max-score or round-robin")


class QueueConfig(_Model):
    max_size: int = Field(1024, ge=0, description="requests that may wait when every replica is at capacity")
    timeout_s: float = Field(30.0, ge=0, description="longest wait in the queue before 429")
    reserve_window_s: float = Field(30.0, gt=0, description="a class that had requests in flight in this many "
                                    "seconds gets free slots kept for it: less urgent classes leave free what it "
                                    "may still need (its most in flight in that time, less what it has now)")
    reserve_margin: float = Field(0.5, ge=0, le=10, description="and this share of that most, more (for arrivals "
                                  "beyond it); 0 keeps only the difference")
    reserve_max_share: float = Field(0.25, ge=0, le=1, description="at most this share of the slots is ever kept "
                                     "for more urgent classes; 0 keeps none")


class PredictionConfig(_Model):
    """The predicted time to first token against the measured one (see docs/routing.md#predicted-times)."""

    correct: bool = Field(True, description="predict each replica's times to first token on a line fitted to its "
                          "measured ones (a fixed part, and the model's prefill by a slope): latency targets and "
                          "queue waits use these corrected times, the cost weighs the model's prefill as it is; "
                          "false only measures")
    window: int = Field(200, ge=2, le=100_000, description="streamed answers the fitted line and the reported error "
                        "average over, about (per replica, and per kind of replica)")
    min_samples: int = Field(20, ge=1, le=100_000, description="streamed answers a replica gives before its own line "
                             "is used (before that, its kind's, once the replicas of its kind gave as many)")


class SloConfig(_Model):
    """Latency targets a request may carry (x-slo-ttft-ms, x-slo-tpot-ms: see docs/api.md#latency-targets)."""

    on_miss: Literal["reject", "route"] = Field("reject", description="when no replica is predicted to meet a "
                                                "request's target: reject answers 503 slo_unattainable at once (and "
                                                "a request that waits in the queue past the time its target "
                                                "leaves); route sends it to the best replica anyway")


class AuthConfig(_Model):
    api_keys: list[SecretStr] = Field(default_factory=list, description="client bearer keys; empty = no client auth")
    admin_key: SecretStr | None = Field(None, description="bearer key for /admin; unset = /admin from loopback only")


class ClientConfig(_Model):
    header_timeout_s: float = Field(10.0, gt=0, description="a client's request line and headers must arrive within "
                                    "this long (from its connection, or from the first byte of its next request); "
                                    "else 408 and the connection is closed")
    max_header_bytes: int = Field(64 * 1024, ge=1024, description="request line and headers together; larger: 431 "
                                  "and the connection is closed")
    body_timeout_s: float = Field(30.0, gt=0, description="longest pause while a request body arrives; then 408")
    body_total_timeout_s: float = Field(120.0, gt=0, description="a whole request body must arrive within this long "
                                        "(a client dripping a byte now and then holds a connection no longer); then "
                                        "408")
    send_timeout_s: float = Field(60.0, gt=0, description="a client that takes none of its answer's bytes for this "
                                  "long (it stopped reading) is disconnected, and the replica's request aborted")
    max_connections: int | None = Field(None, ge=1, description="client connections open at once; one more is "
                                        "closed at once. Default: 80% of the process's file-descriptor limit")
    max_connections_per_address: int | None = Field(None, ge=1, description="client connections open at once from "
                                                    "one address; one more is closed at once. Default: half of "
                                                    "client.max_connections (behind a load balancer every client "
                                                    "shares its address: raise it to client.max_connections)")


class MembershipConfig(_Model):
    max_replicas: int = Field(16384, ge=1, le=65536, description="replicas this router holds at once, configured "
                              "and added at run time (POST /admin/replicas, replicas_file, other routers through "
                              "Redis): a bound against runaway registrations, not a size to plan (tables that "
                              "workers share are sized for it; their memory is used only as replicas join)")
    sync_interval_s: float = Field(2.0, gt=0, description="seconds between reads of replicas_file and, with a Redis "
                                   "index, of the replicas registered through any router")
    drain_timeout_s: float = Field(600.0, ge=0, description="a replica being removed takes no new requests and is "
                                   "removed when its last one ends, or after this long")


class TracingConfig(_Model):
    """OpenTelemetry spans for each request (see docs/operations.md#tracing); off unless an endpoint is set."""

    otlp_endpoint: str | None = Field(None, description="OTLP/HTTP traces endpoint, e.g. "
                                      "http://collector:4318/v1/traces. Unset: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, "
                                      "else OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces, else no tracing (no cost). "
                                      "Headers (auth), certificates and timeouts come from the standard OTEL_EXPORTER_"
                                      "OTLP_* variables; needs pip install 'kvroute[tracing]'")
    sample_ratio: float = Field(1.0, ge=0, le=1, description="share of requests traced that come without a "
                                "traceparent; one with a traceparent is traced if its sampled flag is set")
    service_name: str = Field("kvroute", min_length=1, max_length=128, description="service.name of the spans")

    @field_validator("otlp_endpoint")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        return v


class LogConfig(_Model):
    level: Literal["debug", "info", "warning", "error"] = Field("info", description="debug, info, warning or error")
    json_format: bool = Field(False, alias="json", description="one JSON object per line")

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True)


# The named policies: every other module reads them from here.
PRESETS: dict[str, PolicyConfig] = {
    # costs within about a millisecond (0.1% of 1 + cost seconds) are ties: an index's occupancy differing by
    # a block or two should not decide where a cold prompt goes, taking turns should
    "cache-aware": PolicyConfig(scorers=[StageConfig(name="predicted-ttft")],
                                picker=StageConfig(name="max-score", tie_tolerance=0.001)),
    "least-loaded": PolicyConfig(scorers=[StageConfig(name="load"), StageConfig(name="session")]),
    "round-robin": PolicyConfig(scorers=[StageConfig(name="session")], picker="round-robin"),
}
POLICIES = tuple(PRESETS)


class RouterConfig(_Model):
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on")
    policy: str | PolicyConfig = Field("cache-aware", description="routing policy: a preset (" + ", ".join(POLICIES)
                                       + ") or {filters, scorers, picker} (see Routing)")
    workers: int = Field(1, ge=1, le=64, description="worker processes sharing the port; more than 1 needs a Redis "
                         "index with a cache-aware policy")
    replicas: list[ReplicaConfig] = Field(default_factory=list)
    health: HealthConfig = Field(default_factory=HealthConfig)
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)
    queue: QueueConfig = Field(default_factory=QueueConfig)
    index: IndexConfig = Field(default_factory=IndexConfig)
    prefix: PrefixConfig = Field(default_factory=PrefixConfig)
    kv_events: KvEventsConfig = Field(default_factory=KvEventsConfig)
    cache_aware: CacheAwareConfig = Field(default_factory=CacheAwareConfig)
    prediction: PredictionConfig = Field(default_factory=PredictionConfig)
    slo: SloConfig = Field(default_factory=SloConfig)
    candidates: CandidatesConfig = Field(default_factory=CandidatesConfig)
    shared_load: SharedLoadConfig = Field(default_factory=SharedLoadConfig)
    conversations: ConversationsConfig = Field(default_factory=ConversationsConfig)
    disaggregation: DisaggregationConfig = Field(default_factory=DisaggregationConfig)
    sessions: SessionConfig = Field(default_factory=SessionConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    tenants: list[TenantConfig] = Field(default_factory=list, description="the clients sharing the fleet, each with "
                                        "its keys, class, weight and limits (also set at run time: /admin/tenants)")
    tenancy: TenancyConfig = Field(default_factory=TenancyConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    shutdown_grace_s: float = Field(30.0, ge=0, description="on SIGTERM, how long in-flight streams may finish")
    shutdown_unready_s: float | None = Field(None, ge=0, description="on SIGTERM, how long /ready answers 503 while "
                                             "requests are still served, before the listener closes; default: two "
                                             "of the intervals at which something polls /ready (a load balancer), "
                                             "at most 30 s, or 0 if nothing polls it")
    replicas_file: str | None = Field(None, description="a YAML or JSON file listing more replicas (the fields of "
                                      "replicas[]), read again when it changes: added ones join, missing ones drain")
    membership: MembershipConfig = Field(default_factory=MembershipConfig)
    client: ClientConfig = Field(default_factory=ClientConfig)

    @field_validator("policy")
    @classmethod
    def _check_policy(cls, v: str | PolicyConfig) -> str | PolicyConfig:
        if isinstance(v, str) and v not in POLICIES:
            raise ValueError(f"unknown policy {v!r}; choose one of: {', '.join(POLICIES)}")
        return v

    @model_validator(mode="after")
    def _unique_names(self) -> "RouterConfig":
        seen: set[str] = set()
        for r in self.replicas:
            if r.name in seen:
                raise ValueError(f"replica name {r.name!r} is used twice")
            seen.add(r.name)
        if len(self.replicas) > self.membership.max_replicas:
            raise ValueError(f"{len(self.replicas)} replicas configured, membership.max_replicas is "
                             f"{self.membership.max_replicas}")
        check_tenants(self.tenants)
        return self
