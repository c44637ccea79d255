"""Token-id caches for one tokenizer: L0 exact, L1 per special-token segment.

L0 maps ``(text, add_special_tokens)`` to ids. L1 cuts the text right after every added token the
tokenizer itself splits out (found leftmost-longest, as its aho-corasick matcher does), caches the
ids of each such segment and encodes only the segments it has not seen, each with
``add_special_tokens=False``; the post-processor's own ids (a BOS, ...) are put around the whole once.

Why this is exact: ``tokenizers`` extracts added tokens before normalizing and pre-tokenizing, and
runs the normalizer, pre-tokenizer and model on each piece between them separately, so a piece's ids
do not depend on its neighbours. That holds unless a component looks across pieces: added tokens with
``lstrip``/``rstrip``/``single_word`` (they look at neighbouring characters), a Metaspace
pre-tokenizer that prepends only to the first piece, ``encode_special_tokens``, or a post-processor
that is not "fixed ids around the sequence". Such tokenizers get L1 disabled (``segmenting`` is False,
``segmenting_disabled_reason`` says why) and a self-test on probe strings must also pass at
construction. The invariant, property-tested: ``cache.encode(t, a) == hf.encode(t, a).ids``.

What the caches miss is encoded by ``encode_pieces`` (inline, and in the pool's workers, which call
the same method): through ``FastBPE`` (fast_bpe.py: tiktoken's core on the tokenizer's own ranks,
exact, 4-10x cheaper) when the tokenizer's structure is one it reproduces, else by ``hf`` itself.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

import tokenizers

from shepherd.proto.prompt_ids import PromptIds, Shape
from shepherd.tokens.fast_bpe import FastBPE, fast_bpe_for

__all__ = ["ByteLRU", "CacheLimits", "EncodePlan", "SpecialSplitter", "TokenCache"]


@dataclass(frozen=True, slots=True)
class CacheLimits:
    """Bounds of one tokenizer's caches (entries and total ids held, whichever binds first).

    An id held costs ~36 bytes (a list slot and an int object), plus the key text: the defaults keep
    one tokenizer's caches under ~50 MB."""

    exact_entries: int = 4096
    exact_ids: int = 1 << 19
    segment_entries: int = 32768
    segment_ids: int = 1 << 19


V = TypeVar("V")
K = TypeVar("K")


class ByteLRU(Generic[K, V]):
    """An LRU bounded by the total cost of its entries (their bytes, as the caller counts them: key and
    value) and by their number, whichever binds first. For caches keyed by request content: whatever
    the requests, ``total <= max_bytes`` and ``len <= max_entries`` hold after every call, and an entry
    costing more than ``max_item_bytes`` (default: an eighth of the budget) is not stored at all, so
    one request cannot flush the cache of everyone else's entries. Not thread-safe (one loop, or one
    pool worker, owns each)."""

    __slots__ = ("_d", "max_bytes", "max_entries", "max_item_bytes", "total")

    def __init__(self, max_bytes: int, max_entries: int = 1 << 30, max_item_bytes: int | None = None) -> None:
        if max_bytes < 0 or max_entries < 0:
            raise ValueError("cache bounds must not be negative")
        self._d: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.max_item_bytes = max_bytes // 8 if max_item_bytes is None else min(max_item_bytes, max_bytes)
        self.total = 0

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: K) -> bool:
        return key in self._d

    def get(self, key: K) -> V | None:
        hit = self._d.get(key)
        if hit is None:
            return None
        self._d.move_to_end(key)
        return hit[0]

    def put(self, key: K, value: V, cost: int) -> bool:
        """Store ``value`` under ``key`` at ``cost`` bytes (key included); False when it is too big to
        keep (nothing stored; an older entry of that key is dropped)."""
        d = self._d
        old = d.pop(key, None)
        if old is not None:
            self.total -= old[1]
        if cost > self.max_item_bytes or self.max_entries == 0:
            return False
        d[key] = (value, cost)
        self.total += cost
        while self.total > self.max_bytes or len(d) > self.max_entries:
            _, (_, c) = d.popitem(last=False)
            self.total -= c
        return True

    def pop(self, key: K) -> V | None:
        hit = self._d.pop(key, None)
        if hit is None:
            return None
        self.total -= hit[1]
        return hit[0]

    def clear(self) -> None:
        self._d.clear()
        self.total = 0


