"""Chat-template skeletons: render a conversation's *shape* once, then fill in the message texts.

A chat template is a function of the messages, but almost all of it depends only on their shape
(how many, which roles, which fields, the tools, the template kwargs); a message's ``content`` is
usually just written out, sometimes tested (``startswith('<tool_response>')``, ``'</think>' in``).
With every user message distinct, the full jinja render is the largest CPU cost of a request after
tokenization (~100-170 µs for a two-message qwen3 chat); filling a skeleton costs a few µs.

How a skeleton is made, and why it is exact:

- The template is rendered once with each string ``content`` replaced by a *traced* string: a ``str``
  subclass whose text is a unique marker and that carries the real content. Every operation on it
  runs on the real content, so the render takes exactly the branches the real render takes.
- Writing it out (``str()``, ``format(x, "")``, ``+`` with other strings) keeps the marker: the output
  is the skeleton, with markers where the content goes.
- Predicates (``startswith``, ``in``, ``==``, ``len``, truthiness, ...) are recorded as *guards* with
  their results on the real content: a later conversation of the same shape reuses the skeleton only
  if every guard gives the same answer on its contents (else it is rendered in full).
- Methods that return a new string with plain arguments (``trim``/``strip``, ``lstrip('\\n')``,
  ``replace``, ``upper``, ...) give a new traced string for "that content through these methods":
  the skeleton applies the same methods to a later content (Llama 3.1 trims every message).
- Anything else (``split``, slicing, iteration, arguments that are themselves contents, ...) *taints*
  the shape: the output depends on the content beyond what is traced, so it is never skeletonized.
- Transformations that jinja or a filter make in C on the raw characters (``tojson``, HTML escape)
  cannot be traced; the marker holds characters any such transformation changes (quotes, ``<``,
  ``&``, a backslash, a newline) and a sentinel word, so a transformed marker is left over in the
  output and the shape is refused.
- Before a skeleton is kept it is checked twice against plain renders: filled with the real contents,
  and filled with a synthetic content (surrounding whitespace, markup characters, mixed case) that
  the guards still accept; both must equal the plain render exactly.

A shape whose render fails any of this is remembered as not skeletonizable (bounded) and always
rendered in full. Results are therefore identical to plain renders by construction and by check;
tests compare them on the golden templates with generated contents.
"""

from __future__ import annotations

import string
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

MARK_OPEN: Final = "\ue000"
MARK_CLOSE: Final = "\ue001"
SENTINEL: Final = "SHPRB"
_MARK_TAIL: Final = "<&\"'\\\n" + MARK_CLOSE

# str methods whose answer a template can branch on: recorded as guards
_PREDICATES: Final = frozenset(
    {
        "startswith",
        "endswith",
        "__contains__",
        "__eq__",
        "__ne__",
        "__lt__",
        "__le__",
        "__gt__",
        "__ge__",
        "__len__",
        "find",
        "rfind",
        "count",
        "isspace",
        "isalpha",
        "isdigit",
        "isalnum",
        "isupper",
        "islower",
        "istitle",
        "isnumeric",
        "isdecimal",
        "isidentifier",
        "isprintable",
        "isascii",
    }
)
# attributes left as ``str`` has them (object protocol, construction, pickling)
_UNTOUCHED: Final = frozenset(
    {
        "__new__",
        "__init__",
        "__getattribute__",
        "__setattr__",
        "__delattr__",
        "__class__",
        "__init_subclass__",
        "__subclasshook__",
        "__getnewargs__",
        "__reduce__",
        "__reduce_ex__",
        "__sizeof__",
        "__dir__",
        "__doc__",
        "__str__",
        "__format__",
        "__add__",
        "__radd__",
        "__bool__",
        "__hash__",
    }
)

Op = tuple[str, tuple[Any, ...]]  # a str method and its arguments
Ref = tuple[int, tuple[Op, ...]]  # a message's content, through these methods in order
Guard = tuple[int, str, tuple[Any, ...], Any]  # (ref, predicate, args, its result on the real content)
Piece = str | int  # literal text, or a ref index


def marker(ref: int) -> str:
    return f"{MARK_OPEN}{SENTINEL}{ref}{_MARK_TAIL}"


class _Recorder:
    __slots__ = ("guards", "refs", "tainted")

    def __init__(self) -> None:
        self.guards: list[Guard] = []
        self.refs: list[Ref] = []
        self.tainted = False

    def traced(self, real: str, ref: Ref) -> Traced:
        self.refs.append(ref)
        n = len(self.refs) - 1
        return Traced(marker(n), real, n, self)


