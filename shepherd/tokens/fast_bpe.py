"""An exact, faster encoder for byte-level BPE tokenizers: tiktoken's core on the tokenizer's own ranks.

HF ``tokenizers`` spends most of an ``encode`` on bookkeeping (offsets, normalized-string alignments,
the ``Encoding`` object); tiktoken runs the same regex split and BPE without it, 3.5-6x faster here.
``FastBPE.build(hf, tokenizer_json)`` returns an encoder only for a tokenizer whose pipeline it
reproduces id for id, and ``None`` otherwise (``build_with_reason`` says why):

- model BPE without dropout, byte fallback, subword prefix or word suffix, every single byte in the
  vocabulary;
- pre-tokenizer ``Split(Regex, Isolated)`` followed by ``ByteLevel(use_regex=False)``, or
  ``ByteLevel(use_regex=True)`` alone (the GPT-2 pattern), without ``add_prefix_space``;
- normalizer none (or an empty sequence) or NFC;
- merges that make HF's merge-priority BPE the same function as tiktoken's rank BPE;
- added tokens without lstrip/rstrip/single_word, and ``encode_special_tokens`` off;
- no truncation, no padding.

The BPE equivalence and the structure checks (model, pre-tokenizer, normalizer, merges) are in
fast_bpe_core.py.

Added tokens never reach tiktoken: they are split out first, non-normalized ones on the raw text and
normalized ones inside the normalized gaps, leftmost-longest, exactly as ``tokenizers`` does. NFC is
applied per gap, skipped for ASCII and for text Python already reports NFC; text that NFC changes is
normalized by the tokenizer's own normalizer (its Unicode tables are older than Python's: a few
dozen marks have no combining class there). Text with lone surrogates goes to HF (which raises).
``add_special_tokens=True`` puts the post-processor's fixed ids around the sequence (learned from HF,
for the post-processors known to be fixed wrappers) or goes to HF.

Finally a self-check on a built-in corpus (scripts, digits, whitespace runs, contractions,
punctuation, emoji, code, NFC-changing sequences, the tokenizer's added tokens and pieces of them)
must give HF's ids for both ``add_special_tokens`` values, or the encoder is not built.
"""

from __future__ import annotations

import functools
import logging
import re
import unicodedata
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

import orjson
import tokenizers

from shepherd.tokens.fast_bpe_core import _cached_core, _Core

__all__ = ["FastBPE", "fast_bpe_for"]

log = logging.getLogger("shepherd.tokenizer")

_encode_ascii: Callable[[str, object, Callable[[bytes], list[int]], int], list[int] | None] | None = None
_rank_table: Callable[[dict[bytes, int]], object] | None = None
try:  # the split of ASCII text in C (setup.py builds it where a compiler is)
    from shepherd.tokens import _pretok

    _encode_ascii = _pretok.encode_ascii
    _rank_table = _pretok.rank_table
except ImportError:  # pragma: no cover - an install without a C compiler
    pass

# the split patterns _pretok decides in C, and their digit runs: Qwen2's \p{N}, cl100k's (Llama 3) \p{N}{1,3}
_C_SPLIT_DIGITS: Final = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+": 1,
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+": 3,
}


def _panic_safe(
    encode: Callable[[str], list[int]], fallback: Callable[[str], list[int]]
) -> Callable[[str], list[int]]:
    """``encode``, or ``fallback`` (the same ids) where tiktoken's Rust core panics: its regex overflows
    its stack on a run of about a million non-ASCII spaces (U+3000, U+00A0), and pyo3 raises the panic as
    a ``BaseException`` that would end a tokenizer worker (HF's encoder takes such a run, slowly)."""

    def safe(text: str) -> list[int]:
        try:
            return encode(text)
        except BaseException as e:  # pyo3's PanicException is no Exception: the one caught here
            if isinstance(e, Exception | KeyboardInterrupt | SystemExit | GeneratorExit):
                raise
            return fallback(text)

    return safe


