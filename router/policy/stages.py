"""What every stage is: filters narrow the replicas, scorers rate the rest, a picker chooses; each registered
by name (``register_filter``, ``register_scorer``, ``register_picker``)."""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Literal, Sequence, TypeVar

from pydantic import BaseModel

from ..request import RouteRequest
from ..view import ReplicaView

# Why a filter left no replica: each maps to a different answer to the client.
Empty = Literal["no_ready", "unknown_model", "drained", "tried", "at_capacity", "no_role", "no_transfer_pair",
                "slo_unmet"]

Scored = tuple[ReplicaView, float]


class NoCandidate(Exception):
    def __init__(self, why: Empty) -> None:
        super().__init__(why)
        self.why = why


class Stage:
    """Base of filters, scorers and pickers: a name, and optional parameters (a pydantic model)."""

    name: ClassVar[str] = ""
    Params: ClassVar[type[BaseModel] | None] = None

    def __init__(self, params: BaseModel | None = None) -> None:
        self.params = params


class Filter(Stage):
    when_empty: ClassVar[Empty] = "no_ready"  # what the client is told when this filter leaves nobody

    def keep(self, req: RouteRequest, view: ReplicaView) -> bool:
        raise NotImplementedError

    def __call__(self, req: RouteRequest, views: Sequence[ReplicaView]) -> list[ReplicaView]:
        keep = self.keep
        return [v for v in views if keep(req, v)]


class Scorer(Stage):
    uses_prefix: ClassVar[bool] = False  # reads req.cached / req.occupancy: the router must look the prompt up

    def __call__(self, req: RouteRequest, view: ReplicaView) -> float:
        """A rating in [0, 1]; higher is better."""
        raise NotImplementedError

    def explain(self, req: RouteRequest, view: ReplicaView) -> dict[str, float] | None:
        """What the rating is made of, for an operator asking why (``POST /admin/explain/...``); None: nothing
        beyond the rating."""
        return None


class Picker(Stage):
    def __call__(self, req: RouteRequest, scored: list[Scored]) -> Scored:
        raise NotImplementedError

    def tied(self, scored: list[Scored]) -> list[Scored]:
        """The candidates this picker counts as best (it takes one of them)."""
        return _best(scored)


FILTERS: dict[str, type[Filter]] = {}
SCORERS: dict[str, type[Scorer]] = {}
PICKERS: dict[str, type[Picker]] = {}

S = TypeVar("S", bound=type[Stage])


def _registrar(table: dict[str, Any], name: str) -> Callable[[S], S]:
    def register(cls: S) -> S:
        cls.name = name
        table[name] = cls
        return cls
    return register


def register_filter(name: str) -> Callable[[S], S]:
    return _registrar(FILTERS, name)


def register_scorer(name: str) -> Callable[[S], S]:
    return _registrar(SCORERS, name)


def register_picker(name: str) -> Callable[[S], S]:
    return _registrar(PICKERS, name)


def _best(scored: list[Scored]) -> list[Scored]:
    best = max(s for _, s in scored)
    return [pair for pair in scored if best - pair[1] <= 1e-12]
