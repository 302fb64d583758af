"""One replica's entry: ``replicas[]`` in the configuration, an admin registration, a ``replicas_file`` item."""

from __future__ import annotations

import re
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator

from .. import platforms
from .fields import ConfigError, _Model, format_validation_error, mask_url

_NAME = re.compile(r"[A-Za-z0-9._:@+-]{1,128}")


class ReplicaConfig(_Model):
    """One vLLM replica (one engine, possibly spanning a tensor/pipeline-parallel group)."""

    name: str = Field("", max_length=128, description="unique name, of letters, digits and . _ - : @ + (it appears "
                      "in URLs, metric labels and logs); defaults to host:port of the url")
    url: str = Field(..., description="base URL of the replica's OpenAI server, e.g. http://10.0.0.5:8000")
    models: list[str] = Field(default_factory=list, description="served model names; empty = discover from /v1/models")
    platform: str = Field("cuda", description="what it runs on: " + ", ".join(platforms.names()) + " (router/platforms.py)")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="devices in the replica's tensor-parallel group")
    pipeline_parallel_size: int = Field(1, ge=1, le=64, description="pipeline stages (nodes) of the replica")
    max_num_seqs: int = Field(256, ge=1, le=65536, description="vLLM's --max-num-seqs: the most requests kept in flight on it")
    max_num_batched_tokens: int = Field(2048, ge=1, le=16_777_216, description="vLLM's --max-num-batched-tokens: prompt tokens one "
                                        "scheduler step takes; queued prefill beyond a step delays a new request "
                                        "at the prefill rate, within it by what its tokens add to a step")
    speed: float | None = Field(None, gt=0, le=1e6, description="relative throughput; default: device_speed(platform) x TP x PP")
    api_key: SecretStr | None = Field(None, description="bearer token sent to this replica")
    block_size: int | None = Field(None, ge=1, le=65536, description="KV block size in tokens; default: from the replica's "
                                   "/metrics, else the platform's (128 Gaudi and CPU, 64 XPU, 16 CUDA)")
    num_gpu_blocks: int | None = Field(None, ge=1, le=2**31, description="KV cache size in blocks; default: from /metrics, "
                                       "else index.default_blocks")
    prefill_tokens_per_s: float | None = Field(None, gt=0, le=1e9, description="prompt tokens per second; default: "
                                               "learned from the replica's /metrics (uncached prompt tokens over "
                                               "vllm:request_prefill_time_seconds), until then the platform's "
                                               "per-device rate x TP x PP")
    kv_events: str | None = Field(None, description="the replica's KV-cache event publisher (tcp://HOST:PORT); "
                                  "default: what its /kv_event_sources says; off: none (approximate index)")
    kv_events_replay: str | None = Field(None, description="its replay endpoint (tcp://HOST:PORT), with kv_events")
    data_parallel_size: int = Field(1, ge=1, le=64, description="data-parallel ranks behind the URL; with kv_events "
                                    "each rank publishes on the next port")
    role: Literal["both", "prefill", "decode"] = Field("both", description="what it does in a disaggregated fleet: "
                                                       "both (whole requests, and either phase of a split one), prefill "
                                                       "or decode only (started with a KV connector, e.g. vLLM's "
                                                       "NixlConnector; see Disaggregated prefill and decode)")
    priority_scheduling: bool = Field(False, description="it runs vLLM's --scheduling-policy priority: each request "
                                      "it gets carries its tenant's class as vLLM's priority (interactive 0, standard "
                                      "1, batch 2; a client's own is replaced)")

    @field_validator("kv_events", "kv_events_replay")
    @classmethod
    def _check_endpoint(cls, v: str | None) -> str | None:
        if v is None or v == "off":
            return v
        parts = urlsplit(v)
        if parts.scheme not in ("tcp", "ipc") or (parts.scheme == "tcp" and (not parts.hostname or not parts.port)):
            raise ValueError("must be tcp://HOST:PORT, ipc://PATH or off")
        return v

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        if parts.query or parts.fragment:
            raise ValueError("must not carry a query or fragment")
        return v.rstrip("/")

    @field_validator("api_key")
    @classmethod
    def _check_api_key(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None:
            key = v.get_secret_value()
            if not key or not key.isascii() or not key.isprintable():
                raise ValueError("must be printable ASCII (it goes into an HTTP header)")
        return v

    @field_validator("platform")
    @classmethod
    def _check_platform(cls, v: str) -> str:
        platforms.get(v)  # raises, naming the known ones
        return v

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if v and not _NAME.fullmatch(v):
            raise ValueError("may hold only letters, digits and . _ - : @ +")
        return v

    @model_validator(mode="after")
    def _default_name(self) -> "ReplicaConfig":
        if not self.name:
            parts = urlsplit(self.url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            object.__setattr__(self, "name", f"{parts.hostname}:{port}")
        return self

    @property
    def shown_url(self) -> str:
        """The URL with any password in it masked (for logs and the admin API)."""
        return mask_url(self.url)

    @property
    def relative_speed(self) -> float:
        if self.speed is not None:
            return self.speed
        return platforms.get(self.platform).device_speed * self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def prefill_rate(self) -> float:
        if self.prefill_tokens_per_s is not None:
            return self.prefill_tokens_per_s
        p = platforms.get(self.platform)
        return p.prefill_tokens_per_s * self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def capacity(self) -> float:
        """Load normaliser: grows with the batch limit and with the parallel group's speed."""
        return self.max_num_seqs * self.relative_speed


def replica_from(data: Any, where: str) -> ReplicaConfig:
    """One replica entry (an admin request's body, a replicas_file item), checked like the configuration's;
    the error names each invalid field under ``where``."""
    if not isinstance(data, dict):
        raise ConfigError(f"invalid replica:\n  {where}: expected an object with url and the replicas[] fields")
    try:
        return ReplicaConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, "invalid replica", where, longest=80)) from None


def parse_replica_spec(spec: str) -> dict[str, Any]:
    """``URL`` or ``NAME=URL``, as accepted by ``--replica`` and ``KVROUTE_REPLICAS``."""
    spec = spec.strip()
    name, sep, url = spec.partition("=")
    if sep and "://" not in name:
        return {"name": name, "url": url}
    return {"url": spec}
