"""The jinja2 sandbox chat templates are compiled in, configured as transformers configures it.

``make_environment``: ``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, a no-op ``{% generation %}``
block, plus the ``do`` extension; the globals ``raise_exception`` and ``strftime_now``, a ``tojson``
filter that keeps non-ASCII, and transformers' hardened ``dict`` and ``namespace``. The shared default
environment is an ``ImmutableSandboxedEnvironment`` with a shortcut for ``message.role`` on plain dicts.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Final

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment

__all__ = ["make_environment"]


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' AssistantTracker) rendered as its body."""

    tags: Final = {"generation"}  # type: ignore[misc]

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers overrides jinja's tojson (which HTML-escapes) with exactly this
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` for templates without the type's attributes (transformers' hardening)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` refusing underscore-prefixed attributes (transformers' hardening)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature trick: no named self
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_namespace_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot store underscore-prefixed attributes on a namespace ({name!r})"
        )


_DICT_ATTRS: Final = frozenset(dir(dict))


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment with a shortcut for ``message.role`` on plain dicts.

    Jinja resolves ``d.key`` by trying ``getattr(d, "key")`` (an AttributeError for a dict), then
    ``d["key"]``; when ``key`` is not an attribute of ``dict`` that is just ``d["key"]``, so this
    returns the same thing without raising and catching an AttributeError (10-20% of a render).
    """

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute not in _DICT_ATTRS:
            try:
                return obj[attribute]
            except KeyError:
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)


def make_environment(*, immutable: bool = True) -> SandboxedEnvironment:
    """A sandboxed environment configured as transformers configures it (plus ``do``).

    ImmutableSandboxedEnvironment by default, as transformers uses: a template that renders there
    renders identically here, and a template cannot mutate the caller's messages.
    bench/tokenizer_bench.py prints its cost next to SandboxedEnvironment's.
    """
    cls = _ChatSandbox if immutable else SandboxedEnvironment
    env = cls(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols, jinja2.ext.do],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


_ENV: SandboxedEnvironment | None = None


def _environment() -> SandboxedEnvironment:
    global _ENV
    if _ENV is None:
        _ENV = make_environment()
    return _ENV