def _ordinary_encoder(core: _Core, fallback: Callable[[str], list[int]]) -> Callable[[str], list[int]]:
    """tiktoken's ``encode_ordinary`` of the core, or (same ids) the C split for ASCII text when the
    pattern is one _pretok decides: a piece found whole among the ASCII tokens of the ranks is its id,
    any other goes to tiktoken's BPE of one piece; text that is not ASCII goes to tiktoken (``fallback``
    where tiktoken panics: ``_panic_safe``)."""
    encoding = core.encoding
    ordinary: Callable[[str], list[int]] = _panic_safe(encoding.encode_ordinary, fallback)
    digits = _C_SPLIT_DIGITS.get(core.pattern)
    ranks = getattr(encoding, "_mergeable_ranks", None)
    bpe = getattr(getattr(encoding, "_core_bpe", None), "encode_single_piece", None)
    c = _encode_ascii
    if c is None or _rank_table is None or digits is None or type(ranks) is not dict or bpe is None:
        return ordinary
    try:  # the ASCII tokens (built here: before the pool forks, shared with it)
        table = _rank_table(ranks)
    except (TypeError, ValueError):  # keys or ids of other types (a future tiktoken): its own path
        return ordinary

    def encode(text: str) -> list[int]:
        ids = c(text, table, bpe, digits)
        return ordinary(text) if ids is None else ids

    return encode


_FIXED_WRAP_POST: Final = frozenset(
    {"ByteLevel", "TemplateProcessing", "BertProcessing", "RobertaProcessing"}
)


# ---- the encoder ---------------------------------------------------------------------------------------


def _alternation(tokens: Iterable[str]) -> re.Pattern[str] | None:
    """Leftmost-longest over literal tokens: at one position Python's ``re`` takes the first
    alternative that matches, so longer tokens go first."""
    ordered = sorted(set(tokens), key=lambda s: (-len(s), s))
    if not ordered:
        return None
    return re.compile("|".join(re.escape(t) for t in ordered))


_SELF_CHECK: Final = (
    "",
    "Hello world",
    "Hello world!",
    " leading space",
    "trailing spaces   ",
    "   ",
    "\n",
    "\n\n\n",
    "a\r\nb\r\n\r\nc \r\n d",
    "tabs\t\tand  double  spaces\t\n  indented\n\tcode",
    "don't I'LL we've she'S they'd I'm YOU'RE it's 'tis",
    "numbers 0 12 345 6789 1234567890 3.14159 1,000,000 -42 1e-9",
    "naïve café résumé Ångström ñ ü ß Œuvre",
    "e\u0301 a\u0308 o\u0302\u0323 A\u030a \u1100\u1161\u11a8 \u0915\u093c",
    "x\u0316\u0301\u0300y \u05d1\u05bc\u05b0 \u0627\u064b\u0651",
    "日本語のテキストです。中文测试，汉字。한국어 텍스트입니다.",
    "Привет, мир! Ελληνικά κείμενα. עברית ערבית العربية हिन्दी ภาษาไทย",
    "emoji 🤖👍🏽 👨‍👩‍👧 🇺🇸🇫🇷 ❤️ ☕ 🦙🦙🦙",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\n\nclass A:\n    pass\n",
    '{"key": [1, 2, {"a": null, "b": true}], "s": "v\\n"}',
    '<html><body><p class="x">tag &amp; entity</p></body></html>',
    "https://example.com/path/to?q=1&r=two#frag user@example.org",
    "!!! ??? ... --- *** ### $$$ %%% ^^^ &&& ((())) [[[]]] {{{}}} ||| ~~~",
    "x\u00a0y\u2003z\u3000w\u2028v\u0085u\u200bt\ufeffs",
    "∑∫√∞≈≠ ℕℤℚℝ ⅀ ½ ² ① ǅ ǈ ｆｕｌｌｗｉｄｔｈ",
    "a" * 300,
    " " * 70 + "x",
    "ab" * 120,
    "\x00\x01\x7f control \x1b[0m",
)


