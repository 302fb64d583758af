"""A policy from the configuration: a preset's name (:data:`~router.config.PRESETS`), or
``{filters, scorers, picker}`` with each stage by name (a plug-in as ``module:Class``) and its parameters."""

from __future__ import annotations

import importlib
from typing import Any

from pydantic import ValidationError

from ..config import POLICIES, PRESETS, CacheAwareConfig, ConfigError, PolicyConfig, StageConfig
from .decision import Policy
from .stages import FILTERS, PICKERS, SCORERS, Filter, Picker, Scorer, Stage


def _resolve(table: dict[str, Any], base: type[Stage], what: str, field: str, name: str) -> type[Stage]:
    cls = table.get(name)
    if cls is not None:
        return cls
    if ":" in name:  # a plug-in: module:Class
        module, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"invalid configuration:\n  {field}: cannot load {what} {name!r}: {e}") from None
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ConfigError(f"invalid configuration:\n  {field}: {name!r} is not a {what} "
                              f"(subclass router.policy.{base.__name__})")
        return cls
    known = ", ".join(sorted(table))
    raise ConfigError(f"invalid configuration:\n  {field}: unknown {what} {name!r}; known: {known}, "
                      "or module:Class for a plug-in")


def _build(table: dict[str, Any], base: type[Stage], what: str, field: str, spec: str | StageConfig,
           defaults: dict[str, dict[str, Any]]) -> Any:
    if isinstance(spec, str):
        spec = StageConfig(name=spec)
    cls = _resolve(table, base, what, f"{field}.name", spec.name)
    params = spec.params
    if cls.Params is None:
        if params:
            raise ConfigError(f"invalid configuration:\n  {field}: {what} {spec.name!r} takes no parameters "
                              f"(got {', '.join(sorted(params))})")
        return cls()
    try:
        return cls(cls.Params.model_validate({**defaults.get(cls.name, {}), **params}))
    except ValidationError as e:
        lines = [f"  {field}.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()]
        raise ConfigError("invalid configuration:\n" + "\n".join(lines)) from None


def build_policy(spec: str | PolicyConfig = "cache-aware", cache_aware: CacheAwareConfig | None = None) -> Policy:
    """A preset by name, or a pipeline from ``{filters, scorers, picker}``.

    Raises :class:`~router.config.ConfigError` naming the field of an unknown stage or a bad parameter.
    """
    name = spec if isinstance(spec, str) else "custom"
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ConfigError(f"invalid configuration:\n  policy: unknown policy {spec!r}; "
                              f"choose one of: {', '.join(POLICIES)}")
        spec = PRESETS[spec]
    defaults = {"predicted-ttft": (cache_aware or CacheAwareConfig()).model_dump()}
    filters = None if spec.filters is None else [
        _build(FILTERS, Filter, "filter", f"policy.filters.{i}", f, defaults) for i, f in enumerate(spec.filters)]
    scorers = [(_build(SCORERS, Scorer, "scorer", f"policy.scorers.{i}", s, defaults), s.weight)
               for i, s in enumerate(spec.scorers)]
    picker = _build(PICKERS, Picker, "picker", "policy.picker", spec.picker, defaults)
    return Policy(name, scorers, picker, filters)
