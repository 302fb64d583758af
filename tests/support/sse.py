"""Reading server-sent event bodies."""

from __future__ import annotations

import json


def sse_events(raw: bytes) -> list[str]:
    """The data lines of an SSE body, in order."""
    return [block[len(b"data: "):].decode() for block in raw.split(b"\n\n") if block.startswith(b"data: ")]


def sse_json(raw: bytes) -> list[dict]:
    return [json.loads(e) for e in sse_events(raw) if e != "[DONE]"]
