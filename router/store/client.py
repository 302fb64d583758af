"""One client for the shared state: a Redis server, or a Redis Cluster, found at the first call.

URLs: ``redis://[[user]:password@]host[:port][,host:port...][/db]``, ``rediss://`` (TLS),
``unix:///path?db=N``. Several ``host:port`` name seed nodes of a cluster; one is enough.

At its first call the client asks a seed ``CLUSTER SLOTS``. A server without cluster support
answers an error, and the client then sends every command to that server over one pipelined
connection (:class:`router.store.resp.Node`), as before. A cluster's answer is its slot map: the
client keeps one node (one connection) per master and sends each command to the master of its
first key's slot (CRC16 of the key's ``{hash tag}``, like every Redis Cluster client). Every
multi-key command and script of kvroute names keys of one hash tag, so it stays in one slot.

Topology changes, handled within the caller's time limit:

- ``MOVED slot host:port`` (the slot has a new master): the map is corrected at once, refreshed
  in the background, and the command sent to the new master.
- ``ASK slot host:port`` (the slot is being migrated): ``ASKING`` and the command, once, at the
  node named.
- ``TRYAGAIN`` / ``CLUSTERDOWN`` (a migration or a failover under way): a short pause, the map
  refreshed, the command sent again.
- ``NOSCRIPT`` (a node that never saw the script, e.g. a promoted replica): the script is loaded
  on that node and the command sent again.
- A node that cannot be reached (a master killed): the call fails at once, as with one Redis down,
  and the map is refreshed from any node that answers, so that the replica promoted in its place
  is used as soon as the cluster has promoted it. Callers fall back to their local view meanwhile.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from binascii import crc_hqx
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from .resp import Address, ConnectionLost, Node, RedisError, ReplyError

log = logging.getLogger("kvroute.store")

SLOTS = 16384
_MAX_REDIRECTS = 5
_REFRESH_SPACING_S = 0.1  # the map is asked for at most this often
_SCRIPT_COMMANDS = frozenset({"EVAL", "EVALSHA", "EVAL_RO", "EVALSHA_RO", "FCALL", "FCALL_RO"})
_KEYLESS = frozenset({"PING", "SCRIPT", "INFO", "CLUSTER", "TIME", "ECHO", "DBSIZE", "FLUSHALL", "FLUSHDB",
                      "CONFIG", "CLIENT", "COMMAND", "ASKING", "READONLY", "AUTH", "SELECT", "HELLO"})
# what a server without cluster support (or a user not allowed to ask) answers to CLUSTER SLOTS
_NOT_A_CLUSTER = ("cluster support disabled", "unknown command", "NOPERM", "unknown subcommand")


def slot(key: bytes | str) -> int:
    """The cluster slot of a key: CRC16 (XMODEM) of its hash tag (the first non-empty ``{...}``), or all of it."""
    k = key.encode() if isinstance(key, str) else key
    start = k.find(b"{")
    if start >= 0:
        end = k.find(b"}", start + 1)
        if end > start + 1:
            k = k[start + 1:end]
    return crc_hqx(k, 0) & (SLOTS - 1)


def key_of(args: tuple[Any, ...]) -> Any:
    """The key a command is routed by (its first), or None for a command on no key."""
    cmd = args[0].decode() if isinstance(args[0], bytes) else str(args[0])
    cmd = cmd.upper()
    if cmd in _SCRIPT_COMMANDS:
        return args[3] if len(args) > 3 and int(args[2]) > 0 else None
    if cmd in _KEYLESS or len(args) < 2:
        return None
    return args[1]


def parse_url(url: str) -> list[Address]:
    """The seed addresses a URL names, with the credentials, TLS and database they share."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"unsupported Redis URL scheme {parts.scheme!r}")
    query = parse_qs(parts.query)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, _, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if ":" in userinfo else None
    if parts.scheme == "unix":
        db = int(query.get("db", ["0"])[0])
        return [Address(path=parts.path, username=username, password=password, db=db)]
    db = int(parts.path.strip("/") or query.get("db", ["0"])[0])
    seeds = []
    for item in hosts.split(","):
        host, port = _host_port(item.strip(), 6379)
        seeds.append(Address(host, port, None, parts.scheme == "rediss", username, password, db))
    return seeds


