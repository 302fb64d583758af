"""Logging set-up: plain or JSON lines, written by a background thread so the event loop never blocks on I/O."""

from __future__ import annotations

import atexit
import json
import logging
import logging.handlers
import queue
import sys
import time

# attributes the gateway passes with ``extra=`` that belong in every line that has them
_FIELDS = ("request_id", "replica", "model", "status", "outcome", "attempts", "ttfb_ms", "upstream_ttfb_ms", "duration_ms",
           "stream", "prompt_tokens", "cached_tokens", "decision")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for f in _FIELDS:
            v = getattr(record, f, None)
            if v is not None:
                out[f] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"))


class PlainFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        rid = getattr(record, "request_id", None)
        return f"{line} [request_id={rid}]" if rid else line


_listener: logging.handlers.QueueListener | None = None


def shutdown() -> None:
    """Write out what is queued and stop the writer thread (also run at exit)."""
    global _listener
    listener, _listener = _listener, None
    if listener is not None and listener._thread is not None:  # type: ignore[attr-defined]
        listener.stop()


atexit.register(shutdown)


def setup(level: str = "info", json_format: bool = False) -> None:
    global _listener
    shutdown()
    sink = logging.StreamHandler(sys.stderr)
    sink.setFormatter(JsonFormatter() if json_format else PlainFormatter())
    q: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    _listener = logging.handlers.QueueListener(q, sink, respect_handler_level=False)
    _listener.start()
    root = logging.getLogger()
    root.handlers[:] = [logging.handlers.QueueHandler(q)]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    logging.getLogger("uvicorn.access").disabled = True
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)