class Traced(str):
    """A marker string standing for a (transformed) message content, ``ref`` its index in the
    recorder's refs; None for a concatenation with other text."""

    _real: str
    _ref: int | None
    _rec: _Recorder

    def __new__(cls, text: str, real: str, ref: int | None, rec: _Recorder) -> Traced:
        obj = str.__new__(cls, text)
        obj._real = real
        obj._ref = ref
        obj._rec = rec
        return obj

    def __str__(self) -> str:
        return self

    def __format__(self, spec: str) -> str:
        if not spec:
            return self
        self._rec.tainted = True
        return format(self._real, spec)

    def __add__(self, other: object) -> str:
        if isinstance(other, Traced):
            return Traced(str.__add__(self, other), self._real + other._real, None, self._rec)
        if isinstance(other, str):
            return Traced(str.__add__(self, other), self._real + other, None, self._rec)
        return NotImplemented

    def __radd__(self, other: object) -> str:
        if isinstance(other, str):
            return Traced(str.__add__(other, self), other + self._real, None, self._rec)
        return NotImplemented

    def __bool__(self) -> bool:
        result = bool(self._real)
        self._guard("__bool__", (), result)
        return result

    def __hash__(self) -> int:
        self._rec.tainted = True
        return hash(self._real)

    def _guard(self, name: str, args: tuple[Any, ...], result: Any) -> None:
        if self._ref is None or not _plain(args):
            self._rec.tainted = True
        else:
            self._rec.guards.append((self._ref, name, args, result))


def _plain(args: tuple[Any, ...]) -> bool:
    return all(type(a) in (str, int, bool, type(None)) or (type(a) is tuple and _plain(a)) for a in args)


def _unwrap(a: Any) -> Any:
    if isinstance(a, Traced):
        return a._real
    if type(a) is tuple:
        return tuple(_unwrap(x) for x in a)
    return a


def _make_predicate(name: str) -> Callable[..., Any]:
    method = getattr(str, name)

    def predicate(self: Traced, *args: Any) -> Any:
        if any(isinstance(a, Traced) for a in args):
            self._rec.tainted = True
        real_args = tuple(_unwrap(a) for a in args)
        result = method(self._real, *real_args)
        if result is NotImplemented:
            return result
        self._guard(name, real_args, result)
        return result

    return predicate


def _make_transform(name: str) -> Callable[..., Any]:
    """A method that may return a new string: traced as a transformation of the content when its
    arguments are plain values (``strip('\\n')``, ``replace('a', 'b')``), else it taints."""
    method = getattr(str, name)

    def transform(self: Traced, *args: Any, **kwargs: Any) -> Any:
        real_args = tuple(_unwrap(a) for a in args)
        result = method(self._real, *real_args, **kwargs)
        if self._ref is None or kwargs or not _plain(args) or type(result) is not str:
            self._rec.tainted = True
            return result
        rec = self._rec
        slot, ops = rec.refs[self._ref]
        return rec.traced(result, (slot, (*ops, (name, real_args))))

    return transform


for _name in dir(str):
    if _name in _UNTOUCHED or not callable(getattr(str, _name)):
        continue
    setattr(Traced, _name, _make_predicate(_name) if _name in _PREDICATES else _make_transform(_name))


def _tuples(value: Any) -> Any:
    """JSON arrays back into the tuples they were (method arguments: ``startswith(("a", "b"))``)."""
    if type(value) is list:
        return tuple(_tuples(v) for v in value)
    return value


def resolve(refs: Sequence[Ref], contents: Sequence[Any]) -> list[str]:
    """The text of every ref for these contents."""
    out: list[str] = []
    for slot, ops in refs:
        value = contents[slot]
        for name, args in ops:
            value = getattr(str, name)(value, *args)
        out.append(value)
    return out


def guards_hold(guards: Sequence[Guard], values: Sequence[str]) -> bool:
    for ref, name, args, result in guards:
        value = values[ref]
        got = bool(value) if name == "__bool__" else getattr(str, name)(value, *args)
        if got != result:
            return False
    return True


def fill(pieces: Sequence[Piece], values: Sequence[str]) -> str:
    return "".join([values[p] if type(p) is int else p for p in pieces])  # type: ignore[misc]