class FastBPE:
    """Encodes exactly as ``hf.encode(text, add_special_tokens).ids``, on tiktoken's core.

    Build with ``FastBPE.build`` (or ``build_with_reason``). Thread-safe for concurrent ``encode``
    (no mutable state but two counters)."""

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        core: _Core,
        *,
        raw_tokens: Mapping[str, int],
        normalized_tokens: Mapping[str, int],
        wrap: tuple[list[int], list[int]] | None,
    ) -> None:
        self.hf = hf
        self.pattern = core.pattern
        self.nfc = core.nfc
        self.description = core.description
        self.token_ranks: Mapping[bytes, int] = core.ranks  # byte-level tokens' bytes → ids (shared)
        self._encode_ordinary = _ordinary_encoder(core, lambda t: hf.encode(t, add_special_tokens=False).ids)
        normalizer = hf.normalizer
        self._normalize: Callable[[str], str] | None = normalizer.normalize_str if normalizer else None
        self._raw_ids = dict(raw_tokens)
        self._raw_re = _alternation(raw_tokens)
        self._norm_ids = dict(normalized_tokens)
        self._norm_re = _alternation(normalized_tokens)
        # every added token the encoder splits out, by content
        self.added_ids: dict[str, int] = {**self._norm_ids, **self._raw_ids}
        self._head, self._tail = wrap if wrap is not None else ([], [])
        self.wraps: bool = wrap is not None  # add_special_tokens=True handled here (else by HF)
        self.fast_calls = 0
        self.hf_calls = 0

    # ---- building ---------------------------------------------------------------------------------

    @classmethod
    def build(
        cls, hf: tokenizers.Tokenizer, tokenizer_json: Mapping[str, Any], *, content_key: bytes | None = None
    ) -> FastBPE | None:
        """The encoder, or None when ``hf``'s structure is not one it reproduces (logged).

        ``tokenizer_json`` is ``hf``'s parsed tokenizer.json. ``content_key`` (a digest of that file)
        lets later builds from the same file reuse the expensive checks (0.3-1.5 s)."""
        fast, reason = cls.build_with_reason(hf, tokenizer_json, content_key=content_key)
        if fast is None:
            log.info("fast BPE off: %s", reason)
        return fast

    @classmethod
    def build_with_reason(
        cls,
        hf: tokenizers.Tokenizer,
        tokenizer_json: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
        *,
        content_key: bytes | None = None,
    ) -> tuple[FastBPE | None, str]:
        """``(encoder, what it does)`` or ``(None, why not)``. ``tokenizer_json`` may be a function
        giving it: it is then parsed only when nothing was kept for ``content_key``."""
        source = tokenizer_json if callable(tokenizer_json) else functools.partial(_same, tokenizer_json)
        try:
            if hf.truncation is not None or hf.padding is not None:
                raise ValueError("truncation or padding is set")
            if hf.encode_special_tokens:
                raise ValueError("encode_special_tokens is set: added tokens are not split out")
            raw: dict[str, int] = {}
            normalized: dict[str, int] = {}
            for i, tok in hf.get_added_tokens_decoder().items():
                if tok.lstrip or tok.rstrip or tok.single_word:
                    raise ValueError(f"added token {tok.content!r} has lstrip/rstrip/single_word")
                if tok.content:
                    (normalized if tok.normalized else raw)[tok.content] = i
            core = _cached_core(hf, source, content_key)
            wrap = _learn_wrap(hf, core.post_processor)
            fast = cls(hf, core, raw_tokens=raw, normalized_tokens=normalized, wrap=wrap)
            bad = fast._self_check()
            if bad is not None and content_key is not None:  # a kept core gone bad: from the file again
                core = _cached_core(hf, source, content_key, rebuild=True)
                wrap = _learn_wrap(hf, core.post_processor)
                fast = cls(hf, core, raw_tokens=raw, normalized_tokens=normalized, wrap=wrap)
                bad = fast._self_check()
            if bad is not None:
                log.warning("fast BPE off: self-check against tokenizers failed on %r", bad)
                raise ValueError(f"self-check against tokenizers failed on {bad!r}")
        except ValueError as e:
            return None, str(e)
        return fast, f"{core.description}, add_special_tokens=True {'here' if wrap is not None else 'by HF'}"

    def _self_check(self) -> str | None:
        added = sorted({*self._raw_ids, *self._norm_ids}, key=lambda s: (-len(s), s))
        probes = list(dict.fromkeys(added[:3] + added[-3:]))
        texts = list(_SELF_CHECK)
        for t in probes:
            texts += [f"a{t}b", f"{t}{t} x", f" {t}\n\n{t}", f"e{t}\u0301 é", f"{t[:-1]}{t}{t[1:]}", t[:-1]]
        texts.append(" ".join(_SELF_CHECK) + "".join(probes))
        for text in texts:
            for add in (False, True):
                if self._encode(text, add) != self.hf.encode(text, add_special_tokens=add).ids:
                    return text
        return None

    # ---- encoding -----------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``hf.encode(text, add_special_tokens=add_special_tokens).ids``."""
        ids = self._encode(text, add_special_tokens)
        if ids is None:
            self.hf_calls += 1
            hf_ids: list[int] = self.hf.encode(text, add_special_tokens=add_special_tokens).ids
            return hf_ids
        self.fast_calls += 1
        return ids

    def encode_pieces(self, pieces: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
        encode = self.encode
        return [encode(p, add_special_tokens) for p in pieces]

    def encode_gap(self, gap: str) -> list[int] | None:
        """``encode(gap, False)`` for text in which no raw added token occurs (what lies between the
        ones ``SpecialSplitter`` cuts at), as a new list; None when HF must do it (a lone surrogate)."""
        if not gap:
            return []
        if not gap.isascii():
            try:
                gap.encode("utf-8")
            except UnicodeEncodeError:
                return None
        self.fast_calls += 1
        return self._gap(gap)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int] | None:
        """The ids, or None when HF must do it (a lone surrogate; a wrap not known)."""
        if add_special_tokens and not self.wraps:
            return None
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                return None  # HF refuses such text; let it say so
        raw = self._raw_re
        if raw is None:
            ids = self._gap(text)
        else:
            ids = []
            pos = 0
            for m in raw.finditer(text):
                start = m.start()
                if start > pos:
                    ids += self._gap(text[pos:start])
                ids.append(self._raw_ids[m.group()])
                pos = m.end()
            if pos < len(text):
                ids += self._gap(text[pos:] if pos else text)
        if add_special_tokens:
            return [*self._head, *ids, *self._tail] if self._head or self._tail else ids
        return ids

    def _gap(self, gap: str) -> list[int]:
        """Ids of text between raw added tokens: normalize, split normalized added tokens, BPE."""
        if self.nfc and not gap.isascii() and not unicodedata.is_normalized("NFC", gap):
            assert self._normalize is not None
            gap = self._normalize(gap)
        norm = self._norm_re
        if norm is None:
            return self._encode_ordinary(gap)
        ids: list[int] = []
        pos = 0
        for m in norm.finditer(gap):
            start = m.start()
            if start > pos:
                ids += self._encode_ordinary(gap[pos:start])
            ids.append(self._norm_ids[m.group()])
            pos = m.end()
        if pos < len(gap):
            ids += self._encode_ordinary(gap[pos:] if pos else gap)
        return ids

    def __repr__(self) -> str:
        return f"FastBPE(nfc={self.nfc}, wraps={self.wraps}, pattern={self.pattern[:40]!r}...)"


