"""Each replica's predictions against its answers (:class:`~.timing.TimingEstimate`), fed by routing as
answers come; the figures routing reads go into the replica's view (:meth:`.record.Replica.make_view`), made
again when one moved by more than 2%, and into the metrics an operator watches for a model that drifts.

The replicas of one kind (platform, parallel sizes, models) also feed one estimate together: a replica that
has not answered ``prediction.min_samples`` streams yet is corrected by its kind's (on a fleet of hundreds each
replica's own takes that many times longer), and by its own once it has; what is systematic to one replica
(a slower host, another engine beside it) is its own.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..config import PredictionConfig
from ..metrics import Metrics
from .record import Replica
from .timing import TimingEstimate

# a kind of replica, as its timing is shared: platform, parallel sizes and a hash of the models it serves (never the
# models themselves: a replica whose LoRA adapters churn would pin every list it ever had)
TimingKind = tuple[str, int, int, int]


def _kind(r: Replica) -> TimingKind:
    platform, tp, pp, models = r.kind
    return platform, tp, pp, hash(models)

MIN_PREDICTED_S = 1e-3  # answers measured below this say nothing of the model
REBUILD_AT = 0.02  # the view is made again when a figure moved this share from the one it holds


def _moved(now: float, held: float) -> bool:
    return abs(now - held) > REBUILD_AT * max(abs(held), 1e-6)


class Corrections:
    """Feeds every replica's :class:`~.timing.TimingEstimate`; ``Replica.timing`` and ``Replica.ttft_fit`` are
    written here only."""

    def __init__(self, cfg: PredictionConfig, metrics: Metrics, replicas: Mapping[str, Replica]) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.replicas = replicas  # the pool's own mapping, read here, never changed
        self._kinds: dict[TimingKind, TimingEstimate] = {}
        self._kind_fit: dict[TimingKind, tuple[float, float]] = {}  # the kind's fit as last handed to its replicas

    def first_token(self, r: Replica, model_s: float, predicted_s: float, measured_s: float) -> None:
        """A streamed answer's first token came ``measured_s`` after it was sent to ``r``, where the model
        predicted ``model_s`` of prefill and routing ``predicted_s`` in all."""
        if measured_s < MIN_PREDICTED_S or predicted_s <= 0:
            return
        t = r.timing
        t.add_ttft(model_s, measured_s, predicted_s, r.view.prefill_rate, self.cfg)
        key = _kind(r)
        kind = self._kinds.get(key)
        if kind is None:
            self._prune()
            kind = self._kinds[key] = TimingEstimate()
        kind.add_ttft(model_s, measured_s, predicted_s, r.view.prefill_rate, self.cfg)
        m = self.metrics
        m.child(m.ttft_ratio, r.name, r.config.platform).observe(measured_s / predicted_s)
        if t.error is not None:
            m.child(m.ttft_error, r.name).set(t.error)
        rate = r.view.prefill_rate
        shared = kind.ttft_fit(self.cfg, rate)
        own = t.ttft_fit(self.cfg, rate)
        self._correct(r, own if own is not None else shared)
        if shared is not None and self._changed(shared, self._kind_fit.get(key)):
            self._kind_fit[key] = shared
            for other in self.replicas.values():  # those of the kind still short of answers of their own
                if other.timing.samples < self.cfg.min_samples and _kind(other) == key:
                    self._correct(other, shared)

    def per_token(self, r: Replica, running: float, seconds: float) -> None:
        """A streamed answer took ``seconds`` per output token after its first, with ``running`` sequences of
        this router's and other clients' on ``r`` beside it when it was sent."""
        r.timing.add_tpot(running, seconds)
        base, per_seq = r.timing.tpot_fit()
        v = r.view
        if _moved(base, v.tpot_s) or _moved(per_seq, v.tpot_per_seq_s):
            r.view = r.make_view()

    def joined(self, r: Replica) -> None:
        """A replica joined: corrected as the others of its kind are, until it has answers of its own."""
        shared = self._kind_fit.get(_kind(r))
        if shared is not None:
            self._correct(r, shared)

    def _prune(self) -> None:
        """Forget the kinds no replica is of any more (models come and go), before their count outgrows the fleet."""
        if len(self._kinds) < 2 * len(self.replicas) + 8:
            return
        live = {_kind(r) for r in self.replicas.values()}
        for key in [k for k in self._kinds if k not in live]:
            del self._kinds[key]
            self._kind_fit.pop(key, None)

    @staticmethod
    def _changed(fit: tuple[float, float] | None, held: tuple[float, float] | None) -> bool:
        if fit is None or held is None:
            return fit is not held
        return _moved(fit[0], held[0]) or _moved(fit[1], held[1])

    def _correct(self, r: Replica, fit: tuple[float, float] | None) -> None:
        """Predict ``r``'s times by ``fit``, (fixed s, s per prefill token) (None: by the model alone)."""
        if self._changed(fit, r.ttft_fit):
            r.ttft_fit = fit
            r.view = r.make_view()
            m = self.metrics
            m.child(m.ttft_fixed, r.name).set(r.view.ttft_fixed_s)
            m.child(m.ttft_slope, r.name).set(r.view.ttft_slope)