def parse_skeleton(rendered: str) -> list[Piece] | None:
    """The skeleton in a probe render (literal pieces and refs), or None when a marker was
    transformed on its way out (a left-over sentinel or marker character)."""
    parts = rendered.split(MARK_OPEN)
    pieces: list[Piece] = []
    for i, part in enumerate(parts):
        text = part
        if i:
            if not part.startswith(SENTINEL):
                return None
            digits = part[len(SENTINEL) :].split("<", 1)[0]
            if not digits.isdigit() or not part.startswith(_MARK_TAIL, len(SENTINEL) + len(digits)):
                return None
            pieces.append(int(digits))
            text = part[len(SENTINEL) + len(digits) + len(_MARK_TAIL) :]
        if MARK_CLOSE in text or SENTINEL.lower() in text.lower():
            return None
        if text:
            pieces.append(text)
    return pieces


@dataclass(slots=True)
class Skeleton:
    pieces: list[Piece]
    guards: list[Guard]
    refs: list[Ref]
    # refs that are contents as they are (no methods applied): their message indices, else None
    _direct: list[int] | None = field(default=None, init=False, repr=False)

    # the guards with their str methods looked up: (ref, method, args, result)
    _checks: list[tuple[int, Callable[..., Any], tuple[Any, ...], Any]] = field(
        default_factory=list, init=False, repr=False
    )

    def __post_init__(self) -> None:
        if all(not ops for _, ops in self.refs):
            self._direct = [slot for slot, _ in self.refs]
        self._checks = [
            (ref, bool if name == "__bool__" else getattr(str, name), args, result)
            for ref, name, args, result in self.guards
        ]

    def values(self, contents: Sequence[Any]) -> list[str]:
        direct = self._direct
        if direct is not None:
            return [contents[slot] for slot in direct]
        return resolve(self.refs, contents)

    def fill_if_guards_hold(self, contents: Sequence[Any]) -> str | None:
        """The skeleton filled with ``contents``, or None when a guard answers differently on them, or
        when a traced method fails on them: every ref is resolved before any guard is checked, so one
        the template only reached behind a guard (``content and content[0].type``: an index on an
        empty content) is no error of the template's; the full render decides."""
        try:
            values = self.values(contents)
        except Exception:  # (IndexError from an index, whatever else a str method may raise)
            return None
        for ref, method, args, result in self._checks:  # guards_hold
            if method(values[ref], *args) != result:
                return None
        return "".join([values[p] if type(p) is int else p for p in self.pieces])  # type: ignore[misc]


_REFUSED: Final = Skeleton([], [], [])

# contents a template may transform in ways nothing traces (jinja's ``~`` joins in C): whitespace at
# both ends, every printable ASCII character (markup, quotes, both cases), non-ASCII
_SYNTHETIC: Final = (" \n\t" + string.printable + "\u00e9\u65e5\u672c \n\t ", "x", "Q\n")


def _key_bytes(shape: object) -> int:
    """What a shape key holds, in bytes (estimate: a str or bytes object is ~50 bytes and its data)."""
    if isinstance(shape, bytes | str):
        return 50 + len(shape)
    if isinstance(shape, tuple):
        return 56 + sum(8 + _key_bytes(x) for x in shape)
    return 32


def skeleton_bytes(skel: Skeleton) -> int:
    """What a skeleton holds, in bytes (estimate): its text pieces, guards and refs."""
    if skel is _REFUSED:
        return 0
    return (
        200
        + sum(8 + (50 + len(p) if type(p) is str else 0) for p in skel.pieces)
        + 160 * len(skel.guards)
        + sum(100 + 100 * len(ops) for _, ops in skel.refs)
    )


