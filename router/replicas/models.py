"""What a replica's ``/v1/models`` says it serves, kept bounded.

A replica may list a base model and its LoRA adapters, and the list may change at every health check (vLLM
loading and unloading adapters): at most :data:`MAX_MODELS` ids per replica are kept, each at most
:data:`MAX_ID_CHARS` characters, each card cut to vLLM's own fields and at most :data:`MAX_CARD_BYTES`.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from .record import Replica

log = logging.getLogger("kvroute.pool")

MAX_MODELS = 1024  # model ids kept per replica (a base model and its LoRA adapters); ids past this are ignored
MAX_ID_CHARS = 1024  # longer model ids are ignored (clients cannot name them either)
MAX_CARD_BYTES = 4096
_CARD_FIELDS = ("id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission")

Roots = tuple[tuple[str, str | None], ...]


def cards_from(r: Replica, payload: Any) -> dict[str, dict[str, Any]]:
    """Model id -> card, from ``r``'s /v1/models answer: at most :data:`MAX_MODELS` (warned once per replica)."""
    cards: dict[str, dict[str, Any]] = {}
    listed = (payload or {}).get("data", []) if isinstance(payload, dict) else []
    for card in listed if isinstance(listed, list) else []:
        if isinstance(card, dict) and isinstance(card.get("id"), str) and 0 < len(card["id"]) <= MAX_ID_CHARS:
            if len(cards) >= MAX_MODELS:
                if not r.models_capped:
                    r.models_capped = True
                    log.warning("replica %s lists more than %d models: the rest are ignored", r.name, MAX_MODELS,
                                extra={"replica": r.name})
                break
            cards[card["id"]] = _small_card(card)
    return cards


def roots(cards: dict[str, dict[str, Any]]) -> Roots:
    """(served name, root folder or hub name) of each model card."""
    return tuple(sorted((m, c["root"] if isinstance(c.get("root"), str) else None) for m, c in cards.items()))


def _small_card(card: dict[str, Any]) -> dict[str, Any]:
    """A model card with vLLM's fields only, and only its id, object and root where those weigh too much."""
    out = {k: card[k] for k in _CARD_FIELDS if k in card}
    try:
        weight = len(orjson.dumps(out, default=str))
    except TypeError:  # nested past what a card needs (orjson's 254 levels)
        weight = MAX_CARD_BYTES + 1
    if weight > MAX_CARD_BYTES:
        root = card.get("root")
        out = {"id": card["id"], "object": "model",
               "root": root if isinstance(root, str) and len(root) <= MAX_ID_CHARS else None}
    return out
