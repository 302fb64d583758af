"""How many health-check and ``/metrics`` requests a second the router may send: the control budget.

A fleet needs about 2.2 control requests per replica per second at the default intervals. What one costs the
router differs by machine (0.3 to 0.7 ms of CPU have been seen), so a budget counted in requests alone keeps
an idle router of 1,024 replicas at 2% of a core on one host and 6% on another. :class:`ControlBudget`
measures it instead: every :data:`WINDOW_S` seconds in which this process served no request (none started,
none in flight) and sent about as many control requests as its budget allowed, the process's CPU over the
window divided by the control requests sent in it is a sample of what one costs. Everything else the idle
router does counts in, so the budget errs on the side of less: with ``b`` of a core spent idle whatever the
checks, and ``c`` per request, the budget settles where ``b + c x rate`` is ``health.max_idle_cpu`` (each
window moves it ``b / max_idle_cpu`` of the way less than the last). A window that sent fewer than the budget
(a fleet within it, or checks still spreading out) teaches nothing: its fixed costs would be counted per
request and push the budget down for no reason. The first window is left out (start-up work: loading a
tokenizer, the first round of checks), and the cost is the median of the last :data:`KEPT` samples, so that a
spike of other work (a model's tokenizer loaded when a replica starts serving it) does not swing the budget.
The budget is then ``health.max_idle_cpu`` of a core divided by that cost, never more than
``health.max_requests_per_s`` and never fewer than :data:`MIN_RATE` a second; until a first sample it is the
ceiling.

A fleet within the budget is checked at the configured intervals whatever a request costs: the budget only
spaces out the checks of a fleet larger than it (``router.replicas.control``).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable

from ..config import HealthConfig

log = logging.getLogger("kvroute.pool")

WINDOW_S = 5.0  # seconds per measurement
MIN_REQUESTS = 20  # a window with fewer control requests says too little (its fixed costs dominate) ...
STEADY = 0.7  # ... as does one that sent fewer than this share of what the budget allowed
MIN_RATE = 10.0  # control requests a second, whatever they cost: a large fleet is checked at least this often
KEPT = 5  # samples the cost is the median of
NOTE_CHANGE = 0.2  # a budget that moves by this share or more is logged


class ControlBudget:
    """This process's control budget (:meth:`rate`), from the CPU its control requests were measured to cost.

    ``served``: requests this process has started and finished so far (read to tell an idle window);
    ``cpu``: this process's CPU seconds so far (all its threads); ``workers``: the router's worker processes,
    which share the budget (each sends its share of the checks, and measures what its own cost)."""

    def __init__(self, config: HealthConfig, served: Callable[[], tuple[int, int]],
                 cpu: Callable[[], float] = time.process_time,
                 on_change: Callable[[float, float], None] | None = None, workers: int = 1) -> None:
        self.config = config
        self.workers = max(1, workers)
        self._served = served
        self._cpu = cpu
        self._on_change = on_change  # told (old rate, new rate) when the budget moves
        self.sent = 0  # control requests sent by this process
        self.cost_s: float | None = None  # CPU per control request, measured idle (None: not yet)
        self.samples = 0
        self._kept: deque[float] = deque(maxlen=KEPT)
        self._noted: float | None = None  # the budget last logged

    def count(self, requests: int = 1) -> None:
        """``requests`` control requests were sent."""
        self.sent += requests

    def rate(self) -> float:
        """Control requests a second this process may send over the fleet."""
        ceiling = self.config.max_requests_per_s
        if self.cost_s is None or self.cost_s <= 0:
            return ceiling
        return min(ceiling, max(MIN_RATE, self.config.max_idle_cpu / self.cost_s))

    def observe(self, cpu_s: float, requests: int, idle: bool, allowed: float | None = None) -> None:
        """One window: ``cpu_s`` spent while ``requests`` control requests were sent, ``idle`` if no client
        request was served in it, ``allowed``: the requests the budget allowed over it. Windows with traffic, or
        with too few control requests (fewer than :data:`MIN_REQUESTS`, or than :data:`STEADY` of those
        allowed), teach nothing."""
        if not idle or requests < MIN_REQUESTS or cpu_s < 0 or (allowed is not None and requests < STEADY * allowed):
            return
        before = self.rate()
        self._kept.append(cpu_s / requests)
        self.cost_s = statistics.median(self._kept)
        self.samples += 1
        rate = self.rate()
        if rate != before and self._on_change is not None:
            self._on_change(before, rate)
        if self._noted is None or abs(rate - self._noted) >= NOTE_CHANGE * self._noted:
            self._noted = rate
            if rate < self.config.max_requests_per_s:
                log.info("control budget: %.2f ms of CPU per health check or scrape, measured idle: %.0f a second "
                         "over the fleet (health.max_idle_cpu %.0f%% of a core)", self.cost_s * 1000, rate,
                         self.config.max_idle_cpu * 100)
            if rate <= MIN_RATE:
                log.warning("control budget: the router's idle CPU (%.2f ms per control request) leaves fewer than "
                            "%.0f checks a second within health.max_idle_cpu; it checks %.0f a second all the same",
                            self.cost_s * 1000, MIN_RATE, MIN_RATE)

    async def run(self) -> None:
        """Measure window after window, for as long as the router runs (the first, start-up's, left out)."""
        await asyncio.sleep(WINDOW_S)
        while True:
            cpu0, sent0, before = self._cpu(), self.sent, self._served()
            allowed = self.rate() * WINDOW_S / self.workers  # this process's share
            await asyncio.sleep(WINDOW_S)
            after = self._served()
            self.observe(self._cpu() - cpu0, self.sent - sent0, idle=after == before and after[0] == after[1],
                         allowed=allowed)

    def describe(self) -> dict[str, float | int | None]:
        return {"requests_per_s": round(self.rate(), 1),
                "cpu_ms_per_request": None if self.cost_s is None else round(self.cost_s * 1000, 3),
                "idle_windows_measured": self.samples}
