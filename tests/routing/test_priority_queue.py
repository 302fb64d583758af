"""The router queue by tenant: classes first (interactive, standard, batch), then the tenants of a class by weight;
a full queue sheds the least urgent; vLLM's priority set from the class where a replica schedules by it."""

import threading
import time

from loadtest.cluster import HTTP
from support.waiting import wait_until

TENANTS = [
    {"name": "chat", "class": "interactive"},
    {"name": "jobs", "class": "batch"},
    {"name": "heavy", "class": "standard", "weight": 3},
    {"name": "light", "class": "standard", "weight": 1},
    {"name": "other", "class": "standard"},
]


def one_slot_router(cluster, *sim_args, **extra):
    """A router in front of one stand-in that takes one request at a time (max_num_seqs 1): the rest queue."""
    sim = cluster.sim(*sim_args)
    return sim, cluster.router([], config={"replicas": [{"url": sim.url, "max_num_seqs": 1, **extra.pop("replica", {})}],
                                           "tenants": TENANTS, **extra})


def queued(rt):
    return HTTP.get(rt.url + "/admin/replicas").json()["queue_length"]


class Sender:
    """Requests sent from threads; records who finished in which order: each one's label, status, error code and
    the time it ended."""

    def __init__(self, rt):
        self.rt = rt
        self.done = []
        self.lock = threading.Lock()
        self.threads = []

    def send(self, tenant, label=None, prompt="same prompt for everyone", **body):
        def run():
            r = HTTP.post(self.rt.url + "/v1/completions", timeout=30, headers={"x-kvroute-tenant": tenant},
                          json={"model": "tiny", "prompt": prompt, "max_tokens": 1, **body})
            code = r.json()["error"]["code"] if r.status_code != 200 else None
            with self.lock:
                self.done.append((label or tenant, r.status_code, code, time.monotonic()))
        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)

    def join(self):
        for t in self.threads:
            t.join()
        return self.done


def test_an_interactive_request_is_served_before_batch_requests_that_waited_longer(cluster):
    _, rt = one_slot_router(cluster, "--ttft-ms", "300", "--itl-ms", "1")
    s = Sender(rt)
    s.send("jobs", "holder")
    time.sleep(0.1)
    for i in range(3):
        s.send("jobs", f"batch-{i}")
        wait_until(lambda: queued(rt) == i + 1, timeout=3)
    s.send("chat", "interactive")
    wait_until(lambda: queued(rt) == 4, timeout=3)
    order = [label for label, status, *_ in s.join() if status == 200]
    assert order[:2] == ["holder", "interactive"]
    assert order[2:] == ["batch-0", "batch-1", "batch-2"]  # a class keeps its own arrival order


def test_tenants_of_one_class_share_freed_slots_by_weight(cluster):
    _, rt = one_slot_router(cluster, "--ttft-ms", "60", "--itl-ms", "40")
    s = Sender(rt)
    s.send("other", "holder", prompt="the holder", max_tokens=50)  # 60 ms + 50 x 40 ms: the others line up meanwhile
    time.sleep(0.2)
    for i in range(12):
        s.send("heavy")
        s.send("light")
    wait_until(lambda: queued(rt) == 24, timeout=5)
    served = [label for label, status, *_ in s.join() if status == 200 and label != "holder"]
    first = served[:12]
    assert 8 <= first.count("heavy") <= 10  # 3:1 (9 of 12) by equal-cost requests


def test_a_full_queue_sheds_a_batch_request_for_an_interactive_one(cluster):
    _, rt = one_slot_router(cluster, "--ttft-ms", "400", "--itl-ms", "1", queue={"max_size": 2, "timeout_s": 30})
    s = Sender(rt)
    s.send("jobs", "holder")
    time.sleep(0.15)
    s.send("jobs", "batch-0")
    wait_until(lambda: queued(rt) == 1, timeout=3)
    s.send("jobs", "batch-1")
    wait_until(lambda: queued(rt) == 2, timeout=3)
    s.send("chat", "interactive")
    done = [d[:3] for d in s.join()]
    assert ("interactive", 200, None) in done
    shed = [d for d in done if d[1] == 429]
    assert shed == [("batch-1", 429, "router_queue_shed")]  # the last in line made room
    assert HTTP.get(rt.url + "/metrics").text.count('outcome="shed"') == 1


