"""Platform profiles for the simulated engine: KV cache size and step times of one replica, derived.

A profile is a model on a device group. Its figures are computed here, not typed in, from:

- the model's shape (public model cards): parameters, layers, KV heads, head size;
- the device's datasheet figures: memory per device, memory bandwidth, dense BF16 throughput;
- two efficiencies, stated as assumptions: the share of peak compute a prefill reaches (MFU) and
  the share of peak bandwidth a decode step reaches.

Per replica of ``tp`` devices, with weights and KV cache in BF16 (2 bytes per element):

- KV bytes per token = layers x 2 x KV heads x head size x 2;
- KV blocks = (tp x memory x gpu_memory_utilization - weights - activation reserve) / (KV bytes per
  token x block size);
- prefill seconds per token = 2 x parameters / (tp x peak FLOP/s x MFU);
- a decode step reads all weights once: base seconds = weights / (tp x bandwidth x efficiency) + a fixed
  launch overhead; each decoding sequence reads its context's KV: seconds per context token = KV bytes
  per token / (tp x bandwidth x efficiency);
- per decoding sequence a small fixed cost (sampling, scheduling).

``cpu`` is different: it stands for the tiny model on this machine's real vLLM CPU replicas, and its
step times are measured against them (see ``loadtest/bench_vllm.py``), not derived.
"""

from __future__ import annotations

from dataclasses import dataclass

from router import platforms

from .engine import StepCost


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def weight_bytes(self) -> float:
        return self.params * 2  # BF16

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * 2


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: float
    bandwidth: float  # bytes/s
    bf16_flops: float  # dense, per second
    source: str
    link_bytes_per_s: float = 0.0  # scale-out network per device, for KV transfers between replicas


# Model cards (Hugging Face config.json of each model).
LLAMA_70B = ModelShape("Llama-3.1-70B", 70.6e9, 80, 8, 128)
LLAMA_8B = ModelShape("Llama-3.1-8B", 8.03e9, 32, 8, 128)

# Datasheet figures.
# Scale-out links, for KV transfers between replicas: Gaudi 2 and 3 each give 3 of their 24 integrated
# Ethernet ports (100 and 200 GbE) to scale-out; an Aurora node has 8 Slingshot-11 NICs of 200 Gb/s for 12 tiles.
GAUDI2 = Device("Gaudi 2", 96e9, 2.45e12, 432e12, "Intel Gaudi 2 datasheet: 96 GB HBM2E, 2.45 TB/s, 432 TFLOPS BF16",
                link_bytes_per_s=3 * 100e9 / 8)
GAUDI3 = Device("Gaudi 3", 128e9, 3.7e12, 1835e12, "Intel Gaudi 3 datasheet: 128 GB HBM2e, 3.7 TB/s, 1835 TFLOPS BF16",
                link_bytes_per_s=3 * 200e9 / 8)
PVC_TILE = Device("Max 1550 tile", 64e9, 1.6e12, 210e12, "Intel Data Center GPU Max 1550 (Aurora's PVC): 128 GB, "
                  "3.2 TB/s and about 420 TFLOPS BF16 per GPU of 2 tiles, halved per tile",
                  link_bytes_per_s=8 * 200e9 / 8 / 12)

MFU = 0.4  # share of peak compute a long prefill reaches (assumed)
BANDWIDTH_EFFICIENCY = 0.6  # share of peak bandwidth a decode step reaches (assumed)
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
ACTIVATION_RESERVE = 0.05  # of the group's memory, for activations and graphs (assumed)
LAUNCH_OVERHEAD_S = {"Gaudi 2": 0.003, "Gaudi 3": 0.003, "Max 1550 tile": 0.002}  # per step (assumed)
PER_SEQUENCE_S = 1e-4  # sampling and bookkeeping per decoding sequence (assumed)


