"""Real vLLM CPU replicas on 127.0.0.1, for the end-to-end tests and the real-vLLM benchmark.

    python -m loadtest.vllm_cluster --replicas 2 [--num-gpu-blocks 64] [--block-size 128]

starts K replicas of the project's tiny Llama (``deploy/setup-vllm.sh`` builds the environment and
the model once, then reuses them), waits until every ``/health`` answers, prints their URLs and
stops them (their whole process groups: vLLM runs an engine process beside its API server) on
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .cluster import ROOT, Proc, free_port

MODEL_NAME = "tiny"
# the render endpoints (/v1/chat/completions/render: the prompt's token ids as the replica computes them), and
# tool calling, so that requests with tools are accepted as clients send them (tool_choice "auto")
RENDER_ARGS = ("--enable-scale-out", "--enable-auto-tool-choice", "--tool-call-parser", "pythonic")


def setup() -> Path:
    """Run the (cached) setup script; returns the folder holding ``venv`` and ``tiny-llama``."""
    out = subprocess.run(["bash", str(ROOT / "deploy" / "setup-vllm.sh")], cwd=ROOT, check=True,
                         stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def model_dir(home: Path) -> Path:
    return home / "tiny-llama"


def replica(home: Path, port: int | None = None, num_gpu_blocks: int | None = 64, block_size: int = 128,
            log_dir: Path | None = None, name: str | None = None, max_num_seqs: int = 16, max_model_len: int = 4096,
            extra: tuple[str, ...] = (), dev_mode: bool = False, store_responses: bool = False,
            kv_transfer: bool = False) -> Proc:
    """A vLLM replica serving the tiny model as ``tiny`` (not started).

    ``dev_mode`` enables vLLM's development endpoints, such as ``POST /reset_prefix_cache``;
    ``store_responses`` its response store; ``kv_transfer`` vLLM's NixlConnector (either side of a
    disaggregated prefill and decode, KV in host memory, its side channel on a free port).
    ``num_gpu_blocks=None`` lets vLLM size its cache from the KV space (1 GiB).
    """
    port = port or free_port()
    name = name or f"vllm-{port}"
    argv = [str(home / "venv" / "bin" / "vllm"), "serve", str(model_dir(home)), "--served-model-name", MODEL_NAME,
            "--host", "127.0.0.1", "--port", str(port), "--block-size", str(block_size),
            "--enable-prefix-caching", "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
            "--disable-uvicorn-access-log", *extra]
    if num_gpu_blocks is not None:
        argv += ["--num-gpu-blocks-override", str(num_gpu_blocks)]
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
           # several replicas share 2 cores: no pinning to one core each, one thread each
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
           # the engine and its one worker in one process: by default vLLM's CPU platform runs the worker in a
           # process of its own, which spins on the shared-memory queue for 1 s after every step (sched_yield); three
           # replicas' spinning workers took both cores, and times to first token were several times longer and
           # varied up to fourfold from one run to the next (docs/real-vllm.md)
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if store_responses:  # /v1/responses answers kept in the replica's memory for previous_response_id
        env["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"
    if kv_transfer:
        argv += ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})]
        env.update({"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})
    return Proc(name, argv, port, env=env, log_path=(log_dir / f"{name}.log") if log_dir else None)


def kv_events_args(port: int | None = None, replay_port: int | None = None) -> tuple[str, ...]:
    """``--kv-events-config`` publishing KV-cache events over ZMQ, with a replay endpoint, on free ports."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port or free_port()}",
              "replay_endpoint": f"tcp://*:{replay_port or free_port()}", "topic": "kv"}
    return ("--kv-events-config", json.dumps(config))


def start(procs: list[Proc], timeout: float = 600.0) -> list[Proc]:
    """Start every replica at once and wait until each answers ``/health``; on failure stop them all.

    A replica that exits while starting is started once more: vLLM picks its internal
    ports (``get_open_port``) by binding and closing them, so replicas starting side by side can race for
    one. The first attempt's log stays in the replica's log, under a line saying it was started again."""
    for p in procs:
        p.start()
    try:
        errors: list[BaseException] = []

        def wait(p: Proc) -> None:
            deadline = time.monotonic() + timeout
            try:
                try:
                    p.wait_http("/health", timeout=timeout)
                except RuntimeError:  # it exited: once more, unless the first attempt took the time
                    if time.monotonic() > deadline - 60:
                        raise
                    if p.log_path is not None:
                        with open(p.log_path, "a") as log:
                            log.write(f"\n[vllm_cluster] {p.name} exited while starting (code "
                                      f"{p.popen.returncode if p.popen else None}); starting it again\n")
                    p.stop(timeout=5)
                    p.start()
                    p.wait_http("/health", timeout=deadline - time.monotonic())
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)

        threads = [threading.Thread(target=wait, args=(p,)) for p in procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
    except BaseException:
        for p in procs:
            p.stop(timeout=10)
        raise
    return procs


def start_for_benchmarks(home: Path, n: int, num_gpu_blocks: int, log_dir: Path) -> list[Proc]:
    """``n`` replicas as the real-vLLM benchmarks run them, started: KV-cache events with a replay endpoint, cached
    tokens in each answer's usage, the development endpoints (a cache reset between runs)."""
    return start([replica(home, num_gpu_blocks=num_gpu_blocks, log_dir=log_dir, name=f"vllm-{i}", dev_mode=True,
                          extra=(*kv_events_args(), "--enable-prompt-tokens-details"))
                  for i in range(n)], timeout=900)


def metrics(url: str) -> dict[str, float]:
    """A replica's ``vllm:*`` samples summed over their labels (``_total`` kept in counter names).

    Samples with a ``finished_reason`` label are also kept per reason, e.g.
    ``vllm:request_success_total{finished_reason="abort"}``.
    """
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    text = httpx.get(url + "/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("vllm:"):
                out[s.name] = out.get(s.name, 0.0) + s.value
                if "finished_reason" in s.labels:
                    key = f'{s.name}{{finished_reason="{s.labels["finished_reason"]}"}}'
                    out[key] = out.get(key, 0.0) + s.value
    return out


def cache_config(url: str) -> dict[str, str]:
    """The labels of a replica's ``vllm:cache_config_info`` (block_size, num_gpu_blocks, ...)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text):
        for s in family.samples:
            if s.name == "vllm:cache_config_info":
                return dict(s.labels)
    raise LookupError(f"{url}/metrics has no vllm:cache_config_info")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.vllm_cluster", description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--num-gpu-blocks", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--dev-mode", action="store_true", help="enable vLLM's development endpoints "
                    "(POST /reset_prefix_cache, used by loadtest.bench_vllm --use)")
    ap.add_argument("--no-kv-events", action="store_true", help="do not publish KV-cache events (by default each "
                    "replica publishes them with a replay endpoint, as loadtest.bench_vllm starts its own)")
    ap.add_argument("--log-dir", type=Path, default=ROOT / "loadtest" / "out" / "vllm")
    args = ap.parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    home = setup()
    procs = start([replica(home, num_gpu_blocks=args.num_gpu_blocks, block_size=args.block_size,
                           log_dir=args.log_dir, dev_mode=args.dev_mode,
                           extra=(*(() if args.no_kv_events else kv_events_args()), "--enable-prompt-tokens-details"))
                   for _ in range(args.replicas)])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    for p in procs:
        sys.stdout.write(f"{p.url}  (pid {p.pid}, log {p.log_path})\n")
    sys.stdout.flush()
    try:
        while not stop.is_set() and all(p.popen and p.popen.poll() is None for p in procs):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        for p in procs:
            p.stop(timeout=15)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