def test_a_full_queue_refuses_a_batch_request_rather_than_shed_its_own_class(cluster):
    _, rt = one_slot_router(cluster, "--ttft-ms", "400", "--itl-ms", "1", queue={"max_size": 1, "timeout_s": 30})
    s = Sender(rt)
    s.send("jobs", "holder")
    time.sleep(0.15)
    s.send("jobs", "first")
    wait_until(lambda: queued(rt) == 1, timeout=3)
    s.send("jobs", "second")
    done = [d[:3] for d in s.join()]
    assert ("second", 429, "router_queue_full") in done and ("first", 200, None) in done


def test_a_replica_that_schedules_by_priority_gets_the_tenants_class_as_vllms_priority(cluster):
    sim, rt = one_slot_router(cluster, "--ttft-ms", "1", "--itl-ms", "1", "--scheduling-policy", "priority",
                              replica={"priority_scheduling": True})
    for tenant, expected in (("chat", 0), ("jobs", 2), ("heavy", 1)):
        HTTP.post(rt.url + "/v1/completions", headers={"x-kvroute-tenant": tenant},
                  json={"model": "tiny", "prompt": "p", "max_tokens": 1, "priority": -100}).raise_for_status()
        assert HTTP.get(sim.url + "/sim/state").json()["counters"]["last_body"]["priority"] == expected


def test_a_replica_that_does_not_schedule_by_priority_gets_the_body_as_sent(cluster):
    sim, rt = one_slot_router(cluster, "--ttft-ms", "1", "--itl-ms", "1")
    HTTP.post(rt.url + "/v1/completions", headers={"x-kvroute-tenant": "chat"},
              json={"model": "tiny", "prompt": "p", "max_tokens": 1}).raise_for_status()
    assert "priority" not in HTTP.get(sim.url + "/sim/state").json()["counters"]["last_body"]


def test_a_tenant_of_long_prompts_does_not_crowd_out_one_of_short_prompts(cluster):
    _, rt = one_slot_router(cluster, "--ttft-ms", "40", "--itl-ms", "40")
    s = Sender(rt)
    s.send("other", "holder", prompt="the holder", max_tokens=40)
    time.sleep(0.2)
    for _ in range(8):
        s.send("heavy", "long", prompt="many words here " * 100)
        s.send("light", "short", prompt="few words")
    wait_until(lambda: queued(rt) == 16, timeout=5)
    served = [label for label, status, *_ in s.join() if status == 200 and label != "holder"]
    # weights 3:1 by tokens: one long prompt (~1,200 tokens) outweighs every short one (~3 tokens each)
    assert served[:10].count("short") == 8


def test_weights_hold_across_two_routers_sharing_one_load_picture(cluster, shared_url):
    sim = cluster.sim("--ttft-ms", "60", "--itl-ms", "40")
    config = {"replicas": [{"url": sim.url, "max_num_seqs": 1}], "tenants": TENANTS}
    a, b = (cluster.router([], "--index", shared_url, config=config) for _ in range(2))
    s_a, s_b = Sender(a), Sender(b)
    s_a.send("other", "holder", prompt="the holder", max_tokens=50)
    time.sleep(0.3)
    for i in range(8):
        for sender in (s_a, s_b):
            sender.send("heavy", prompt=f"heavy {i} " + "words " * 100)  # ~150 tokens each: equal costs
            sender.send("light", prompt=f"light {i} " + "words " * 100)
    wait_until(lambda: queued(a) + queued(b) == 32, timeout=5)
    s_a.join()
    s_b.join()
    served = [label for label, status, *_ in sorted(s_a.done + s_b.done, key=lambda d: d[3])
              if status == 200 and label != "holder"]
    assert 10 <= served[:16].count("heavy") <= 14  # 3:1 (12 of 16), whichever router each came through