@dataclass(frozen=True)
class Profile:
    name: str
    block_size: int
    num_gpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    cost: StepCost
    source: str
    platform: str = "cpu"  # kvroute's replicas[].platform for it
    tensor_parallel_size: int = 1
    frontend_s: float = 0.0  # API server time per request outside engine steps (Engine's frontend_s)
    kv_bytes_per_token: int = 1024  # KV cache bytes per token, all layers (what a disaggregated decode reads)
    link_bytes_per_s: float = 25e9  # the replica's network for KV transfers (disaggregated prefill and decode)

    @property
    def prefill_tokens_per_s(self) -> float:
        return 1.0 / self.cost.prefill_s_per_token


def derive(name: str, platform: str, model: ModelShape, device: Device, tp: int, block_size: int | None = None,
           max_num_seqs: int = 256, max_num_batched_tokens: int = 8192) -> Profile:
    """A stand-in for ``tp`` devices of ``platform`` (its block size vLLM's default there unless given)."""
    block_size = block_size or platforms.get(platform).block_size
    memory = tp * device.memory_bytes
    kv = memory * GPU_MEMORY_UTILIZATION - model.weight_bytes - ACTIVATION_RESERVE * memory
    if kv <= 0:
        raise ValueError(f"{model.name} does not fit on {tp} x {device.name}")
    blocks = int(kv // (model.kv_bytes_per_token * block_size))
    bandwidth = tp * device.bandwidth * BANDWIDTH_EFFICIENCY
    cost = StepCost(
        base_s=model.weight_bytes / bandwidth + LAUNCH_OVERHEAD_S[device.name],
        prefill_s_per_token=2 * model.params / (tp * device.bf16_flops * MFU),
        decode_s_per_seq=PER_SEQUENCE_S,
        context_s_per_token=model.kv_bytes_per_token / bandwidth,
    )
    source = (f"{model.name} (BF16) on {tp} x {device.name}, block size {block_size}: derived from {device.source}; "
              f"MFU {MFU}, bandwidth efficiency {BANDWIDTH_EFFICIENCY}, gpu_memory_utilization "
              f"{GPU_MEMORY_UTILIZATION} (loadtest/profiles.py)")
    return Profile(name, block_size, blocks, max_num_seqs, max_num_batched_tokens, cost, source, platform, tp,
                   kv_bytes_per_token=model.kv_bytes_per_token, link_bytes_per_s=tp * device.link_bytes_per_s)


# The project's tiny Llama on this machine's real vLLM CPU replicas (deploy/setup-vllm.sh), measured with
# `python -m loadtest.calibrate measure` on 2026-12-02, three replicas at once behind kvroute on 2 cores (as the
# real-vLLM benchmarks run them, each with its engine in one process: loadtest/vllm_cluster.py), by vLLM's own
# histograms and the client's clock: prefill 12.0 us per token, 2.0 ms more for a step with prefill, a decode step
# 1.9 ms plus 0.04 ms per sequence, and 16.9 ms per request in the API server beyond what the router and the
# simulator's own HTTP path take. 104 blocks of 128 tokens and 16 sequences, as the real-vLLM benchmarks run it;
# max_num_batched_tokens 2048 is assumed.
CPU = Profile("cpu", block_size=128, num_gpu_blocks=104, max_num_seqs=16, max_num_batched_tokens=2048,
              cost=StepCost(base_s=1.898e-3, prefill_s_per_token=12.01e-6, decode_s_per_seq=0.039e-3,
                            context_s_per_token=0.0, prefill_base_s=2.016e-3),
              source="the tiny Llama on 3 of this machine's vLLM 0.32 CPU replicas at once, measured by "
                     "loadtest/calibrate.py", frontend_s=16.94e-3)

PROFILES: dict[str, Profile] = {
    p.name: p for p in (
        CPU,
        derive("gaudi2-tp8", "gaudi2", LLAMA_70B, GAUDI2, 8),
        derive("gaudi3-tp8", "gaudi3", LLAMA_70B, GAUDI3, 8),
        derive("aurora-pvc-tp1", "aurora-pvc", LLAMA_8B, PVC_TILE, 1),
        derive("aurora-pvc-tp2", "aurora-pvc", LLAMA_8B, PVC_TILE, 2),
        derive("aurora-pvc-tp4", "aurora-pvc", LLAMA_70B, PVC_TILE, 4),
    )
}