def _learn_wrap(
    hf: tokenizers.Tokenizer, post: Mapping[str, Any] | None
) -> tuple[list[int], list[int]] | None:
    """The fixed ids a known post-processor puts around one sequence, or None (HF does those calls)."""
    if post is not None:
        kinds = (
            [p.get("type") for p in post.get("processors", [])]
            if post.get("type") == "Sequence"
            else [post.get("type")]
        )
        if not all(k in _FIXED_WRAP_POST for k in kinds):
            return None
    plain = hf.encode("Hello world", add_special_tokens=False).ids
    full = hf.encode("Hello world", add_special_tokens=True).ids
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return full[:i], full[i + len(plain) :]
    return None


# ---- one encoder per loaded tokenizer ---------------------------------------------------------------

_BUILT: weakref.WeakKeyDictionary[tokenizers.Tokenizer, tuple[tuple[object, ...], FastBPE | None, str]] = (
    weakref.WeakKeyDictionary()
)


def _fingerprint(hf: tokenizers.Tokenizer) -> tuple[object, ...]:
    """What could change on a loaded tokenizer and matters here (its model and pipeline cannot be
    swapped without a new object in practice; added tokens and flags can)."""
    return (
        hf.get_vocab_size(with_added_tokens=True),
        len(hf.get_added_tokens_decoder()),
        hf.encode_special_tokens,
        hf.truncation is None,
        hf.padding is None,
    )


def _same(d: Mapping[str, Any]) -> Mapping[str, Any]:
    return d


def _parsed(hf: tokenizers.Tokenizer) -> Mapping[str, Any]:
    d: Mapping[str, Any] = orjson.loads(hf.to_str())
    return d


def fast_bpe_for(
    hf: tokenizers.Tokenizer,
    tokenizer_json: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None,
    *,
    content_key: bytes | None = None,
) -> tuple[FastBPE | None, str]:
    """``FastBPE.build_with_reason`` once per tokenizer object: later calls for the same ``hf`` get
    the same encoder. ``tokenizer_json`` defaults to ``hf.to_str()`` parsed (when it is needed)."""
    fp = _fingerprint(hf)
    hit = _BUILT.get(hf)
    if hit is not None and hit[0] == fp:
        return hit[1], hit[2]
    d = tokenizer_json if tokenizer_json is not None else functools.partial(_parsed, hf)
    fast, why = FastBPE.build_with_reason(hf, d, content_key=content_key)
    if fast is None:
        log.info("fast BPE off: %s", why)
    _BUILT[hf] = (fp, fast, why)
    return fast, why
