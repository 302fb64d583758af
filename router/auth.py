"""Client and admin keys: ``Authorization: Bearer <key>``, compared in constant time, never logged."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress

from typing import Callable

from . import errors
from .config import AuthConfig


def digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


def bearer(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for k, v in headers:
        if k == b"authorization":
            scheme, _, token = v.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


def _matches(token: bytes | None, digests: list[bytes]) -> bool:
    if token is None:
        return False
    presented = digest(token)
    found = False
    for d in digests:  # no early exit: the time does not tell which key matched
        found |= hmac.compare_digest(presented, d)
    return found


def _is_loopback(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Auth:
    def __init__(self, cfg: AuthConfig, tenant_key: Callable[[bytes], bool] | None = None) -> None:
        self._client = [digest(k.get_secret_value()) for k in cfg.api_keys]
        self._tenant_key = tenant_key  # the tenants' keys are client keys too (router.tenants)
        self._admin = [digest(cfg.admin_key.get_secret_value())] if cfg.admin_key else []

    @property
    def clients_need_key(self) -> bool:
        return bool(self._client)

    def check_client(self, headers: list[tuple[bytes, bytes]]) -> bytes | None:
        """Raises 401 unless the request's key is a client key (where keys are needed); returns the key."""
        token = bearer(headers)
        if self._client and not _matches(token, self._client):
            if token is None or self._tenant_key is None or not self._tenant_key(token):
                raise errors.unauthorized()
        return token

    def check_admin(self, headers: list[tuple[bytes, bytes]], client_host: str | None) -> None:
        """Admin calls need the admin key; with none configured, only loopback clients may call."""
        if not self._admin:
            if not _is_loopback(client_host):
                raise errors.forbidden("the admin API is served to loopback clients only unless auth.admin_key is set")
            return
        token = bearer(headers)
        if _matches(token, self._admin):
            return
        if token is not None and _matches(token, self._client):
            raise errors.forbidden("this key may not use the admin API")
        raise errors.unauthorized("missing or invalid admin key")
