"""The accelerators replicas run on: one entry per platform, and everything else derived from it.

A platform says what vLLM does there and what the router may assume until a replica says otherwise: its KV
block size (vLLM's default on that device; the replica's ``/metrics`` win once scraped), one device's relative
speed and prompt throughput (the guesses the cost model scales by the parallel group until the replica's own
figures come in), the memory ``kvroute plan`` sizes replicas with, and the environment and flags that start
``vllm serve`` on it. The configuration's platform names, the CLI's choices, the planner, the recipes and
the simulator's profiles read this table; an unknown name is an error naming the known ones.

Adding a platform is one :func:`register` call with its :class:`Platform` (a test does it with a made-up one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

GB = 1e9
GIB = 1 << 30


@dataclass(frozen=True)
class Launch:
    """What one replica's ``vllm serve`` depends on beyond the platform (for :attr:`Platform.launch`)."""

    index: int  # the replica's place on its node: 0, 1, ...
    tp: int
    max_num_seqs: int
    num_gpu_blocks: int
    max_model_len: int
    block_size: int
    dtype: str  # bf16 or fp8
    kv_cache_space_gib: float  # cpu only


@dataclass(frozen=True)
class Platform:
    name: str
    block_size: int  # vLLM's KV block size there, in tokens, when --block-size is not given
    device_speed: float  # relative throughput of one device (one Gaudi 2 card = 1.0); only ratios matter
    prefill_tokens_per_s: float  # one device's prompt throughput for a ~8B model (until /metrics say)
    memory_bytes: float  # per device (a card, a PVC tile); for cpu the default KV space
    devices_per_node: int
    tp_sizes: tuple[int, ...]
    reserve_bytes: float  # per device: activations, graphs, runtime (vLLM measures it at start-up)
    launch: Callable[[Launch], tuple[dict[str, str], list[str]]]  # environment and extra flags of vllm serve
    fp8: bool = True
    accelerator: bool = True  # --gpu-memory-utilization and --dtype apply; without, the KV space is a setting
    block_multiple: int = 1  # --block-size must be a multiple of this
    node_devices_for_tp: dict[int, int] = field(default_factory=dict)  # devices a node gives replicas of that TP
    # where vLLM's NixlConnector keeps the KV it sends and reads (kv_buffer_device): the device itself, where
    # NIXL reaches its memory (Gaudi: the gaudi_gdr transport of Intel's UCX; PVC: UCX's ze_copy), else "cpu"
    kv_buffer_device: str = "cpu"
    source: str = ""


PLATFORMS: dict[str, Platform] = {}


class UnknownPlatform(ValueError):
    pass


def register(platform: Platform) -> Platform:
    """Make ``platform`` known to the configuration, the planner and the simulator (replaces one of that name)."""
    PLATFORMS[platform.name] = platform
    return platform


def get(name: str) -> Platform:
    try:
        return PLATFORMS[name]
    except KeyError:
        raise UnknownPlatform(f"unknown platform {name!r}: one of {', '.join(PLATFORMS)}") from None


def names() -> list[str]:
    return list(PLATFORMS)


def _devices(first: int, tp: int) -> str:
    return ",".join(str(d) for d in range(first, first + tp))


def _tile_mask(first: int, tp: int) -> str:
    """ZE_AFFINITY_MASK for tiles first..first+tp-1 of a node (GPU.tile, two tiles per GPU)."""
    return ",".join(f"{d // 2}.{d % 2}" for d in range(first, first + tp))


def _gaudi(r: Launch) -> tuple[dict[str, str], list[str]]:
    blocks_per_seq = -(-r.max_model_len // r.block_size)
    env = {"PT_HPU_RECIPE_CACHE_CONFIG": f"/data/recipe_cache/tp{r.tp},False,16384",
           "VLLM_DECODE_BS_BUCKET_MAX": str(r.max_num_seqs),
           "VLLM_DECODE_BLOCK_BUCKET_MAX": str(min(r.num_gpu_blocks, r.max_num_seqs * blocks_per_seq)),
           "HABANA_VISIBLE_MODULES": _devices(r.index * r.tp, r.tp)}
    argv: list[str] = []
    if r.dtype == "fp8":
        env["QUANT_CONFIG"] = "/data/quant/maxabs_quant.json"
        argv += ["--quantization", "inc"]  # Intel Neural Compressor, with the measured scales in QUANT_CONFIG
    return env, argv


def _aurora(r: Launch) -> tuple[dict[str, str], list[str]]:
    env = {"ZE_AFFINITY_MASK": _tile_mask(r.index * r.tp, r.tp), "VLLM_HOST_IP": "$(hostname -i)"}
    return env, (["--distributed-executor-backend", "mp"] if r.tp > 1 else [])


def _cuda(r: Launch) -> tuple[dict[str, str], list[str]]:
    return {"CUDA_VISIBLE_DEVICES": _devices(r.index * r.tp, r.tp)}, (
        ["--quantization", "fp8"] if r.dtype == "fp8" else [])


def _cpu(r: Launch) -> tuple[dict[str, str], list[str]]:
    return {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": f"{r.kv_cache_space_gib:g}"}, []


register(Platform("gaudi2", 128, 1.0, 8000, 96 * GB, 8, (1, 2, 4, 8), 4 * GB, _gaudi, kv_buffer_device="hpu",
                  source="Gaudi 2: 96 GB HBM per card, 8 cards per node"))
register(Platform("gaudi3", 128, 1.8, 14000, 128 * GB, 8, (1, 2, 4, 8), 4 * GB, _gaudi, kv_buffer_device="hpu",
                  source="Gaudi 3: 128 GB HBM per card, 8 cards per node"))
# Block size 64: vLLM's XPU platform sets it when --block-size is not given (its paged attention and chunked
# prefill work in blocks of 64), and the Aurora recipes pass 64. One tile is one device.
register(Platform("aurora-pvc", 64, 0.5, 4000, 64 * GIB, 12, (1, 2, 4, 8), 2 * GIB, _aurora, fp8=False,
                  kv_buffer_device="xpu",
                  node_devices_for_tp={8: 8},
                  source="Aurora: 6 PVC GPUs x 2 tiles = 12 tiles of 64 GiB per node; TP 8 uses 8 tiles "
                         "(the Ray set-up); no FP8 on PVC"))
register(Platform("cuda", 16, 1.0, 8000, 80 * GB, 8, (1, 2, 4, 8), 2 * GB, _cuda, kv_buffer_device="cuda",
                  source="CUDA: 80 GB per GPU, 8 GPUs per node (override with --device-memory-gb)"))
register(Platform("cpu", 128, 0.02, 200, 4 * GIB, 1, (1,), 0.0, _cpu, accelerator=False, block_multiple=32,
                  source="CPU: the KV cache is VLLM_CPU_KVCACHE_SPACE (--kv-cache-space-gib)"))
