"""Conversations between turns, across router instances: what each router answered and continued, told to
the others.

A conversation's turns need not come through one router: a load balancer in front of several sends each
request to any of them. Without this, the router that answered a turn keeps its tail waiting until
``conversations.window_s`` runs out, since the next turn went elsewhere, and the router that gets the next
turn does not know a conversation waits there: each weighs a fraction of the requests expected back, some of
them long gone. With a Redis index (and ``shared_load.enabled``) every router appends what changed in its
table (:class:`router.conversations.Conversations`, hashes and replica names only) to one stream,
``NS:{NS:load}:conversations`` (the load picture's hash tag: one slot in Redis Cluster), every
``shared_load.interval_s``, and reads the others' entries in the same round trip. The stream keeps its last
20,000 entries and expires when no router writes to it for ``conversations.window_s``.

Advice, like the load picture: when Redis does not answer, each router goes on with its own table, and what
changed meanwhile is not told (the journal keeps the last :data:`~router.conversations.JOURNAL_MAX`).
"""

from __future__ import annotations

import asyncio
import logging
import struct
from typing import Any

from .background import Background
from .config import SharedLoadConfig
from .conversations import Answered, Change, Conversations, Resumed
from .load import LoadTable
from .store import Store

log = logging.getLogger("kvroute.shared_conversations")

# KEYS[1] the stream. ARGV: this router's id, the last entry id read ('' the first time: start from the end),
# the stream's time to live (ms), then entries to append. Returns the last entry id read, then the other
# routers' entries since the one given (at most 2,000 per call).
_SYNC = """
local key, id, after = KEYS[1], ARGV[1], ARGV[2]
for i = 4, #ARGV do
  redis.call('XADD', key, 'MAXLEN', '~', 20000, '*', 'r', id, 'e', ARGV[i])
end
if #ARGV >= 4 then redis.call('PEXPIRE', key, ARGV[3]) end
if after == '' then
  local last = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)
  if #last == 0 then return {'0-0'} end
  return {last[1][1]}
end
local out = {after}
for _, entry in ipairs(redis.call('XRANGE', key, '(' .. after, '+', 'COUNT', 2000)) do
  out[1] = entry[1]
  local fields = entry[2]
  if fields[2] ~= id then out[#out + 1] = fields[4] end
end
return out
"""

_HEAD = struct.Struct(">cdH")  # b"a", wall time, length of the replica's name; then the name, then 8 bytes a tail
_RESUMED = struct.Struct(">c?Q")  # b"c", grew, tail


def encode(change: Change) -> bytes:
    if isinstance(change, Resumed):
        return _RESUMED.pack(b"c", change.grows, change.tail)
    name = change.replica.encode()
    return _HEAD.pack(b"a", change.at, len(name)) + name + struct.pack(f">{len(change.tails)}Q", *change.tails)


def decode(raw: bytes) -> Change | None:
    """One entry, or None for what is not one (the stream is shared: nothing read from it is trusted)."""
    try:
        if raw[:1] == b"c" and len(raw) == _RESUMED.size:
            _, grows, tail = _RESUMED.unpack(raw)
            return Resumed(tail, grows)
        if raw[:1] == b"a" and len(raw) >= _HEAD.size:
            _, at, size = _HEAD.unpack_from(raw)
            rest = raw[_HEAD.size + size:]
            if len(rest) % 8 or not rest or len(raw) < _HEAD.size + size:
                return None
            name = raw[_HEAD.size:_HEAD.size + size].decode()
            return Answered(name, struct.unpack(f">{len(rest) // 8}Q", rest), at)
    except (struct.error, UnicodeDecodeError):
        pass
    return None


class SharedConversations:
    def __init__(self, store: Store, conversations: Conversations, load: LoadTable, cfg: SharedLoadConfig,
                 router_id: str) -> None:
        self.redis = store.client
        self.key = store.keys.conversations()
        self.conversations = conversations
        self.load = load
        self.cfg = cfg
        self.id = router_id
        self._script = self.redis.script(_SYNC)
        self._after = ""
        self._down = False
        self._background = Background()

    async def start(self) -> None:
        self._background.spawn(self._loop())

    async def close(self) -> None:
        await self._background.close()

    async def _loop(self) -> None:
        while True:
            try:
                async with asyncio.timeout(max(1.0, self.cfg.interval_s * 5)):
                    await self.sync()
                if self._down:
                    self._down = False
                    log.info("shared conversations: Redis answers again")
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if not self._down:
                    self._down = True
                    log.warning("shared conversations: Redis did not answer (%s); each router weighs only the "
                                "conversations it answered until it does", e.__class__.__name__)
            await asyncio.sleep(self.cfg.interval_s)

    async def sync(self) -> None:
        """One round trip: this router's changes out, the others' in."""
        mine = [encode(c) for c in self.conversations.take_journal()]
        ttl_ms = int(self.conversations.window_s * 1000)
        out: list[Any] = await self.redis.evalsha(self._script, [self.key], [self.id, self._after, ttl_ms, *mine])
        if not out:
            return
        self._after = out[0].decode() if isinstance(out[0], bytes) else str(out[0])
        for raw in out[1:]:
            change = decode(raw) if isinstance(raw, bytes) else None
            if change is None or (isinstance(change, Answered) and change.replica not in self.load):
                continue  # not an entry, or a replica this router does not know
            self.conversations.heard(change)
