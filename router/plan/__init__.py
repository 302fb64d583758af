"""Capacity planning: from a model's ``config.json`` and a platform, the replicas to run (``kvroute plan``).

For each tensor-parallel size that divides the model's attention heads, one replica's memory is
split as vLLM splits it: every device gives ``memory x gpu_memory_utilization``; the weights (their
share of them), a reserve for activations and graphs, and the rest holds KV blocks. vLLM sizes its
cache per device and every device holds the same blocks, so::

    KV bytes per token per device = layers x 2 x ceil(KV heads / TP) x head dim x bytes per element
    num_gpu_blocks = floor(KV memory per device / (block size x KV bytes per token per device))

with MLA models (DeepSeek) caching one latent of ``kv_lora_rank + qk_rope_head_dim`` per layer on
every device, and sliding-window layers holding at most their window of each sequence. On the CPU
the KV space is set outright (``VLLM_CPU_KVCACHE_SPACE``) and nothing else is taken from it.

Nothing is downloaded: the model is a local ``config.json`` or a folder holding one (and, when
there, ``model.safetensors.index.json`` or ``*.safetensors`` headers for the exact weight size).
"""

from .fit import Option, Plan, Target, plan
from .model import ModelShape, PlanError, kv_bytes, parameters, read_config, shape_of, weights
from .output import as_dict, kvroute_config, roles, serve_commands, shell, table

__all__ = ["ModelShape", "Option", "Plan", "PlanError", "Target", "as_dict", "kv_bytes", "kvroute_config",
           "parameters", "plan", "read_config", "roles", "serve_commands", "shape_of", "shell", "table", "weights"]
