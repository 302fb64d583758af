"""What every configuration section shares: strictness, error messages that name the field, masked URLs."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, ValidationError


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


_PASSWORD_IN_URL = re.compile(r"(://[^:/@\s]*:)[^@\s]*@")


def mask_url(text: str) -> str:
    """``text`` with the password of any URL in it replaced by ``***``."""
    return _PASSWORD_IN_URL.sub(r"\1***@", text)


class ConfigError(Exception):
    """Raised with a message that names each invalid field."""


def format_validation_error(err: ValidationError, title: str = "invalid configuration", where: str | None = None,
                             longest: int | None = None) -> str:
    """One line per invalid field, named by its path (under ``where``), with the value given unless it is a
    key or a structure (cut to ``longest`` characters)."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in ((where,) if where else ()) + tuple(e["loc"])) or "(config)"
        msg = e["msg"].removeprefix("Value error, ")
        got = e.get("input")
        if isinstance(got, str):
            got = mask_url(got)  # a URL's password stays out of messages and logs
        shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {repr(got)[:longest]})"
        if "api_key" in loc or "admin_key" in loc:
            shown = ""
        lines.append(f"  {loc}: {msg}{shown}")
    return f"{title}:\n" + "\n".join(lines)
