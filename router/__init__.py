"""kvroute: a KV-cache-aware routing gateway for vLLM replicas."""

__version__ = "0.1.0"
