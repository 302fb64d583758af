"""The decision: a policy runs its filters, its weighted scorers and its picker over the replica views, and
says why (``explain``)."""

from __future__ import annotations

from typing import Any, Sequence

from ..request import RouteRequest
from ..view import ReplicaView
from .filters import DEFAULT_FILTERS
from .stages import FILTERS, Filter, NoCandidate, Picker, Scored, Scorer


class Policy:
    def __init__(self, name: str, scorers: Sequence[tuple[Scorer, float]], picker: Picker,
                 filters: Sequence[Filter] | None = None) -> None:
        self.name = name
        self.filters = tuple(filters) if filters is not None else tuple(FILTERS[f]() for f in DEFAULT_FILTERS)
        self.scorers = tuple(scorers)
        self.picker = picker
        self.uses_prefix = any(s.uses_prefix for s, _ in self.scorers)
        # filters that judge each replica alone can run in one pass; one that looks at the whole list cannot
        self._keeps = tuple(f.keep for f in self.filters) if all(
            type(f).__call__ is Filter.__call__ for f in self.filters) else None

    def candidates(self, req: RouteRequest, views: Sequence[ReplicaView]) -> list[ReplicaView]:
        """Run the filters; raise :class:`NoCandidate` naming the first one that left nobody.

        A request pinned to a replica (it names a response stored there) is weighed on that replica alone.
        """
        if req.pinned is not None:
            views = [v for v in views if v.name == req.pinned]
        keeps = self._keeps
        if keeps is not None:
            # one pass over the replicas with every filter (the common case: someone is left)...
            current = [v for v in views if all(keep(req, v) for keep in keeps)]
            if current:
                return current
        # ...and filter by filter only to tell which one left nobody
        current = list(views)
        for f in self.filters:
            current = f(req, current)
            if not current:
                raise NoCandidate(f.when_empty)
        return current  # a filter that keeps a replica alone but drops it among others

    def score(self, req: RouteRequest, view: ReplicaView) -> float:
        return sum(w * s(req, view) for s, w in self.scorers)

    def explain(self, req: RouteRequest, views: Sequence[ReplicaView]) -> dict[str, Any]:
        """What :meth:`choose` would weigh for ``req``, without choosing (a picker keeps turns): each
        replica left out with the filter that left it out, each candidate with its score, each scorer's
        rating and weight and what the rating is made of, best first, and the best-scored ones."""
        filtered: list[dict[str, str]] = []
        candidates: list[dict[str, Any]] = []
        scored: list[Scored] = []
        for v in views:
            dropped = next((f.name for f in self.filters if not f(req, [v])), None)
            if dropped is not None:
                filtered.append({"replica": v.name, "filter": dropped})
                continue
            scorers = []
            for s, w in self.scorers:
                entry: dict[str, Any] = {"name": s.name, "weight": w, "score": s(req, v)}
                parts = s.explain(req, v)
                if parts is not None:
                    entry.update(parts)
                scorers.append(entry)
            scored.append((v, sum(e["weight"] * e["score"] for e in scorers)))  # as score() adds them
            candidates.append({"replica": v.name, "score": scored[-1][1],
                               "cached_tokens": req.cached.get(v.name, 0), "load": v.load,
                               "pending_prefill": v.pending_prefill, "returning": req.returning.get(v.name, 0.0),
                               "scorers": scorers})
        candidates.sort(key=lambda c: -c["score"])
        best = sorted(v.name for v, _ in self.picker.tied(scored)) if scored else []
        return {"policy": self.name, "picker": self.picker.name, "best": best, "candidates": candidates,
                "filtered": filtered}

    def choose(self, req: RouteRequest, views: Sequence[ReplicaView]) -> Scored:
        cands = self.candidates(req, views)
        scorers = self.scorers
        if len(scorers) == 1:
            s, w = scorers[0]
            scored = [(v, w * s(req, v)) for v in cands]
        else:
            scored = [(v, sum(w * s(req, v) for s, w in scorers)) for v in cands]
        if req.trace is not None:  # what it weighed, for the request's trace
            req.trace.weighed(scored)
        return self.picker(req, scored)