class _LRU(Generic[V]):
    """An LRU bounded by entry count and total ids (``size`` of a value: its number of ids)."""

    __slots__ = ("_d", "max_entries", "max_ids", "size", "total_ids")

    def __init__(self, max_entries: int, max_ids: int, size: Callable[[V], int]) -> None:
        self._d: OrderedDict[object, V] = OrderedDict()
        self.max_entries = max_entries
        self.max_ids = max_ids
        self.size = size
        self.total_ids = 0

    def __len__(self) -> int:
        return len(self._d)

    def put(self, key: object, value: V, n: int) -> None:
        """Remember ``value`` (``n`` ids) under ``key``."""
        if n > self.max_ids or self.max_entries <= 0:
            return
        d = self._d
        old = d.pop(key, None)
        if old is not None:
            self.total_ids -= self.size(old)
        d[key] = value
        self.total_ids += n
        while len(d) > self.max_entries or self.total_ids > self.max_ids:
            self.total_ids -= self.size(d.popitem(last=False)[1])

    def clear(self) -> None:
        self._d.clear()
        self.total_ids = 0


# What the caches hold: a piece's ids as a tuple, not a list. A tuple of ints is untracked by the garbage
# collector at the first collection that sees it, a list is walked by every collection of its generation:
# with full caches (2^19 ids a level, each a pointer to follow) a full collection took 10-22 ms, 0.5-2.6
# with tuples (2,600 pieces of 200 ids, gc.collect() timed here).
Held = tuple[int, ...]


def _ids_in(pieces: tuple[Held, ...]) -> int:
    return sum(map(len, pieces))


def _alternation(tokens: Sequence[str]) -> re.Pattern[str] | None:
    """A regex matching ``tokens`` leftmost-longest: at one position it matches the longest token that
    starts there. Written as a trie (``<(?:\\|im_(?:end\\|>|start\\|>)|think>)``): alternatives that
    share no first character, longer continuations tried before stopping, which ``re`` scans faster
    than a flat alternation (there, at one position, it takes the first alternative that matches, so
    the flat form needs longer tokens first: the same matches)."""
    unique = sorted({t for t in tokens if t})
    if not unique:
        return None
    try:
        return re.compile(_trie(unique))
    except (RecursionError, re.error, OverflowError):  # thousands of nested prefixes: the flat form
        ordered = sorted(unique, key=lambda s: (-len(s), s))
        return re.compile("|".join(re.escape(t) for t in ordered))


def _trie(tokens: list[str]) -> str:
    """The trie regex of sorted, distinct, non-empty ``tokens``."""
    branches: dict[str, list[str]] = {}
    for t in tokens:
        branches.setdefault(t[0], []).append(t[1:])
    alts: list[str] = []
    for first, rests in branches.items():
        alt = re.escape(first)
        while "" not in rests and len({r[0] for r in rests}) == 1:  # a chain: no choice to make
            alt += re.escape(rests[0][0])
            rests = [r[1:] for r in rests]
        longer = [r for r in rests if r]
        if longer:
            sub = _trie(longer)
            alt += f"(?:{sub})?" if "" in rests else sub
        alts.append(alt)
    return alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"


# Piece keys of a prompt's shape (``PromptIds.shape``): a segment's text (encoded without special tokens)
# names its ids. The BOS/EOS a tokenizer adds are pieces of their own, and a whole text encoded with
# them follows a marker piece of no ids: a text equal to a marker has ids, so the memo's id-count
# check tells them apart.
HEAD_KEY = "\x00\x00head"
TAIL_KEY = "\x00\x00tail"
SPECIALS_KEY = "\x00\x00with-special-tokens"


def _whole(text: str, add_special_tokens: bool, n: int) -> Shape:
    return ((SPECIALS_KEY, 0), (text, n)) if add_special_tokens else ((text, n),)


