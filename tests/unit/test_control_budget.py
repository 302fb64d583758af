"""The control budget (``router/replicas/control_budget.py``): health checks and scrapes a second, from the CPU
one was measured to cost while the router served no request."""

import asyncio
import logging

import pytest

from router.config import HealthConfig
from router.replicas import control_budget
from router.replicas.control_budget import ControlBudget


def budget(**health):
    return ControlBudget(HealthConfig(**health), lambda: (0, 0))


def test_until_measured_the_budget_is_max_requests_per_s():
    assert budget(max_requests_per_s=80).rate() == 80


def test_an_idle_window_sets_the_budget_to_the_cpu_share_over_the_cost_of_a_request():
    b = budget(max_idle_cpu=0.04)
    b.observe(cpu_s=0.1, requests=100, idle=True)  # 1 ms each
    assert b.rate() == pytest.approx(40.0)


def test_a_cheaper_request_raises_the_budget_no_higher_than_max_requests_per_s():
    b = budget(max_idle_cpu=0.04, max_requests_per_s=80)
    b.observe(cpu_s=0.01, requests=100, idle=True)  # 0.1 ms each: 400 a second by CPU
    assert b.rate() == 80


def test_a_window_with_client_requests_teaches_nothing():
    b = budget(max_idle_cpu=0.04, max_requests_per_s=80)
    b.observe(cpu_s=2.0, requests=100, idle=False)
    assert b.rate() == 80 and b.cost_s is None


def test_a_window_of_too_few_control_requests_teaches_nothing():
    b = budget()
    b.observe(cpu_s=0.1, requests=control_budget.MIN_REQUESTS - 1, idle=True)
    assert b.cost_s is None


def test_a_window_that_sent_fewer_than_the_budget_allowed_teaches_nothing():
    b = budget(max_idle_cpu=0.04, max_requests_per_s=80)
    b.observe(cpu_s=0.1, requests=100, idle=True, allowed=400)  # a fleet within its budget: fixed costs dominate
    assert b.cost_s is None
    b.observe(cpu_s=0.1, requests=300, idle=True, allowed=400)
    assert b.cost_s == pytest.approx(0.1 / 300)


def test_a_move_of_the_budget_is_told_with_the_rates_before_and_after():
    moves = []
    b = ControlBudget(HealthConfig(max_idle_cpu=0.04), lambda: (0, 0), on_change=lambda *m: moves.append(m))
    b.observe(cpu_s=0.1, requests=100, idle=True)  # 1 ms each: 40 a second
    b.observe(cpu_s=0.1, requests=100, idle=True)  # the same: no move
    assert moves == [(80.0, pytest.approx(40.0))]


def test_the_cost_is_the_median_of_the_last_samples_so_a_spike_does_not_swing_it():
    b = budget(max_idle_cpu=0.04)
    for cpu_s in (0.1, 0.1, 5.0):  # 1 ms, 1 ms, then a window of other work: 50 ms
        b.observe(cpu_s=cpu_s, requests=100, idle=True)
    assert b.cost_s == pytest.approx(0.001)
    for _ in range(control_budget.KEPT):  # the cost moves once the samples say so
        b.observe(cpu_s=0.2, requests=100, idle=True)
    assert b.cost_s == pytest.approx(0.002)


def test_however_costly_the_fleet_is_checked_at_the_floor_rate_and_says_so(caplog):
    b = budget(max_idle_cpu=0.01)
    with caplog.at_level(logging.INFO, logger="kvroute.pool"):
        b.observe(cpu_s=1.0, requests=100, idle=True)  # 10 ms each: 1 a second by CPU
    assert b.rate() == control_budget.MIN_RATE
    assert "checks 10 a second all the same" in caplog.text


def test_the_budget_measures_window_after_window_while_no_request_is_served(monkeypatch):
    monkeypatch.setattr(control_budget, "WINDOW_S", 0.02)
    clock = {"cpu": 0.0}
    served = {"now": (5, 5)}
    b = ControlBudget(HealthConfig(max_idle_cpu=0.05), lambda: served["now"], cpu=lambda: clock["cpu"])

    async def main():
        task = asyncio.create_task(b.run())
        clock["cpu"] += 10.0  # start-up's work, in the first window: left out
        await asyncio.sleep(0.025)
        for _ in range(3):  # three windows: 50 control requests and 0.1 s of CPU in each
            await asyncio.sleep(0.005)
            b.count(50)
            clock["cpu"] += 0.1
            await asyncio.sleep(0.02)
        measured = b.samples
        served["now"] = (6, 5)  # a request in flight: these windows teach nothing
        for _ in range(3):
            await asyncio.sleep(0.005)
            b.count(50)
            clock["cpu"] += 1.0
            await asyncio.sleep(0.02)
        task.cancel()
        return measured

    measured = asyncio.run(main())
    assert measured >= 1
    assert b.samples == measured
    assert b.cost_s == pytest.approx(0.002)  # 0.1 s over 50 requests
    assert b.rate() == pytest.approx(25.0)


def test_each_worker_process_is_held_to_its_share_of_the_budget(monkeypatch):
    monkeypatch.setattr(control_budget, "WINDOW_S", 0.02)
    clock = {"cpu": 0.0}
    b = ControlBudget(HealthConfig(max_requests_per_s=1000, max_idle_cpu=0.04), lambda: (0, 0),
                      cpu=lambda: clock["cpu"], workers=4)

    async def main():
        task = asyncio.create_task(b.run())
        await asyncio.sleep(0.025)  # past the first window (left out)
        for _ in range(4):  # a worker of four sends a quarter of the 20 the budget allows per window
            await asyncio.sleep(0.005)
            b.count(6)
            clock["cpu"] += 0.006  # 1 ms each
            await asyncio.sleep(0.02)
        task.cancel()

    monkeypatch.setattr(control_budget, "MIN_REQUESTS", 1)
    asyncio.run(main())
    assert b.samples >= 1 and b.cost_s == pytest.approx(0.001)
