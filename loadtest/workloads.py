"""Request sequences used by the tests and the benchmarks, deterministic for a seed."""

from __future__ import annotations

import random
from dataclasses import dataclass

_WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
          "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def text(rng: random.Random, n_bytes: int) -> str:
    out: list[str] = []
    size = 0
    while size < n_bytes:
        w = rng.choice(_WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_bytes]


@dataclass(frozen=True)
class Request:
    group: int
    messages: list[dict[str, str]]


def shared_prefix(groups: int, prompts_per_group: int, system_bytes: int, question_bytes: int,
                  seed: int = 0) -> list[Request]:
    """Groups of prompts sharing a long system prompt, each with its own short question.

    Rounds go over the groups in a new random order each time, so no router can profit from a
    fixed arrival pattern.
    """
    rng = random.Random(seed)
    systems = [f"group {g}: " + text(rng, system_bytes) for g in range(groups)]
    out = []
    for p in range(prompts_per_group):
        order = list(range(groups))
        rng.shuffle(order)
        for g in order:
            out.append(Request(g, [{"role": "system", "content": systems[g]},
                                   {"role": "user", "content": f"q{p}: " + text(rng, question_bytes)}]))
    return out
