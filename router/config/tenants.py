"""Tenants: who a request is for (``tenants[]``), and how requests are told apart and ordered (``tenancy``)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, SecretStr, ValidationError, field_validator

from .fields import ConfigError, _Model, format_validation_error

# The priority classes, most urgent first: the router queue serves a class before the next, and a full queue
# sheds the least urgent first. vLLM's ``priority`` (lower is served earlier) is the class's place here.
CLASSES: tuple[str, ...] = ("interactive", "standard", "batch")
TenantClass = Literal["interactive", "standard", "batch"]
DEFAULT_TENANT = "default"
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


class TenantConfig(_Model):
    """One tenant: the keys that identify it, its class and weight, and its limits (none by default)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)

    name: str = Field(..., description="unique name, of letters, digits and . _ - (a metric label)")
    keys: list[SecretStr] = Field(default_factory=list, description="client bearer keys that identify it (accepted "
                                  "as client keys beside auth.api_keys); with none, any client may name it in "
                                  "tenancy.header")
    klass: TenantClass = Field("standard", alias="class", description="priority class: " + ", ".join(CLASSES) +
                               " (the queue serves each class before the next; a full queue sheds the last first)")
    weight: float = Field(1.0, gt=0, le=1000, description="its share against the other tenants of its class when "
                          "they wait: served tokens follow the weights")
    requests_per_minute: float | None = Field(None, gt=0, le=1e9, description="requests it may start per minute, "
                                              "across every router on the shared store; more: 429 with Retry-After")
    tokens_per_minute: float | None = Field(None, gt=0, le=1e12, description="prompt plus completion tokens it may "
                                            "use per minute, across every router on the shared store (a request "
                                            "starts while any remain; its tokens are counted as they are known)")
    max_concurrent: int | None = Field(None, ge=1, le=1_000_000, description="requests it may have in flight at "
                                       "once, across every router sharing the load picture")
    burst_s: float = Field(5.0, gt=0, le=3600, description="seconds of its rates it may spend at once (the size of "
                           "its token buckets)")

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if not _NAME.fullmatch(v):
            raise ValueError("must be 1 to 64 letters, digits and . _ -")
        return v

    @field_validator("keys")
    @classmethod
    def _check_keys(cls, v: list[SecretStr]) -> list[SecretStr]:
        for key in v:
            if not key.get_secret_value():
                raise ValueError("a key may not be empty")
        return v

    @property
    def limited(self) -> bool:
        """Whether it has a rate limit (the shared buckets are asked for its requests only then)."""
        return self.requests_per_minute is not None or self.tokens_per_minute is not None

    def shown(self) -> dict[str, Any]:
        """Its settings without its keys (how many it has instead), for the admin API."""
        out = self.model_dump(by_alias=True, exclude={"keys"})
        out["keys"] = len(self.keys)
        return out


class TenancyConfig(_Model):
    header: str | None = Field("x-kvroute-tenant", description="request header naming the tenant a request is for: "
                               "one of its key's tenants, or one without keys (unknown or not allowed: 403). Unset: "
                               "the key alone decides")
    default_class: TenantClass = Field("standard", description="class of requests that name no tenant (the "
                                       "'default' tenant, unless tenants[] defines it)")
    fair_share_window_s: float = Field(30.0, gt=0, le=3600, description="how long the tokens a tenant was served "
                                       "count against it in the queue's fair share (a time constant: they weigh "
                                       "e^-1 as much this long after)")
    output_tokens: int = Field(256, ge=1, le=1_000_000, description="completion tokens a request is expected to use "
                               "where its max_tokens does not say: its cost in the fair queue, with its prompt")

    @field_validator("header")
    @classmethod
    def _check_header(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9-]{1,64}", v):
            raise ValueError("must be a header name of letters, digits and -")
        return v.lower() if v else None


def check_tenants(tenants: list[TenantConfig]) -> None:
    """Each name once (raises ValueError). A key may identify several tenants: the header picks among them, the
    first listed is the one a request that names none is for."""
    seen: set[str] = set()
    for t in tenants:
        if t.name in seen:
            raise ValueError(f"tenant {t.name!r} is defined twice")
        seen.add(t.name)


def tenant_from(data: Any, where: str) -> TenantConfig:
    """One tenant entry from an admin request's body, checked like the configuration's."""
    if not isinstance(data, dict):
        raise ConfigError(f"invalid tenant:\n  {where}: expected an object with the tenants[] fields")
    try:
        return TenantConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, "invalid tenant", where, longest=80)) from None