def _host_port(text: str, default_port: int) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:port
        host, _, rest = text[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else default_port
    host, sep, port = text.rpartition(":")
    if not sep or ":" in host:  # no port, or a bare IPv6 address
        return text or "127.0.0.1", default_port
    number = int(port)
    if not 0 < number < 65536:
        raise ValueError(f"port {number} out of range")
    return host or "127.0.0.1", number


class Redis:
    """A Redis server or a Redis Cluster behind one client; see the module's docstring."""

    def __init__(self, url: str, connect_timeout: float = 1.0, max_pending: int = 4096, stall_s: float = 5.0) -> None:
        self.seeds = parse_url(url)
        self.connect_timeout = connect_timeout
        self._max_pending = max_pending
        self._stall_s = stall_s
        self._scripts: dict[bytes, bytes] = {}  # sha1 hex -> source
        self._nodes: dict[Address, Node] = {}
        self._single: Node | None = None  # a server without cluster support
        self._slots: list[Node | None] | None = None  # a cluster: the master of every slot
        self._masters: list[Node] = []
        self._discovering: asyncio.Future[None] | None = None
        self._refreshing: asyncio.Task[None] | None = None
        self._refreshed_at = 0.0

    @property
    def mode(self) -> str:
        """``standalone``, ``cluster``, or ``unknown`` before the first call reached a server."""
        return "standalone" if self._single is not None else "cluster" if self._slots is not None else "unknown"

    @property
    def masters(self) -> list[str]:
        """The servers commands go to (one, or a cluster's masters)."""
        return [str(self._single.address)] if self._single is not None else [str(n.address) for n in self._masters]

    # -- commands ------------------------------------------------------------------------------

    async def execute(self, *args: Any) -> Any:
        """Send one command and return its reply (bytes, int, None or lists of them)."""
        single = self._single
        if single is not None:
            return await single.execute(*args)
        if self._slots is None:
            await self._discover()
            if self._single is not None:
                return await self._single.execute(*args)
        return await self._cluster_call(args)

    def script(self, source: str) -> bytes:
        """Register a Lua script; returns its SHA1 for :meth:`evalsha`."""
        sha = hashlib.sha1(source.encode()).hexdigest().encode()
        self._scripts[sha] = source.encode()
        return sha

    async def evalsha(self, sha: bytes, keys: list[str], args: list[Any]) -> Any:
        """Run a registered script; loads it first where the server does not know it (restarted, flushed, promoted)."""
        try:
            return await self.execute("EVALSHA", sha, len(keys), *keys, *args)
        except ReplyError as e:
            if not str(e).startswith("NOSCRIPT") or self._single is None:
                raise
        await self._single.execute("SCRIPT", "LOAD", self._scripts[sha])
        return await self._single.execute("EVALSHA", sha, len(keys), *keys, *args)

    async def load_scripts(self) -> None:
        """Load every registered script on every master, so that first calls pay no set-up."""
        if self._single is None and self._slots is None:
            await self._discover()
        for node in [self._single] if self._single is not None else list(self._masters):
            for source in self._scripts.values():
                await node.execute("SCRIPT", "LOAD", source)

    async def close(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
            self._refreshing = None
        for node in self._nodes.values():
            node.drop()
        self._nodes.clear()

    # -- the cluster ---------------------------------------------------------------------------

    def _node(self, address: Address) -> Node:
        node = self._nodes.get(address)
        if node is None:
            node = self._nodes[address] = Node(address, self.connect_timeout, self._max_pending, self._stall_s)
        return node

    def _master_for(self, key: Any) -> Node:
        assert self._slots is not None
        if key is None:
            if not self._masters:
                raise RedisError("the Redis Cluster has no master")
            return random.choice(self._masters)
        node = self._slots[slot(key)]
        if node is None:
            self._refresh_soon()
            raise RedisError(f"slot {slot(key)} of the Redis Cluster has no master")
        return node

    async def _cluster_call(self, args: tuple[Any, ...]) -> Any:
        key = key_of(args)
        node = self._master_for(key)
        asking = False
        for attempt in range(_MAX_REDIRECTS + 1):
            try:
                return await (node.execute_asking(*args) if asking else node.execute(*args))
            except ReplyError as e:
                kind, _, rest = str(e).partition(" ")
                asking = False
                if kind in ("MOVED", "ASK"):
                    number, _, where = rest.partition(" ")
                    host, port = _host_port(where, 6379)
                    target = self._node(node.address.at(host or node.address.host, port))
                    if kind == "MOVED":
                        self._slots[int(number)] = target  # type: ignore[index]
                        self._refresh_soon()
                    else:
                        asking = True
                    node = target
                elif kind in ("TRYAGAIN", "CLUSTERDOWN"):
                    self._refresh_soon()
                    await asyncio.sleep(0.01 * (attempt + 1))
                    node = self._master_for(key)
                elif kind == "NOSCRIPT" and args[0] in ("EVALSHA", b"EVALSHA") and args[1] in self._scripts:
                    await node.execute("SCRIPT", "LOAD", self._scripts[args[1]])
                else:
                    raise
            except ConnectionLost:
                self._refresh_soon()  # a master gone: its replica is promoted, and found by the refresh
                raise
        raise RedisError(f"the Redis Cluster redirected one command more than {_MAX_REDIRECTS} times")

    async def _discover(self) -> None:
        """The first call finds what the URL names; concurrent callers wait for the same answer."""
        if self._discovering is None:
            fut = self._discovering = asyncio.ensure_future(self._topology(self.seeds, first=True))

            def done(f: asyncio.Future[None]) -> None:
                self._discovering = None
                if not f.cancelled():
                    f.exception()  # retrieved: whoever waited has it

            fut.add_done_callback(done)
        await asyncio.shield(self._discovering)

    def _refresh_soon(self) -> None:
        now = time.monotonic()
        if self._refreshing is not None or now - self._refreshed_at < _REFRESH_SPACING_S or self._slots is None:
            return
        self._refreshed_at = now
        known = [n.address for n in self._masters]
        random.shuffle(known)
        self._refreshing = asyncio.ensure_future(self._refresh(known + self.seeds))

    async def _refresh(self, addresses: list[Address]) -> None:
        try:
            await self._topology(addresses, first=False)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.debug("the Redis Cluster's slot map could not be refreshed (%s)", e)
        finally:
            self._refreshing = None
            self._refreshed_at = time.monotonic()

    async def _topology(self, addresses: list[Address], first: bool) -> None:
        error: Exception = RedisError("no Redis address given")
        seen: set[Address] = set()
        for address in addresses:
            if address in seen:
                continue
            seen.add(address)
            node = self._node(address)
            try:
                async with asyncio.timeout(self.connect_timeout):
                    reply = await node.execute("CLUSTER", "SLOTS")
            except ReplyError as e:
                if address.db and "SELECT" in str(e):
                    raise RedisError(f"a Redis Cluster has database 0 only; the URL asks for database "
                                     f"{address.db}") from None
                if first and any(text in str(e) for text in _NOT_A_CLUSTER):
                    self._single = node
                    log.info("shared state on Redis at %s", address)
                    return
                error = e
                continue
            except (RedisError, OSError, TimeoutError) as e:
                error = e
                continue
            self._apply_map(address, reply)
            return
        raise error if isinstance(error, RedisError) else ConnectionLost(f"no Redis node answered ({error})")

    def _apply_map(self, asked: Address, reply: list[Any]) -> None:
        if asked.db:
            raise RedisError(f"a Redis Cluster has database 0 only; the URL asks for database {asked.db}")
        slots: list[Node | None] = [None] * SLOTS
        masters: dict[Address, Node] = {}
        for entry in reply:
            start, end, master = int(entry[0]), int(entry[1]), entry[2]
            host = master[0].decode() if master[0] else asked.host
            address = asked.at(host if host != "?" else asked.host, int(master[1]))
            node = masters.get(address) or self._node(address)
            masters[address] = node
            for s in range(start, min(end, SLOTS - 1) + 1):
                slots[s] = node
        before = {n.address for n in self._masters}
        self._slots, self._masters = slots, list(masters.values())
        if set(masters) != before:
            uncovered = slots.count(None)
            log.info("shared state on a Redis Cluster of %d masters (%s)%s", len(masters),
                     ", ".join(sorted(str(a) for a in masters)),
                     f"; {uncovered} slots have no master" if uncovered else "")
        for address in [a for a in self._nodes if a not in masters and a not in self.seeds]:
            self._nodes.pop(address).drop()  # a node gone from the map (failed over, removed)
