"""Handing memory freed in bulk back to the operating system.

CPython returns the memory of freed objects to the C allocator, and glibc's allocator keeps much of it
(in the heaps of the threads that allocated it) rather than giving it back. After the router forgets a lot
at once (a replica's thousand churned model ids, a replica removed), its RSS would then stay at the peak.
``malloc_trim`` gives the free pages back; it runs on a thread, a second after the last bulk release, so
that a burst of them costs one trim. Elsewhere than glibc (musl, macOS) it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from typing import Any

_DELAY_S = 1.0


def _malloc_trim() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def trim() -> bool:
    """Give the allocator's free pages back now (blocking: call it on a thread); whether anything was given."""
    return bool(_TRIM(0)) if _TRIM is not None else False


class FreedMemory:
    """Noted bulk releases; one trim follows a second after the last of a burst (off the event loop)."""

    def __init__(self) -> None:
        self._pending: asyncio.TimerHandle | None = None
        self._running: asyncio.Task[bool] | None = None

    def note(self) -> None:
        if _TRIM is None:
            return
        loop = asyncio.get_running_loop()
        if self._pending is not None:
            self._pending.cancel()
        self._pending = loop.call_later(_DELAY_S, self._start)

    def _start(self) -> None:
        self._pending = None
        if self._running is None or self._running.done():
            self._running = asyncio.get_running_loop().create_task(asyncio.to_thread(trim))

    async def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
        if self._running is not None:
            await asyncio.gather(self._running, return_exceptions=True)
