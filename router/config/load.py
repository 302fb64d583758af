"""Loading the configuration: YAML file < environment < flags, validated once; and its reference table."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import yaml
from pydantic import BaseModel, ValidationError

from .fields import ConfigError, format_validation_error
from .replica import ReplicaConfig, parse_replica_spec
from .tenants import TenantConfig
from .sections import RouterConfig


def _deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


_LIST_FIELDS = {("auth", "api_keys")}


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """Map ``KVROUTE_*`` variables onto the nested config dict."""
    out: dict[str, Any] = {}
    for key, value in environ.items():
        if not key.startswith("KVROUTE_"):
            continue
        path = tuple(p.lower() for p in key[len("KVROUTE_"):].split("__"))
        if path == ("config",):
            continue
        if path == ("replicas",):
            out["replicas"] = [parse_replica_spec(s) for s in value.split(",") if s.strip()]
            continue
        if path == ("api_keys",) or path == ("admin_key",):  # short forms
            path = ("auth",) + path
        parsed: Any = [s for s in value.split(",") if s] if path in _LIST_FIELDS else value
        node = out
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = parsed
    return out


def set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value


def load_config(
    path: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> RouterConfig:
    """Build the configuration from a YAML file, the environment and flag overrides."""
    environ = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    path = path or environ.get("KVROUTE_CONFIG")
    if path:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        try:
            loaded = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: the top level must be a mapping")
        data = loaded
    data = _deep_merge(data, env_overrides(environ))
    if overrides:
        data = _deep_merge(data, overrides)
    try:
        return RouterConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None


def reference() -> str:
    """The configuration reference (field, default, meaning), generated from the models."""
    rows: list[str] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            key = field.alias or name
            ann = field.annotation
            sub = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
            if sub is not None:
                walk(sub, f"{prefix}{key}.")
                continue
            if name == "replicas":
                walk(ReplicaConfig, f"{prefix}replicas[].")
                continue
            if name == "tenants":
                walk(TenantConfig, f"{prefix}tenants[].")
                continue
            default = field.get_default(call_default_factory=True)
            shown = "required" if field.is_required() else f"`{json.dumps(default)}`"
            rows.append(f"| `{prefix}{key}` | {shown} | {field.description or ''} |")

    walk(RouterConfig, "")
    return "| field | default | meaning |\n|---|---|---|\n" + "\n".join(rows)