@dataclass
class SkeletonCache:
    """Skeletons of one template, by shape (an LRU bounded by entries and by bytes: keys, which hold the
    tools and template kwargs, and skeletons, which hold the text the template wrote around the
    contents; one entry over an eighth of ``max_bytes`` is not kept; refused shapes remembered too)."""

    size: int = 512
    max_bytes: int = 16 << 20
    hits: int = 0
    misses: int = 0
    guard_misses: int = 0
    refused: int = 0
    bytes: int = 0
    _entries: OrderedDict[Hashable, Skeleton] = field(default_factory=OrderedDict)
    _costs: dict[Hashable, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._entries)

    def render(
        self,
        shape: Hashable,
        chat: list[dict[str, Any]],
        slots: Sequence[int],
        render: Callable[[list[dict[str, Any]]], str],
        contents: list[Any] | None = None,
    ) -> str:
        """``render(chat)``, through the skeleton of ``shape`` (made on first use).

        ``slots`` are the indices of the messages whose ``content`` is a string (one with marker
        characters in it is filled in as any other, but no skeleton is made from it); ``render`` is the
        plain render; ``contents`` each message's ``content`` (None: read from ``chat``).

        Why filling needs no marker check: a skeleton holds only what the template wrote around the
        traced contents and the answers of the guards; a content is copied in as it is, which is what
        the template does with it given the same guard answers, whatever characters it holds."""
        if contents is None:
            contents = [m.get("content") for m in chat]
        skel = self._entries.get(shape)
        if skel is not None:
            self._entries.move_to_end(shape)
            if skel is _REFUSED:
                return render(chat)
            text = skel.fill_if_guards_hold(contents)
            if text is not None:
                self.hits += 1
                return text
            self.guard_misses += 1
            return render(chat)
        self.misses += 1
        text = render(chat)
        for s in slots:
            c = contents[s]
            if MARK_OPEN in c or SENTINEL in c:  # it would be taken for a marker: no skeleton from it
                return text
        self._remember(shape, self._build(chat, slots, contents, text, render))
        return text

    def fill(self, shape: Hashable, contents: list[Any]) -> str | None:
        """The render from the skeleton of ``shape`` when there is a usable one (no render, no build:
        None otherwise)."""
        skel = self._entries.get(shape)
        if skel is None or skel is _REFUSED:
            return None
        self._entries.move_to_end(shape)
        text = skel.fill_if_guards_hold(contents)
        if text is not None:
            self.hits += 1
        return text

    def _build(
        self,
        chat: list[dict[str, Any]],
        slots: Sequence[int],
        contents: list[Any],
        text: str,
        render: Callable[[list[dict[str, Any]]], str],
    ) -> Skeleton:
        rec = _Recorder()
        probed = list(chat)
        for s in slots:
            probed[s] = dict(chat[s], content=rec.traced(chat[s]["content"], (s, ())))
        try:
            out = render(probed)
        except Exception:
            return _REFUSED
        if rec.tainted:
            return _REFUSED
        pieces = parse_skeleton(out)
        if pieces is None or any(type(p) is int and p >= len(rec.refs) for p in pieces):
            return _REFUSED
        skel = Skeleton(pieces, rec.guards, rec.refs)
        if fill(pieces, skel.values(contents)) != text:
            return _REFUSED
        for synthetic in _SYNTHETIC:
            other = list(contents)
            for s in slots:
                other[s] = synthetic
            try:
                values = skel.values(other)
            except Exception:  # (see ``fill_if_guards_hold``)
                continue
            if not guards_hold(skel.guards, values):
                continue
            trial = list(chat)
            for s in slots:
                trial[s] = dict(chat[s], content=synthetic)
            try:
                if render(trial) != fill(pieces, values):
                    return _REFUSED
            except Exception:
                return _REFUSED
            break
        return skel

    def export(self, shape: Hashable) -> list[Any] | None:
        """The skeleton of ``shape`` as JSON data (``adopt`` takes it), None if there is no usable one."""
        skel = self._entries.get(shape)
        if skel is None or skel is _REFUSED:
            return None
        return [skel.pieces, skel.guards, skel.refs]

    def adopt(self, shape: Hashable, data: Any) -> bool:
        """Take a skeleton ``export`` made from the same template (a pool worker's, built on a render
        of a conversation of this shape) unless one is held already. True when taken."""
        if shape in self._entries:
            return False
        try:
            pieces, guards, refs = data
            skel = Skeleton(
                [p if type(p) is int else str(p) for p in pieces],
                [(int(r), str(n), _tuples(a), _tuples(v)) for r, n, a, v in guards],
                [(int(slot), tuple((str(n), _tuples(a)) for n, a in ops)) for slot, ops in refs],
            )
        except (TypeError, ValueError, AttributeError):  # (a guard names no str method)
            return False
        n = len(skel.refs)
        if any(type(p) is int and not 0 <= p < n for p in skel.pieces) or any(
            not 0 <= g[0] < n for g in skel.guards
        ):
            return False  # a piece or a guard that names no value
        self._remember(shape, skel)
        return True

    def _remember(self, shape: Hashable, skel: Skeleton) -> None:
        if skel is _REFUSED:
            self.refused += 1
        cost = _key_bytes(shape) + skeleton_bytes(skel)
        entries, costs = self._entries, self._costs
        old = costs.pop(shape, None)
        if old is not None:
            del entries[shape]
            self.bytes -= old
        if cost > self.max_bytes // 8:
            return
        entries[shape] = skel
        costs[shape] = cost
        self.bytes += cost
        while len(entries) > self.size or self.bytes > self.max_bytes:
            k, _ = entries.popitem(last=False)
            self.bytes -= costs.pop(k)

    def clear(self) -> None:
        self._entries.clear()
        self._costs.clear()
        self.bytes = 0
