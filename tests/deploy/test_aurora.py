"""The Aurora job script end to end on this machine (``DRY_RUN=1``: stand-in replicas instead of PBS and vLLM)."""

from __future__ import annotations

import os
import signal
import sys


from loadtest.cluster import HTTP
from support.state import replica_names as names
from support.waiting import refused, wait_until
from loadtest.cluster import Proc, free_ports
from support.paths import DEPLOY

SCRIPT = DEPLOY / "aurora" / "kvroute-replicas.pbs"



def test_the_job_registers_its_replicas_serves_through_both_routers_and_deregisters_at_its_end(
        cluster, redis_proc, tmp_path):
    index = ["--index", f"redis://127.0.0.1:{redis_proc.port}/0", "--set", "membership.sync_interval_s=0.2"]
    one = cluster.router([], *index, wait_ready=False)
    two = cluster.router([], *index, wait_ready=False)
    base = free_ports(2)
    events = free_ports(4)
    env = {"DRY_RUN": "1", "KVROUTE_URL": one.url, "TP": "4", "TILES_PER_NODE": "8", "SERVED_MODEL_NAME": "tiny",
           "BASE_PORT": str(base), "KV_EVENTS_BASE_PORT": str(events), "PYTHON": sys.executable,
           "LOG_DIR": str(tmp_path / "replicas"), "DRY_RUN_ARGS": "--ttft-ms 2 --itl-ms 1"}
    job = Proc("aurora-job", ["bash", str(SCRIPT)], base, env=env, log_path=tmp_path / "job.log").start()
    cluster.procs.append(job)
    host = os.uname().nodename.split(".")[0]
    expected = {f"{host}-{base}", f"{host}-{base + 1}"}
    try:
        wait_until(lambda: names(one) == expected, timeout=30, interval=0.2)
        wait_until(lambda: names(two) == expected, timeout=10, interval=0.2)  # through Redis
        two.wait_http("/ready", timeout=15)
        served = set()
        for i in range(20):
            r = HTTP.post(two.url + "/v1/completions", timeout=10,
                           json={"model": "tiny", "prompt": f"q{i} " * 30, "max_tokens": 2})
            assert r.status_code == 200, r.text
            served.add(r.headers["x-kvroute-replica"])
        assert served == expected
        view = {r["name"]: r for r in HTTP.get(one.url + "/admin/replicas").json()["replicas"]}
        assert {v["platform"] for v in view.values()} == {"aurora-pvc"}
        assert {v["tensor_parallel_size"] for v in view.values()} == {4}
        log = job.log_tail()
        assert "tiles 0.0,0.1,1.0,1.1" in log and "tiles 2.0,2.1,3.0,3.1" in log

        job.signal(signal.SIGTERM)  # the job's walltime is over
        assert job.popen.wait(30) == 143
        wait_until(lambda: not names(one) and not names(two), timeout=10, interval=0.2)
        assert "deregistered" in job.log_tail()
        for port in (base, base + 1):  # the replicas are gone with the job
            wait_until(lambda: refused(f"http://127.0.0.1:{port}/health"), timeout=10)
    finally:
        job.stop()