class SpecialSplitter:
    """Cuts text right after each added token, matched the way ``tokenizers`` matches them.

    ``raw`` are the added tokens matched on the raw text (``normalized=False``); ``normalized`` are
    matched afterwards inside the gaps between raw matches, which is only the same thing on raw text
    when the normalizer is the identity (the caller passes ``()`` otherwise: they are then simply not
    used as cut points, which is still exact).
    """

    def __init__(self, raw: Sequence[str], normalized: Sequence[str] = ()) -> None:
        self._raw = _alternation(raw)
        self._norm = _alternation(normalized)
        # the same alternations in a group: ``split`` then scans the whole text in C
        self._raw_split = _capturing(self._raw)
        self._norm_split = _capturing(self._norm)

    @property
    def active(self) -> bool:
        return self._raw is not None or self._norm is not None

    def parts(self, text: str) -> list[str]:
        """``text`` as ``[gap, token, gap, token, ..., gap]``: the matched added tokens at odd indices,
        the (possibly empty) text between them at even ones; ``"".join(parts) == text``."""
        raw, norm = self._raw_split, self._norm_split
        if norm is None:
            return [text] if raw is None else raw.split(text)
        if raw is None:
            return norm.split(text)
        assert self._raw is not None
        out: list[str] = []
        gap = 0
        for m in self._raw.finditer(text):
            out += norm.split(text[gap : m.start()])
            out.append(m.group())
            gap = m.end()
        out += norm.split(text[gap:])
        return out

    def cuts(self, text: str) -> list[int]:
        """Offsets just after each matched token, ascending (never 0; may include len(text))."""
        ends: list[int] = []
        pos = 0
        for i, part in enumerate(self.parts(text)):
            pos += len(part)
            if i % 2:
                ends.append(pos)
        return ends

    def split(self, text: str) -> list[str]:
        """``text`` as consecutive pieces, each but possibly the last ending with an added token."""
        return _pieces(self.parts(text))


def _capturing(pattern: re.Pattern[str] | None) -> re.Pattern[str] | None:
    return None if pattern is None else re.compile(f"({pattern.pattern})")


def _pieces(parts: list[str]) -> list[str]:
    """``SpecialSplitter.parts`` joined into pieces: each gap with the token after it, then the last
    gap unless it is empty (a text without tokens is one piece, even when empty)."""
    if len(parts) == 1:
        return parts
    pieces = list(map(str.__add__, parts[0:-1:2], parts[1::2]))
    if parts[-1]:
        pieces.append(parts[-1])
    return pieces


@dataclass(slots=True)
class EncodePlan:
    """What an encode still needs after the cache lookups: encode ``pieces[i]`` for ``i in missing``
    with ``add_special_tokens=piece_add_special`` and hand the results to ``TokenCache.complete``."""

    text: str
    add_special_tokens: bool
    pieces: list[str]
    ids: list[Sequence[int] | None]
    missing: list[int]
    missing_chars: int
    piece_add_special: bool
    segmented: bool
    done: list[int] | None = field(default=None)  # set when L0 answered

    def missing_pieces(self) -> list[str]:
        return [self.pieces[i] for i in self.missing]


_PROBE_TEXTS: Final = (
    "Hello world",
    " leading space and trailing  ",
    "naïve café 日本語 🤖 e\u0301",
    "\n\n  \t",
    "",
)


