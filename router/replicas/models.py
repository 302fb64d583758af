"""What a replica's ``/v1/models`` says it serves, kept bounded.

A replica may list a base model and its LoRA adapters, and the list may change at every health check (vLLM
loading and unloading adapters): at most :data:`MAX_MODELS` ids per replica are kept, each at most
:data:`MAX_ID_CHARS` characters, each card cut to vLLM's own fields and at most :data:`MAX_CARD_BYTES`. A
listing longer than that is not parsed past its first :data:`MAX_MODELS` cards where its layout is vLLM's (see
:func:`cards_from`): the cards it would drop are never built, so a replica listing thousands of adapters at every
check costs what a thousand do.
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

Listing = tuple[tuple[str, str | None, str | None], ...]


_CARD_START = b'},{"id":'  # between two cards of vLLM's compact listing (a card's first field is its id)


def cards_from(r: Replica, body: bytes) -> dict[str, dict[str, Any]]:
    """Model id -> card, from ``r``'s /v1/models answer: at most :data:`MAX_MODELS` (warned once per replica).
    Raises ``ValueError`` for a body that is not JSON."""
    head = _head(body)
    if head is not None:
        cards, _ = _cards(head)
        if len(cards) == MAX_MODELS:  # all of the first cards were usable: the rest would be dropped anyway
            _warn_capped(r)
            return cards
    cards, more = _cards(orjson.loads(body))
    if more:
        _warn_capped(r)
    return cards


def _head(body: bytes) -> Any:
    """The answer's first :data:`MAX_MODELS` cards, where it lists more in vLLM's layout
    (``{"object":"list","data":[{"id":...},{"id":...},...]}``), else None.

    The body is cut just after the last card kept and closed (``]}``). A cut anywhere but between two cards of
    the top-level ``data`` list leaves brackets unbalanced (not JSON), and any other result than that many cards
    under ``data`` is not taken."""
    at = -1
    for _ in range(MAX_MODELS):
        at = body.find(_CARD_START, at + 1)
        if at < 0:
            return None  # at most MAX_MODELS cards in this layout, or another layout
    try:
        head = orjson.loads(body[:at + 1] + b"]}")
    except orjson.JSONDecodeError:
        return None
    listed = head.get("data") if isinstance(head, dict) else None
    return head if isinstance(listed, list) and len(listed) == MAX_MODELS else None


def _cards(payload: Any) -> tuple[dict[str, dict[str, Any]], bool]:
    """The first :data:`MAX_MODELS` usable cards of a parsed answer, and whether it lists more."""
    cards: dict[str, dict[str, Any]] = {}
    listed = (payload or {}).get("data", []) if isinstance(payload, dict) else []
    for card in listed if isinstance(listed, list) else []:
        if isinstance(card, dict) and isinstance(card.get("id"), str) and 0 < len(card["id"]) <= MAX_ID_CHARS:
            if len(cards) >= MAX_MODELS:
                return cards, True
            cards[card["id"]] = _small_card(card)
    return cards, False


def _warn_capped(r: Replica) -> None:
    if not r.models_capped:
        r.models_capped = True
        log.warning("replica %s lists more than %d models: the rest are ignored", r.name, MAX_MODELS,
                    extra={"replica": r.name})


def listing(cards: dict[str, dict[str, Any]]) -> Listing:
    """(served name, root folder or hub name, parent) of each model card: a LoRA adapter names its base model as
    its ``parent``, whose tokenizer vLLM uses for it."""
    return tuple(sorted((m, _text(c.get("root")), _text(c.get("parent"))) for m, c in cards.items()))


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS else None


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
