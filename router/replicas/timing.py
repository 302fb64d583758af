"""What one replica's answers took against what was predicted: the measured time to first token of every
streamed answer against the model's prediction for it (:mod:`router.policy.predict`), and the time per output
token. :mod:`.corrections` feeds it.

It keeps

- a line through the times to first token: ``measured = fixed + per_token x tokens``, where ``tokens`` is the
  prefill the model predicts (its own tokens and the queued ones; the model's seconds times the prefill rate
  they were priced at), fitted by
  least squares over about the last ``prediction.window`` answers, each weighing 1 / measured^2 so that the
  fit minimises the relative error: a 30 ms answer off by 20 ms counts as much as a 3 s one off by 2 s. The
  fixed part is what every request waits whatever its prompt (a scheduler step beside the running decodes,
  the server's own work); ``per_token x rate``, the slope, how far the model's prefill is off (kept within
  0.25 to 4, or 0 where the answers show nothing of it). Where the answers do not differ in what the model
  predicts, the slope stays 1 and the fixed part takes the difference;
- the recent error: a running average of |predicted - measured| / measured, of the predictions routing used;
- the time per output token as a line in the sequences running beside a stream: ``a + b x running``, fitted
  the same way over the recent streams (``a`` alone until the streams differ in how many ran beside).
"""

from __future__ import annotations

from ..config import PredictionConfig

MIN_SLOPE, MAX_SLOPE = 0.25, 4.0  # the model's prefill is never taken for more than 4x off either way
MIN_MEASURED_S = 1e-3
TPOT_MEMORY = 0.98  # weight of the earlier streams in the time-per-token fit, per new stream (about 50 count)


class _Line:
    """``y = fixed + slope x x`` by weighted least squares, older samples weighing ``memory`` less each time."""

    __slots__ = ("n", "w", "wx", "wxx", "wy", "wxy", "wyy")

    def __init__(self) -> None:
        self.n = 0
        self.w = self.wx = self.wxx = self.wy = self.wxy = self.wyy = 0.0

    def add(self, x: float, y: float, weight: float, memory: float) -> None:
        self.n += 1
        self.w = memory * self.w + weight
        self.wx = memory * self.wx + weight * x
        self.wxx = memory * self.wxx + weight * x * x
        self.wy = memory * self.wy + weight * y
        self.wxy = memory * self.wxy + weight * x * y
        self.wyy = memory * self.wyy + weight * y * y

    def _sse(self, fixed: float, slope: float) -> float:
        """The weighted squared error of ``y = fixed + slope x x`` over the samples."""
        return (self.wyy - 2 * fixed * self.wy - 2 * slope * self.wxy + fixed * fixed * self.w
                + 2 * fixed * slope * self.wx + slope * slope * self.wxx)

    def _through(self, slope: float) -> tuple[float, float]:
        """The best fixed part (at least 0) for ``slope``."""
        return max(0.0, (self.wy - slope * self.wx) / self.w), slope

    def fit(self, lo: float, hi: float, default_slope: float) -> tuple[float, float]:
        """(fixed, slope): the slope within [lo, hi] (or 0) and the fixed part at least 0, whichever of the free
        fit (clamped), ``default_slope``, ``lo`` and 0 with their best fixed parts errs least. Where x says little of y
        (queued prefill the model prices that the replica does not take), the free fit is pulled to a bound
        and its fixed part to 0: the other two keep the fixed part that every answer showed."""
        det = self.w * self.wxx - self.wx * self.wx
        lines = [self._through(default_slope), self._through(lo), self._through(0.0)]
        if det > 0.05 * self.w * self.wxx:  # they differ in x
            slope = min(hi, max(lo, (self.w * self.wxy - self.wx * self.wy) / det))
            lines.append(self._through(slope))
        return min(lines, key=lambda line: self._sse(*line))


class TimingEstimate:
    """One replica's (or one kind's) measured against predicted times; fed by
    :class:`~router.replicas.corrections.Corrections`."""

    __slots__ = ("ttft", "error", "tpot")

    def __init__(self) -> None:
        self.ttft = _Line()  # seconds to the first token against the prefill in tokens (seconds x rate)
        self.error: float | None = None
        self.tpot = _Line()

    @property
    def samples(self) -> int:
        return self.ttft.n

    def ttft_fit(self, cfg: PredictionConfig, rate: float) -> tuple[float, float] | None:
        """(fixed seconds, seconds per prefill token) for routing's predictions, the second within
        [MIN_SLOPE, MAX_SLOPE] times the model's ``1 / rate``; None while too few answers came (or correcting
        is off)."""
        if not cfg.correct or self.ttft.n < cfg.min_samples:
            return None
        return self.ttft.fit(MIN_SLOPE / rate, MAX_SLOPE / rate, 1.0 / rate)

    def add_ttft(self, model_s: float, measured_s: float, predicted_s: float, rate: float,
                 cfg: PredictionConfig) -> None:
        """An answer whose first token came ``measured_s`` after it was sent, where the model predicted
        ``model_s`` of prefill at ``rate`` tokens/s and routing ``predicted_s`` in all.

        The line is fitted against the prefill in tokens (``model_s x rate``), not in the model's seconds: the
        rate is learned too, and moves (the platform's guess of a 70B model's rate can be 7 times its learned
        one; on CPU replicas samples scatter by 30%); a line in seconds fitted across both took every prefill
        for 20 times cheaper than it was."""
        y = max(measured_s, MIN_MEASURED_S)
        self.ttft.add(model_s * rate, y, 1.0 / (y * y), 1.0 - 2.0 / (cfg.window + 1))
        err = abs(predicted_s - measured_s) / y
        alpha = max(2.0 / (cfg.window + 1), 1.0 / self.ttft.n)  # a plain mean over the first few
        self.error = err if self.error is None else self.error + alpha * (err - self.error)

    def add_tpot(self, running: float, seconds: float) -> None:
        self.tpot.add(running, seconds, 1.0, TPOT_MEMORY)

    def tpot_fit(self) -> tuple[float, float]:
        """(seconds per output token alone, seconds each running sequence adds); (0, 0) before any stream."""
        if not self.tpot.n:
            return 0.0, 0.0
        return self.tpot.fit(0.0, 1.0, 0.0)