class TokenCache:
    """L0 + L1 caches in front of one ``tokenizers.Tokenizer``. Not thread-safe (one event loop)."""

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        limits: CacheLimits | None = None,
        *,
        segmenting: bool | None = None,
        fast_bpe: FastBPE | bool = True,
    ) -> None:
        self.hf = hf
        # What encodes what the caches miss: ``FastBPE`` (exact, faster) when the tokenizer's
        # structure allows it (``fast_bpe=True``: built once per ``hf``), else ``hf`` itself.
        self.fast: FastBPE | None
        if isinstance(fast_bpe, FastBPE):
            self.fast, self.fast_reason = fast_bpe, "given"
        elif fast_bpe:
            self.fast, self.fast_reason = fast_bpe_for(hf)
        else:
            self.fast, self.fast_reason = None, "disabled by configuration"
        self.limits = limits or CacheLimits()
        # L0: a text's ids as its pieces' tuples (those L1 holds: no copy), L1: a piece's ids
        self._exact: _LRU[tuple[Held, ...]] = _LRU(self.limits.exact_entries, self.limits.exact_ids, _ids_in)
        self._segments: _LRU[Held] = _LRU(self.limits.segment_entries, self.limits.segment_ids, len)
        self.exact_hits = 0
        self.exact_misses = 0
        self.segment_hits = 0
        self.segment_misses = 0
        self.encoded_chars = 0
        self._splitter, reason = _splitter_for(hf)
        self._head: Held = ()
        self._tail: Held = ()
        if reason is None:
            reason = self._learn_wrap()
        if reason is None:
            reason = self._self_test()
        if segmenting is False:
            reason = reason or "disabled by configuration"
        self.segmenting: bool = reason is None
        self.segmenting_disabled_reason: str | None = reason

    # ---- setup -------------------------------------------------------------------------------

    def _learn_wrap(self) -> str | None:
        """Find the fixed ids the post-processor puts around a single sequence."""
        plain = self.hf.encode("Hello world", add_special_tokens=False).ids
        full = self.hf.encode("Hello world", add_special_tokens=True).ids
        for i in range(len(full) - len(plain) + 1):
            if full[i : i + len(plain)] == plain:
                self._head, self._tail = tuple(full[:i]), tuple(full[i + len(plain) :])
                break
        else:
            return "the post-processor does not wrap the sequence in fixed ids"
        return None

    def _self_test(self) -> str | None:
        tokens = self._probe_tokens()
        texts = list(_PROBE_TEXTS)
        for t in tokens:
            texts += [f"a{t}b", f"{t}{t} x", f" {t}\n\n{t}", f"e{t}\u0301 é", f"{t[:-1]}{t}{t[1:]}"]
        for text in texts:
            for add in (False, True):
                want = self.hf.encode(text, add_special_tokens=add).ids
                got = self._encode_segmented(text, add)
                if got != want:
                    return f"self-test failed on {text!r} (add_special_tokens={add})"
        return None

    def _probe_tokens(self) -> list[str]:
        decoder = self.hf.get_added_tokens_decoder()
        contents = sorted({tok.content for tok in decoder.values()}, key=lambda s: (-len(s), s))
        picked = contents[:3] + contents[-3:]
        return list(dict.fromkeys(t for t in picked if t))

    # ---- the public path ---------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of ``text``, identical to ``hf.encode(text, add_special_tokens).ids``."""
        got = self.encode_or_plan(text, add_special_tokens)
        assert not isinstance(got, EncodePlan)
        return got

    def lookup(self, text: str, add_special_tokens: bool = True) -> list[int] | None:
        """L0 only: a copy of the cached ids, or None (counts a hit or a miss)."""
        entry = self._exact._d.get((text, add_special_tokens))
        if entry is None:
            self.exact_misses += 1
            return None
        return self._exact_hit((text, add_special_tokens), entry)

    def _exact_hit(self, key: tuple[str, bool], entry: tuple[Held, ...]) -> PromptIds:
        self.exact_hits += 1
        self._exact._d.move_to_end(key)
        out = PromptIds()
        for piece_ids in entry:
            out += piece_ids
        out.shape = _whole(key[0], key[1], len(out))
        return out

    def plan(self, text: str, add_special_tokens: bool = True) -> EncodePlan:
        """Look ``text`` up in L0, then split it and look its segments up in L1."""
        got = self.encode_or_plan(text, add_special_tokens, -1)
        if isinstance(got, EncodePlan):
            return got
        return EncodePlan(text, add_special_tokens, [], [], [], 0, False, False, got)

    def encode_or_plan(
        self, text: str, add_special_tokens: bool = True, inline_max_chars: int | None = None
    ) -> list[int] | EncodePlan:
        """The ids of ``text`` when the caches leave at most ``inline_max_chars`` characters to encode
        (None: any number; they are encoded here, as ``encode_pieces`` does), else what is left to do
        (hand it to ``encode_pieces`` elsewhere, then to ``complete``): one pass over the caches, the
        path of every request."""
        key = (text, add_special_tokens)
        entry = self._exact._d.get(key)
        if entry is not None:
            return self._exact_hit(key, entry)
        self.exact_misses += 1
        parts = self._splitter.parts(text) if self.segmenting else [text]
        if len(parts) == 1 or (len(parts) == 3 and not parts[2]):
            # nothing to share with other texts: L0 alone remembers it
            if inline_max_chars is not None and len(text) > inline_max_chars:
                return EncodePlan(
                    text, add_special_tokens, [text], [None], [0], len(text), add_special_tokens, False
                )
            self.encoded_chars += len(text)
            if self.fast is not None:
                ids = self.fast.encode(text, add_special_tokens)
            else:
                ids = self.hf.encode(text, add_special_tokens=add_special_tokens).ids
            return self._whole_result(text, add_special_tokens, ids)
        pieces = _pieces(parts)
        held = self._segments._d
        got: list[Sequence[int] | None] = list(map(held.get, pieces))
        missing: list[int] = []
        touch = held.move_to_end
        for i, piece_ids in enumerate(got):
            if piece_ids is None:
                missing.append(i)
            else:
                touch(pieces[i])
        self.segment_hits += len(pieces) - len(missing)
        self.segment_misses += len(missing)
        if not missing:
            return self._assemble(text, add_special_tokens, pieces, got)  # type: ignore[arg-type]
        missing_chars = 0
        for i in missing:
            missing_chars += len(pieces[i])
        if inline_max_chars is not None and missing_chars > inline_max_chars:
            return EncodePlan(text, add_special_tokens, pieces, got, missing, missing_chars, False, True)
        self.encoded_chars += missing_chars
        fast = self.fast
        encoded: list[list[int]] = []
        if fast is not None:
            # a piece is a gap and the added token after it (the last may be a gap alone): the gap's
            # ids and the token's id, which is what encoding the piece does
            ids_of = fast.added_ids
            encode_gap = fast.encode_gap
            n_tokens = len(parts) // 2
            for i in missing:
                piece_ids = encode_gap(parts[2 * i])
                if piece_ids is not None and i < n_tokens:
                    token_id = ids_of.get(parts[2 * i + 1])
                    if token_id is None:
                        piece_ids = None
                    else:
                        piece_ids.append(token_id)
                if piece_ids is None:
                    piece_ids = fast.encode(pieces[i], False)
                encoded.append(piece_ids)
        else:
            encode = self.hf.encode
            encoded = [encode(pieces[i], add_special_tokens=False).ids for i in missing]
        return self._store_missing(text, add_special_tokens, pieces, got, missing, encoded)

    def _whole_result(self, text: str, add_special_tokens: bool, ids: list[int]) -> PromptIds:
        """A text encoded as one piece: remembered in L0, returned with its shape."""
        self._exact.put((text, add_special_tokens), (tuple(ids),), len(ids))
        return PromptIds(ids, _whole(text, add_special_tokens, len(ids)))

    def _store_missing(
        self,
        text: str,
        add_special_tokens: bool,
        pieces: list[str],
        got: list[Sequence[int] | None],
        missing: list[int],
        encoded: Sequence[Sequence[int]],
    ) -> PromptIds:
        """Put the new pieces' ids into L1, then assemble the text's ids."""
        put = self._segments.put
        for i, piece_ids in zip(missing, encoded, strict=True):
            held = tuple(piece_ids)
            got[i] = held
            put(pieces[i], held, len(held))
        return self._assemble(text, add_special_tokens, pieces, got)  # type: ignore[arg-type]

    def _assemble(self, text: str, add_special_tokens: bool, pieces: list[str], got: list[Held]) -> PromptIds:
        """The ids of a segmented text from its pieces' ids, with its shape; remembered in L0 as the
        pieces' tuples (those L1 holds)."""
        shape: Shape = tuple(zip(pieces, map(len, got), strict=True))
        out = PromptIds((), shape)
        if add_special_tokens:
            out.shape = ((HEAD_KEY, len(self._head)), *shape, (TAIL_KEY, len(self._tail)))
            got = [self._head, *got, self._tail]
        for piece_ids in got:
            out += piece_ids  # a list's extend by a tuple: a copy in C
        self._exact.put((text, add_special_tokens), tuple(got), len(out))
        return out

    def complete(self, plan: EncodePlan, encoded: Sequence[Sequence[int]]) -> list[int]:
        """Put the ids of the missing pieces (in ``plan.missing`` order) into the caches; the result."""
        if plan.done is not None:
            return plan.done
        if len(encoded) != len(plan.missing):
            raise ValueError(f"expected ids for {len(plan.missing)} pieces, got {len(encoded)}")
        self.encoded_chars += plan.missing_chars
        if not plan.segmented:
            return self._whole_result(plan.text, plan.add_special_tokens, list(encoded[0]))
        return self._store_missing(
            plan.text,
            plan.add_special_tokens,
            plan.pieces,
            plan.ids,
            plan.missing,
            encoded,
        )

    def encode_pieces(self, pieces: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
        """The plain encoder (what a pool worker runs on the pieces of a plan): each piece's
        ``hf.encode(piece, add_special_tokens).ids``, through ``FastBPE`` when there is one."""
        if self.fast is not None:
            return self.fast.encode_pieces(pieces, add_special_tokens)
        encode = self.hf.encode
        return [encode(p, add_special_tokens=add_special_tokens).ids for p in pieces]

    # ---- without caches, for the self-test -----------------------------------------------------

    def _encode_segmented(self, text: str, add_special_tokens: bool) -> list[int]:
        encode = self.hf.encode
        out: list[int] = list(self._head) if add_special_tokens else []
        for piece in self._splitter.split(text):
            out += encode(piece, add_special_tokens=False).ids
        if add_special_tokens:
            out += self._tail
        return out

    # ---- bookkeeping ---------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        return {
            "l0_hits": self.exact_hits,
            "l0_misses": self.exact_misses,
            "l0_entries": len(self._exact),
            "l0_ids": self._exact.total_ids,
            "l1_hits": self.segment_hits,
            "l1_misses": self.segment_misses,
            "l1_entries": len(self._segments),
            "l1_ids": self._segments.total_ids,
            "encoded_chars": self.encoded_chars,
        }

    def clear(self) -> None:
        self._exact.clear()
        self._segments.clear()


