"""Who the replicas are: the configuration's, and those that join and leave at run time.

Replicas join through ``POST /admin/replicas``, through ``replicas_file`` (read again when it
changes) and, with a Redis index, through any router sharing that Redis: a replica registered on
one router is kept in ``{namespace}:replicas`` and every router adds it within
``membership.sync_interval_s``, including one started later. Leaving is a drain: the replica takes
no new requests, and is removed (with its index entries and metric series) when its last request
ends or after ``membership.drain_timeout_s``.

This module decides membership; :class:`~router.replicas.pool.ReplicaPool` owns the replicas and their
state. Replica keys (``api_key``) are never written to Redis: a replica registered with a key is
reached with it only by the router it was registered on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any, Literal

import yaml

from ..background import Background
from ..config import ConfigError, ReplicaConfig, RouterConfig, replica_from
from ..store import RedisError, Store
from ..load import TableFull
from .pool import ReplicaPool

log = logging.getLogger("kvroute.membership")

Source = Literal["config", "admin", "file", "shared"]


class MembershipError(Exception):
    """A registration that cannot be done; ``status`` is the HTTP answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Membership:
    def __init__(self, config: RouterConfig, pool: ReplicaPool, store: Store | None = None) -> None:
        self.cfg = config.membership
        self.file = config.replicas_file
        self.pool = pool
        self.workers = config.workers
        self.redis = store.client if store is not None else None
        self.key = store.keys.replicas() if store is not None else ""
        self.redis_timeout_s = config.index.background_timeout_s
        self.source: dict[str, Source] = {r.name: "config" for r in config.replicas}
        self.draining: dict[str, float] = {}  # name -> when its drain began
        self._file_stamp: tuple[float, int] | None = None
        self._background = Background()

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Join what is registered already (Redis, the file), then keep watching."""
        await self._sync()
        if self.file is not None or self.redis is not None:
            self._background.spawn(self._loop())

    async def close(self) -> None:
        await self._background.close()

    def describe(self, name: str) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source.get(name, "config")}
        if name in self.draining:
            out["removing"] = True
            out["removing_for_s"] = round(time.monotonic() - self.draining[name], 1)
        return out

    # -- the admin API -------------------------------------------------------------------------

    def _check_shared(self) -> None:
        if self.workers > 1 and self.redis is None:
            raise MembershipError(409, f"this router runs {self.workers} worker processes without a Redis index: "
                                       "register replicas in replicas_file (every worker reads it) or use a Redis "
                                       "index (every worker reads it there)")

    async def register(self, data: Any) -> ReplicaConfig:
        """Add a replica (an admin request's body); with Redis, for every router."""
        self._check_shared()
        try:
            cfg = replica_from(data, "replica")
        except ConfigError as e:
            raise MembershipError(400, str(e)) from None
        if cfg.name in self.pool.replicas:
            raise MembershipError(409, f"replica {cfg.name!r} is already registered")
        if len(self.pool.replicas) >= self.cfg.max_replicas:
            raise MembershipError(409, f"no room for another replica: membership.max_replicas is "
                                       f"{self.cfg.max_replicas}")
        if self.redis is not None:  # shared first: a registration that only one router knows would be lost
            try:
                await self._redis("HSET", self.key, cfg.name, _shared_record(cfg))
            except (RedisError, OSError, TimeoutError) as e:
                raise MembershipError(503, f"replica {cfg.name!r} not registered: the shared Redis did not take it "
                                           f"({e.__class__.__name__})") from None
        self._add(cfg, "admin")
        return cfg

    async def deregister(self, name: str) -> None:
        """Drain and remove a replica; with Redis, on every router."""
        self._check_shared()
        if name not in self.pool.replicas:
            raise MembershipError(404, f"no replica named {name!r}")
        if self.redis is not None:
            try:
                await self._redis("HDEL", self.key, name)
            except (RedisError, OSError, TimeoutError) as e:
                raise MembershipError(503, f"replica {name!r} not removed: the shared Redis did not answer "
                                           f"({e.__class__.__name__})") from None
        self._leave(name)

    async def _redis(self, *args: Any) -> Any:
        assert self.redis is not None
        async with asyncio.timeout(self.redis_timeout_s):
            return await self.redis.execute(*args)

    # -- joining and leaving -------------------------------------------------------------------

    def _add(self, cfg: ReplicaConfig, source: Source) -> bool:
        try:
            self.pool.add(cfg)
        except TableFull as e:
            if source == "admin":
                raise MembershipError(409, str(e)) from None
            log.warning("replica %s not added: %s", cfg.name, e)
            return False
        self.source[cfg.name] = source
        return True

    def _leave(self, name: str) -> None:
        if name in self.draining or name not in self.pool.replicas:
            return
        self.draining[name] = time.monotonic()
        replica = self.pool.replicas[name]
        self.pool.set_drained(replica, True)
        self._background.spawn(self._remove_when_idle(name))

    async def _remove_when_idle(self, name: str) -> None:
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        try:
            while self.pool.load.inflight(name) > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            left = self.pool.load.inflight(name)
            if left:
                log.warning("replica %s removed with %d request(s) still running: membership.drain_timeout_s "
                            "(%g s) passed", name, left, self.cfg.drain_timeout_s, extra={"replica": name})
            await self.pool.remove(name)
        finally:
            self.draining.pop(name, None)
            self.source.pop(name, None)

    # -- watching the file and Redis -----------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.sync_interval_s)
            try:
                await self._sync()
            except Exception:  # keep watching whatever one round met
                log.exception("membership sync failed")

    async def _sync(self) -> None:
        if self.file is not None:
            wanted = self._read_file()
            if wanted is not None:
                self._reconcile("file", wanted)
        if self.redis is not None:
            wanted = await self._read_shared()
            if wanted is not None:
                self._reconcile("shared", wanted)

    def _reconcile(self, source: Source, wanted: dict[str, ReplicaConfig]) -> None:
        for name, cfg in wanted.items():
            if name not in self.pool.replicas:
                self._add(cfg, source)
        # a replica this router registered itself is in Redis too: only what came from there leaves with it
        ours = [n for n, s in self.source.items() if s == source or (source == "shared" and s == "admin")]
        for name in ours:
            if name not in wanted:
                self._leave(name)

    def _read_file(self) -> dict[str, ReplicaConfig] | None:
        """The file's replicas, or None when it did not change or cannot be used (the current set stays)."""
        assert self.file is not None
        try:
            st = os.stat(self.file)
        except OSError as e:
            if self._file_stamp != (0.0, -1):
                log.warning("replicas_file %s: %s; keeping the replicas read before", self.file, e.strerror or e)
                self._file_stamp = (0.0, -1)
            return None
        stamp = (st.st_mtime, st.st_size)
        if stamp == self._file_stamp:
            return None
        self._file_stamp = stamp
        try:
            with open(self.file, encoding="utf-8") as fh:
                data = yaml.safe_load(fh)  # JSON is YAML too
            items = data.get("replicas", []) if isinstance(data, dict) else data
            if items is None:
                items = []
            if not isinstance(items, list):
                raise ConfigError("invalid replica:\n  replicas: expected a list")
            out: dict[str, ReplicaConfig] = {}
            for i, item in enumerate(items):
                cfg = replica_from(item, f"replicas[{i}]")
                out[cfg.name] = cfg
        except (OSError, yaml.YAMLError, ConfigError) as e:
            log.warning("replicas_file %s not used (the replicas read before stay): %s", self.file, e)
            return None
        log.info("replicas_file %s: %d replica(s)", self.file, len(out))
        return out

    async def _read_shared(self) -> dict[str, ReplicaConfig] | None:
        assert self.redis is not None
        try:
            flat = await self._redis("HGETALL", self.key)
        except (RedisError, OSError, TimeoutError) as e:
            log.debug("membership: Redis did not answer (%s)", e)
            return None
        out: dict[str, ReplicaConfig] = {}
        for i in range(0, len(flat or []) - 1, 2):
            name = flat[i].decode(errors="replace") if isinstance(flat[i], bytes) else str(flat[i])
            try:
                cfg = replica_from(json.loads(flat[i + 1]), f"{self.key}[{name}]")
            except (ValueError, ConfigError) as e:
                log.warning("membership: ignoring replica %r in Redis: %s", name, e)
                continue
            out[cfg.name] = cfg
        return out


def _shared_record(cfg: ReplicaConfig) -> str:
    """The replica as other routers read it from Redis: every field but its key."""
    return json.dumps(cfg.model_dump(mode="json", exclude={"api_key"}, exclude_defaults=True), separators=(",", ":"))
