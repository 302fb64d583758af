"""How fast a replica prefills, learned from samples of its own ``/metrics``.

A sample is what the replica's counters moved by between two scrapes: requests that finished their
prefill, the uncached prompt tokens among them (prompt tokens less prefix-cache hits) and the seconds
they spent in prefill (``vllm:request_prefill_time_seconds``). Two figures come out of them:

- ``rate``: uncached tokens per second of prefill, a running average of the samples' ratios. It prices
  a request's own uncached tokens. (The best recent sample instead, meant to undo the slowdown that
  prompts sharing steps put into a sample, picked outliers on real vLLM CPU replicas, whose samples
  ranged from 1,700 to 109,000 tokens/s, and drew every new conversation to one replica.)
- ``marginal_s``: the seconds one more prompt token adds to a scheduler step. A scheduler step has a
  fixed part (reading the weights, launching) and a part that grows with the tokens prefilled in it; a
  least-squares fit of ``seconds = requests x fixed + tokens x marginal`` over the recent samples tells
  them apart once the samples differ in tokens per request. It prices the queued prefill that shares a
  step with a new request: on an accelerator prefilling a 70B model a step with two 2,048-token prompts
  takes about twice as long as a step with one (the marginal part dominates), while on a CPU replica
  with short prompts the fixed part does. Until the samples tell (all of them alike), it is ``None``.

:mod:`.learning` feeds each replica's estimate from its scrapes and shares the figures among the replicas
of one kind (platform, parallel sizes, models), which route by their average.
"""

from __future__ import annotations


MIN_REQUESTS = 4  # a sample spans at least this many requests ...
MIN_TOKENS = 512  # ... and this many uncached prompt tokens
SMOOTHING = 0.3  # weight of a new sample in the running rate
MEMORY = 0.9  # weight of the earlier samples in the fit, per new sample (about the last ten count)
MIN_FIT_SAMPLES = 3
# the fit needs samples that differ in tokens per request: below this share of the spread samples of
# independent sizes would have, the two parts cannot be told apart
MIN_SPREAD = 0.02


class PrefillEstimate:
    """The running figures of one replica; fed one sample per scrape that has enough in it."""

    def __init__(self) -> None:
        self.rate: float | None = None  # uncached prompt tokens per second of prefill
        self.marginal_s: float | None = None  # seconds per prompt token added to a step
        self.fixed_s: float | None = None  # seconds of a step's fixed part, per request (the fit's other term)
        self.samples = 0
        # the fit's normal equations, older samples weighing MEMORY less each time
        self._nn = self._nu = self._uu = self._nt = self._ut = 0.0

    def add(self, requests: float, uncached: float, seconds: float) -> bool:
        """Take one sample; False (and nothing learned) when it is too small to say anything."""
        if requests < MIN_REQUESTS or uncached < MIN_TOKENS or seconds <= 0:
            return False
        sample = uncached / seconds
        self.rate = sample if self.rate is None else (1 - SMOOTHING) * self.rate + SMOOTHING * sample
        self.samples += 1
        m = MEMORY
        self._nn = m * self._nn + requests * requests
        self._nu = m * self._nu + requests * uncached
        self._uu = m * self._uu + uncached * uncached
        self._nt = m * self._nt + requests * seconds
        self._ut = m * self._ut + uncached * seconds
        self._fit()
        return True

    def _fit(self) -> None:
        if self.samples < MIN_FIT_SAMPLES:
            return
        det = self._nn * self._uu - self._nu * self._nu
        if det <= MIN_SPREAD * self._nn * self._uu:  # every sample about the same tokens per request
            return
        marginal = (self._nn * self._ut - self._nu * self._nt) / det
        fixed = (self._uu * self._nt - self._nu * self._ut) / det
        if fixed < 0:  # no fixed part: all of it grows with tokens
            fixed, marginal = 0.0, self._ut / self._uu
        # never more per token than the average (a fixed part cannot be negative), never below 0
        self.marginal_s = min(max(0.0, marginal), 1.0 / self.rate) if self.rate else None
        self.fixed_s = fixed
