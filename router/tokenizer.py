"""A model's own tokenizer and chat template, loaded from local files (never downloaded).

With one configured, prompt keys are built from real token blocks, as the replica's KV cache is:
completions prompts are encoded with the tokenizer's special tokens (BOS), chat messages are
rendered with the model's chat template (with the generation prompt) and encoded without adding
special tokens again, as vLLM does.

``path`` is a ``tokenizer.json`` file, or a model folder holding ``tokenizer.json`` and,
optionally, ``tokenizer_config.json`` (``chat_template``, ``bos_token``, ``eos_token``) or
``chat_template.jinja``. :func:`find_local` finds a served model's folder on this host.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence


class TokenizerError(Exception):
    pass


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in some configs
        value = value.get("content")
    return value if isinstance(value, str) else None


class LocalTokenizer:
    def __init__(self, path: str | Path) -> None:
        try:
            import tokenizers
        except ImportError:
            raise TokenizerError("a tokenizer needs the 'tokenizers' package: pip install tokenizers") from None
        path = Path(path)
        folder = path if path.is_dir() else path.parent
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise TokenizerError(f"no tokenizer.json at {path}")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:
            raise TokenizerError(f"cannot load {file}: {e}") from None
        config: dict[str, Any] = {}
        cfg_file = folder / "tokenizer_config.json"
        if cfg_file.is_file():
            config = json.loads(cfg_file.read_text())
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        self.bos_token = _token_text(config.get("bos_token")) or ""
        self.eos_token = _token_text(config.get("eos_token")) or ""
        self._template = None
        if isinstance(template, str):
            try:
                from jinja2.sandbox import ImmutableSandboxedEnvironment
            except ImportError:
                raise TokenizerError("a chat template needs the 'jinja2' package: pip install jinja2") from None
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(template)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(self, messages: Sequence[Any]) -> str:
        if self._template is None:
            raise TokenizerError("this tokenizer has no chat template")
        return self._template.render(messages=list(messages), add_generation_prompt=True,
                                     bos_token=self.bos_token, eos_token=self.eos_token)


def _raise(message: str) -> None:
    raise TokenizerError(message)


def _hub_caches() -> list[Path]:
    """Where the Hugging Face hub keeps downloaded models on this host (never fetched from here)."""
    out = []
    if os.environ.get("HF_HUB_CACHE"):
        out.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        out.append(Path(os.environ["HF_HOME"]) / "hub")
    out.append(Path.home() / ".cache" / "huggingface" / "hub")
    return out


def _snapshot(repo: Path) -> Path | None:
    """The snapshot ``refs/main`` names, else the newest one that has a tokenizer."""
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file():
        pinned = snapshots / ref.read_text().strip()
        if (pinned / "tokenizer.json").is_file():
            return pinned
    found = [s for s in snapshots.glob("*") if (s / "tokenizer.json").is_file()] if snapshots.is_dir() else []
    return max(found, key=lambda s: s.stat().st_mtime) if found else None


def find_local(root: str | None, served: str) -> tuple[Path, str] | None:
    """A model's tokenizer folder on this host, and where it was found; None if there is none.

    ``root`` is what vLLM reports as the model's ``root`` in ``/v1/models``: the folder it loaded
    the model from, or a hub name (``org/name``), which maps to the local Hugging Face cache; the
    served name is tried as a hub name too. Nothing is downloaded.
    """
    if root:
        path = Path(root).expanduser()
        if path.is_dir() and (path / "tokenizer.json").is_file():
            return path, f"the model's folder {path}"
    for name in (root, served):
        if not name or name.startswith(("/", ".", "~")) or name.count("/") != 1:
            continue
        for cache in _hub_caches():
            snap = _snapshot(cache / ("models--" + name.replace("/", "--")))
            if snap is not None:
                return snap, f"the Hugging Face cache ({snap})"
    return None
