"""Logging set-up: plain or JSON lines, written by a background thread so the event loop never blocks on I/O.

The event loop's share of a log line is kept small, since the gateway logs every request: no
caller lookup (file and line are not logged), and records go onto a queue as they are; the writer
thread formats them and writes whatever has piled up in one write. Record arguments are
immutable values (strings, numbers), so formatting them later is safe.
"""

from __future__ import annotations

import atexit
import json
import logging
import logging.handlers
import queue
import sys
import threading
import time
from typing import TextIO

# attributes the gateway passes with ``extra=`` that belong in every line that has them
_FIELDS = ("request_id", "replica", "model", "status", "outcome", "attempts", "ttfb_ms", "upstream_ttfb_ms", "duration_ms",
           "stream", "prompt_tokens", "cached_tokens", "best_cached_tokens", "decision", "prefill_replica",
           "prefill_cached_tokens", "prefill_ms")
_BATCH = 512  # most lines written at once
_PAUSE_S = 0.02  # the writer's rest after each write: it wakes at most 50 times a second, not once per line


class _Clock:
    """Timestamps formatted once per second, not once per line."""

    def __init__(self, fmt: str, utc: bool = False) -> None:
        self.fmt = fmt
        self.utc = utc
        self._second = -1
        self._text = ""

    def __call__(self, created: float) -> str:
        second = int(created)
        if second != self._second:
            self._second = second
            self._text = time.strftime(self.fmt, time.gmtime(second) if self.utc else time.localtime(second))
        return self._text


class JsonFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self._clock = _Clock("%Y-%m-%dT%H:%M:%S", utc=True)

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": f"{self._clock(record.created)}.{int(record.msecs):03d}Z",
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


# control characters in what a client sent (a model name, an id) are shown escaped: a newline must not
# start a line of its own that reads like the router's
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(32), 127)} | {10: "\\n", 13: "\\r", 9: "\\t"}


def one_line(text: str) -> str:
    return text.translate(_ESCAPES) if not text.isprintable() else text


class PlainFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self._clock = _Clock("%Y-%m-%d %H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        line = (f"{self._clock(record.created)},{int(record.msecs):03d} {record.levelname} {record.name}: "
                f"{one_line(record.getMessage())}")
        rid = getattr(record, "request_id", None)
        if rid:
            line += f" [request_id={one_line(str(rid))}]"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _QueueHandler(logging.handlers.QueueHandler):
    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record  # formatted by the writer thread


class _Writer:
    """The thread that formats queued records and writes them, many per write."""

    def __init__(self, q: "queue.SimpleQueue[logging.LogRecord | None]", formatter: logging.Formatter,
                 stream: TextIO) -> None:
        self.queue = q
        self.formatter = formatter
        self.stream = stream
        self.thread = threading.Thread(target=self._run, name="kvroute-log", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        q = self.queue
        fmt = self.formatter.format
        while True:
            records = [q.get()]
            while len(records) < _BATCH:
                try:
                    records.append(q.get_nowait())
                except queue.Empty:
                    break
            lines = []
            done = False
            for r in records:
                if r is None:
                    done = True
                    continue
                try:
                    lines.append(fmt(r))
                except Exception:  # a record that cannot be formatted must not stop the log
                    lines.append(f"(unformattable log record from {r.name})")
            if lines:
                try:
                    self.stream.write("\n".join(lines) + "\n")
                    self.stream.flush()
                except (OSError, ValueError):
                    pass
            if done:
                return
            # woken per record, the thread would take the interpreter from the event loop once per request
            time.sleep(_PAUSE_S)

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join(5)


_writer: _Writer | None = None


def shutdown() -> None:
    """Write out what is queued and stop the writer thread (also run at exit)."""
    global _writer
    writer, _writer = _writer, None
    if writer is not None and writer.thread.is_alive():
        writer.stop()


atexit.register(shutdown)


def _expected_at_shutdown(record: logging.LogRecord) -> bool:
    """uvicorn reports the streams still open when shutdown_grace_s ends at ERROR: an expected event, a warning."""
    if record.levelno == logging.ERROR and isinstance(record.msg, str) and \
            record.msg.startswith("Cancel %s running task(s)"):
        record.levelno, record.levelname = logging.WARNING, "WARNING"
    return True


def setup(level: str = "info", json_format: bool = False) -> None:
    global _writer
    shutdown()
    # the formatters use none of these: skip finding the caller's file and line, thread and process
    logging._srcfile = None  # type: ignore[attr-defined]
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    q: "queue.SimpleQueue[logging.LogRecord | None]" = queue.SimpleQueue()
    _writer = _Writer(q, JsonFormatter() if json_format else PlainFormatter(), sys.stderr)
    root = logging.getLogger()
    root.handlers[:] = [_QueueHandler(q)]  # type: ignore[arg-type]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    logging.getLogger("uvicorn.error").addFilter(_expected_at_shutdown)
    logging.getLogger("uvicorn.access").disabled = True
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)
