"""The stand-in's --scheduling-policy, as vLLM's: fcfs refuses a priority, priority orders its waiting requests."""

import threading
import time

from loadtest.cluster import HTTP


def send(sim, label, priority, done):
    r = HTTP.post(sim.url + "/v1/completions", timeout=10,
                  json={"model": "tiny", "prompt": "p", "max_tokens": 1, "priority": priority})
    done.append((label, r.status_code))


def test_fcfs_refuses_a_priority_other_than_zero_as_vllm_does(cluster):
    sim = cluster.sim("--ttft-ms", "1", "--itl-ms", "1")
    r = HTTP.post(sim.url + "/v1/completions", json={"model": "tiny", "prompt": "p", "max_tokens": 1, "priority": 1})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Got priority 1 but Priority scheduling is not enabled."
    ok = HTTP.post(sim.url + "/v1/completions", json={"model": "tiny", "prompt": "p", "max_tokens": 1, "priority": 0})
    assert ok.status_code == 200


def test_priority_serves_waiting_requests_lowest_priority_first(cluster):
    sim = cluster.sim("--ttft-ms", "300", "--itl-ms", "1", "--max-num-seqs", "1", "--scheduling-policy", "priority")
    done = []
    threads = []
    for label, priority, pause in (("holder", 5, 0.1), ("late-low", 5, 0.05), ("urgent", 0, 0.05)):
        t = threading.Thread(target=send, args=(sim, label, priority, done), daemon=True)
        t.start()
        threads.append(t)
        time.sleep(pause)
    for t in threads:
        t.join()
    assert [label for label, _ in done] == ["holder", "urgent", "late-low"]
