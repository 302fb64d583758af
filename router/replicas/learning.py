"""Each replica's prefill figures, learned from what its counters moved by between scrapes and shared among
the replicas of its kind (the same platform, parallel sizes and models), which route by their average."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from .record import Kind, Replica
from .stats import ReplicaStats

log = logging.getLogger("kvroute.pool")

SHARE_EVERY_S = 1.0  # replicas of a kind share their figures at most this often ...
SHARE_AT_ONCE_UP_TO = 64  # ... on a fleet larger than this; a smaller one shares each sample at once


class PrefillLearning:
    """Every replica's prefill figures, learned from its scrapes and shared among the replicas of its kind.

    ``replicas`` is the pool's own mapping, read here, never changed."""

    def __init__(self, replicas: Mapping[str, Replica]) -> None:
        self.replicas = replicas
        self._shared_at: dict[Kind, float] = {}  # kind of replica -> when its figures were last shared
        self._unshared: set[Kind] = set()  # kinds with a sample not shared yet

    def scraped(self, r: Replica, stats: ReplicaStats, restarted: bool) -> None:
        """A new scrape of ``r`` (before it becomes ``r.stats``): learn from it, share what changed."""
        if self._learn(r, stats, restarted) or r.kind in self._unshared:
            self._share(r)

    def _learn(self, r: Replica, stats: ReplicaStats, restarted: bool) -> bool:
        """Feed the replica's prefill estimate with what its counters moved by since an earlier scrape:
        requests, uncached prompt tokens (prompt tokens less prefix-cache hits) and seconds in prefill.
        A scrape with too little in it keeps counting from the same base (see :class:`PrefillEstimate`).
        True when the estimate took the sample."""
        if "prefill_seconds" not in stats.seen or "prompt_tokens" not in stats.seen:
            return False
        base = r.prefill_base
        if base is None or restarted:
            r.prefill_base = stats
            return False
        requests = stats.prefill_requests - base.prefill_requests
        seconds = stats.prefill_seconds - base.prefill_seconds
        uncached = (stats.prompt_tokens - base.prompt_tokens) - (stats.prefix_hits - base.prefix_hits)
        if requests < 0 or seconds < 0:  # counters went back: a restart the start time did not show
            r.prefill_base = stats
            return False
        first, step_unknown = r.prefill.rate is None, r.prefill.marginal_s is None
        if not r.prefill.add(requests, uncached, seconds):
            return False
        r.prefill_base = stats
        if first and r.config.prefill_tokens_per_s is None:
            log.info("replica %s: prefill at %.0f prompt tokens/s by its metrics (the %s platform's guess was %.0f; "
                     "replicas[].prefill_tokens_per_s sets it)", r.name, r.prefill.rate, r.config.platform,
                     r.config.prefill_rate, extra={"replica": r.name})
        if step_unknown and r.prefill.marginal_s is not None:
            log.info("replica %s: a prompt token adds %.1f us to a scheduler step, beside a fixed %.1f ms per request, "
                     "by its metrics", r.name, r.prefill.marginal_s * 1e6, (r.prefill.fixed_s or 0.0) * 1e3,
                     extra={"replica": r.name})
        return True

    def _share(self, r: Replica) -> None:
        """Average the prefill figures of the replicas of ``r``'s kind and hand them to each of them.

        Replicas of one platform, parallel sizes and models prefill at one speed; their estimates differ by
        what each happened to serve (a sample taken while prompts shared steps shows a slower replica).
        Taken one by one, a replica that looked faster drew every new prompt: on the evicting cluster
        benchmark costs of idle twins parted by up to 40%, on real vLLM CPU replicas by up to 60 times."""
        # on a large fleet, a pass over it per kind at most once a second (a sample can come from every scrape of
        # every replica: on a thousand replicas, a pass for each was most of a router's background CPU); a
        # sample in between is shared at the next scrape of one of them after that
        k = r.kind
        now = time.monotonic()
        if (len(self.replicas) > SHARE_AT_ONCE_UP_TO and r.kind_prefill[0] is not None
                and now - self._shared_at.get(k, -1e9) < SHARE_EVERY_S):
            self._unshared.add(k)
            return
        self._unshared.discard(k)
        self._shared_at[k] = now
        if len(self._shared_at) > len(self.replicas):  # some kind no replica is of any more (its models changed)
            # a kind holds its replicas' model ids: one kept after they changed would keep the ids it names alive
            # (a replica whose LoRA adapters churn makes a new kind at every health check)
            live = {x.kind for x in self.replicas.values()}
            self._shared_at = {kind: at for kind, at in self._shared_at.items() if kind in live}
            self._unshared &= live
        same = [x for x in self.replicas.values() if x.kind == k]
        rates = [x.prefill.rate for x in same if x.prefill.rate is not None]
        steps = [x.prefill.marginal_s for x in same if x.prefill.marginal_s is not None]
        shared = (sum(rates) / len(rates) if rates else None, sum(steps) / len(steps) if steps else None)
        for x in same:
            if x.kind_prefill != shared:
                x.kind_prefill = shared
                if x is not r:
                    x.view = x.make_view()
