"""Replica lifecycle events, published by the pool for whoever subscribes (index, metrics, logs)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Union

log = logging.getLogger("kvroute.events")


@dataclass(frozen=True)
class ReplicaReady:
    replica: str


@dataclass(frozen=True)
class ReplicaUnready:
    replica: str
    reason: str


@dataclass(frozen=True)
class ReplicaRestarted:
    """The replica's process changed: its KV cache is empty now."""

    replica: str
    previous_start_time: float | None
    start_time: float | None


@dataclass(frozen=True)
class ReplicaAdded:
    """A replica joined at run time (admin API, replicas_file, another router through Redis)."""

    replica: str


@dataclass(frozen=True)
class ReplicaRemoved:
    """The replica is being removed (drained first): forget what it held. Published while it is still in the pool."""

    replica: str


@dataclass(frozen=True)
class ReplicaModels:
    """The models a replica serves changed: (served name, the ``root`` it loaded them from, the base model it
    adapts (``parent``, for a LoRA adapter)), each as the replica says."""

    replica: str
    models: tuple[tuple[str, str | None, str | None], ...]


Event = Union[ReplicaReady, ReplicaUnready, ReplicaRestarted, ReplicaAdded, ReplicaRemoved, ReplicaModels]
Listener = Callable[[Event], None]


class EventBus:
    """Synchronous fan-out: listeners run in the publisher's task and must not block."""

    def __init__(self) -> None:
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def publish(self, event: Event) -> None:
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # one broken listener must not stop the others
                log.exception("event listener failed on %s", type(event).__name__)
