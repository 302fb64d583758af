"""The gateway's one configuration object.

Sources, later ones winning: built-in defaults < YAML file (``--config``) < environment
(``KVROUTE_*``) < command-line flags. Every value is validated once, at start-up, and an
invalid one stops the gateway with a message naming the field.

Environment variables map onto fields by name: ``KVROUTE_PORT`` is ``port``,
``KVROUTE_PROXY__STREAM_IDLE_TIMEOUT_S`` is ``proxy.stream_idle_timeout_s``. List fields take
comma-separated values; ``KVROUTE_REPLICAS`` takes ``URL`` or ``NAME=URL`` items.
"""

from .fields import ConfigError, mask_url
from .load import env_overrides, load_config, reference, set_path
from .replica import ReplicaConfig, parse_replica_spec, replica_from
from .sections import (POLICIES, PRESETS, AuthConfig, CacheAwareConfig, CandidatesConfig, ClientConfig,
                       ConversationsConfig, DisaggregationConfig, HealthConfig, IndexConfig, KvEventsConfig, LogConfig, MembershipConfig,
                       PolicyConfig, PredictionConfig, PrefixConfig, ProxyConfig, QueueConfig, RouterConfig,
                       SessionConfig, SharedLoadConfig, SloConfig, StageConfig, TracingConfig)
from .tenants import TenancyConfig, TenantConfig

__all__ = ["POLICIES", "PRESETS", "AuthConfig", "CacheAwareConfig", "CandidatesConfig", "ClientConfig", "ConfigError",
           "ConversationsConfig", "DisaggregationConfig", "HealthConfig", "IndexConfig", "KvEventsConfig", "LogConfig", "MembershipConfig",
           "PolicyConfig", "PredictionConfig", "PrefixConfig", "ProxyConfig", "QueueConfig", "ReplicaConfig", "RouterConfig",
           "SessionConfig", "SharedLoadConfig", "SloConfig", "StageConfig", "TracingConfig", "TenancyConfig", "TenantConfig", "env_overrides", "load_config", "mask_url",
           "parse_replica_spec", "reference", "replica_from", "set_path"]
