"""A model's chat template, compiled as Hugging Face's ``apply_chat_template`` compiles it, and what reading
it tells: its *content format* (does it loop over a message's content parts, or print the content as a
string, as vLLM decides it), the variables it reads, whether it knows the ``developer`` role."""

from __future__ import annotations

import json
from collections import deque
from datetime import datetime
from typing import Any, Iterator


_DICT_ATTRIBUTES = frozenset(dir(dict))
_MISSING = object()


class ChatTemplate:
    """One compiled chat template and what reading it told: content format, variables, roles."""

    def __init__(self, source: str) -> None:
        import jinja2
        import jinja2.ext
        import jinja2.meta
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class _Generation(jinja2.ext.Extension):  # {% generation %}...{% endgeneration %}: rendered as is
            tags = {"generation"}

            def parse(self, parser: Any) -> Any:
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

            def _body(self, caller: Any) -> str:
                return caller()

        absent: dict[str, Any] = {}

        class _Environment(ImmutableSandboxedEnvironment):
            def getattr(self, obj: Any, attribute: str) -> Any:
                # ``m.name`` on a message: a plain dict has no attribute but its own methods, so the sandbox's
                # answer is the item or undefined; given here without the two exceptions it raises to find out
                if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
                    value = obj.get(attribute, _MISSING)
                    if value is not _MISSING:
                        return value
                    # undefined, and the same for every dict: made once per name (it says "'dict object' has no
                    # attribute ..."), for as many names as a template spells out
                    missing = absent.get(attribute)
                    if missing is None:
                        missing = self.undefined(obj={}, name=attribute)
                        if len(absent) < 256:
                            absent[attribute] = missing
                    return missing
                return super().getattr(obj, attribute)

        env = _Environment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        ast = env.parse(source)
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(ast))
        self.content_format = "openai" if next(_content_loops(ast), None) is not None else "string"
        self.knows_developer = '"developer"' in source or "'developer'" in source
        self._template = env.from_string(source)

    def render(self, **context: Any) -> str:
        return self._template.render(**context)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


# -- content format: does the template loop over a message's content? -------------------------


def _is_name(node: Any, name: str) -> bool:
    import jinja2.nodes as n

    return isinstance(node, n.Name) and node.ctx == "load" and node.name == name


def _is_field(node: Any, name: str, key: str) -> bool:
    import jinja2.nodes as n

    if isinstance(node, n.Getitem):
        return _is_name(node.node, name) and isinstance(node.arg, n.Const) and node.arg.value == key
    if isinstance(node, n.Getattr):
        return _is_name(node.node, name) and node.attr == key
    return False


def _reads(node: Any, name: str, key: str | None = None) -> bool:
    """``node`` is ``name`` (or ``name[key]``), possibly filtered, tested or sliced."""
    import jinja2.nodes as n

    if isinstance(node, n.Filter):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, n.Test):
        return _reads(node.node, name, key)
    if isinstance(node, n.Getitem) and isinstance(node.arg, n.Slice):
        return _reads(node.node, name, key)
    return _is_field(node, name, key) if key else _is_name(node, name)


def _aliases(root: Any, name: str) -> list[str]:
    """``name`` and every variable assigned from it (``{% set msgs = messages[1:] %}``)."""
    import jinja2.nodes as n

    out, todo = [name], deque([name])
    while todo:
        current = todo.popleft()
        for assign in root.find_all(n.Assign):
            if isinstance(assign.target, n.Name) and _reads(assign.node, current):
                out.append(assign.target.name)
                if assign.target.name != current:
                    todo.append(assign.target.name)
    return out


def _message_names(root: Any) -> list[str]:
    import jinja2.nodes as n

    lists = _aliases(root, "messages")
    return [loop.target.name for loop in root.find_all(n.For)
            if isinstance(loop.target, n.Name) and any(_reads(loop.iter, v) for v in lists)]


def _content_loops(root: Any) -> Iterator[Any]:
    import jinja2.nodes as n

    messages = _message_names(root)
    in_macros: set[int] = set()
    macro_params: dict[int, set[str]] = {}  # loops in a macro called with a message's content
    for macro in root.find_all(n.Macro):
        params = [a.name for a in macro.args]
        bound: set[str] = set()
        for call in root.find_all(n.Call):
            if not _is_name(call.node, macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(params) and any(_reads(arg, m, "content") for m in messages):
                    bound.add(params[i])
            for kw in call.kwargs:
                if kw.key in params and any(_reads(kw.value, m, "content") for m in messages):
                    bound.add(kw.key)
        for loop in macro.find_all(n.For):
            in_macros.add(id(loop))
            if bound:
                macro_params[id(loop)] = bound
    for loop in root.find_all(n.For):
        if not isinstance(loop.target, n.Name):
            continue
        if any(_reads(loop.iter, m, "content") for m in messages):
            yield loop
        elif isinstance(loop.iter, n.Name) and (
                loop.iter.name in macro_params.get(id(loop), ())
                or (id(loop) not in in_macros and loop.iter.name == "content")):
            yield loop