def _splitter_for(hf: tokenizers.Tokenizer) -> tuple[SpecialSplitter, str | None]:
    """The splitter for ``hf`` and, when segment-wise encoding would not be exact, why."""
    empty = SpecialSplitter(())
    if hf.encode_special_tokens:
        return empty, "encode_special_tokens is set: special tokens are not split out"
    pre = hf.pre_tokenizer
    if pre is not None:
        state = pre.__getstate__()
        state_s = state.decode() if isinstance(state, bytes) else str(state)
        if '"prepend_scheme":"first"' in state_s.replace(" ", ""):
            return empty, "Metaspace pre-tokenizer prepends to the first piece only"
    raw: list[str] = []
    normalized: list[str] = []
    for tok in hf.get_added_tokens_decoder().values():
        if tok.lstrip or tok.rstrip or tok.single_word:
            return empty, f"added token {tok.content!r} has lstrip/rstrip/single_word"
        if not tok.content:
            continue
        (normalized if tok.normalized else raw).append(tok.content)
    if normalized and not _identity_normalizer(hf):
        normalized = []
    splitter = SpecialSplitter(raw, normalized)
    if not splitter.active:
        return splitter, "the tokenizer has no added tokens"
    return splitter, None


def _identity_normalizer(hf: tokenizers.Tokenizer) -> bool:
    norm = hf.normalizer
    if norm is None:
        return True
    state = norm.__getstate__()
    state_s = (state.decode() if isinstance(state, bytes) else str(state)).replace(" ", "")
    return state_s == '{"type":"Sequence","normalizers":[]}'
