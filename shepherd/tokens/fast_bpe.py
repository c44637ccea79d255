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
- merges that make HF's merge-priority BPE the same function as tiktoken's rank BPE (below);
- added tokens without lstrip/rstrip/single_word, and ``encode_special_tokens`` off;
- no truncation, no padding.

Why the BPE is the same. HF merges, at each step, the adjacent pair of lowest *merge* rank (leftmost
on ties); tiktoken the adjacent pair whose concatenation has the lowest *token id* (leftmost on
ties), among all pairs whose concatenation is a token; and tiktoken looks a whole pre-token up in the
vocabulary first, which HF does only with ``ignore_merges``. Checked at build:

- the id of a merge's result never decreases along the merge list (lower merge rank = lower id);
- *all splits* (tiktoken conversions: qwen, llama-3, gpt-oss, Tekken): every split ``(l, r)`` of a
  token into two tokens is a merge, so both see the same candidate pairs and pick a pair giving the
  same token. HF orders the different splits of one token among themselves, which could only matter
  if two different splits of the same token were candidates at once: not proven impossible, but a
  search over 178k adversarial words for qwen3 (each such token twice, overlapping at its borders,
  around another token) found no such state (``bench/tokenizer_bench.py --fast-bpe-verify``), nor
  did 2,500 random small vocabularies;
- otherwise *one merge per token* (GPT-2), accepted without ``ignore_merges`` only, and only if HF's
  model encodes every token, alone, as itself (which the whole-word lookup needs; tokens that fail
  and are no merge's result, such as GPT-2's ``<|endoftext|>``, are left out of the ranks: HF never
  produces them). Then tiktoken's extra candidates (splits that are not merges) have been seen to
  change nothing (408k adversarial words for gpt2, 2,500 random small vocabularies), which again is
  evidence, not proof.

The pre-tokenizer regex runs on fancy-regex in tiktoken and on Oniguruma in tokenizers: the two
classify every code point alike for the patterns of qwen3, llama-3.1 and gpt2 (each code point in a
dozen contexts, ``--fast-bpe-verify``).

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
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson
import tiktoken
import tokenizers

__all__ = ["GPT2_PATTERN", "FastBPE", "byte_level_decoder", "fast_bpe_for"]

log = logging.getLogger("shepherd.tokenizer")

# tokenizers' ByteLevel pre-tokenizer regex (use_regex=True)
GPT2_PATTERN: Final = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

_FIXED_WRAP_POST: Final = frozenset(
    {"ByteLevel", "TemplateProcessing", "BertProcessing", "RobertaProcessing"}
)


@functools.cache
def byte_level_decoder() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode`` inverted: the character a byte-level vocabulary uses for each byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


@functools.cache
def _to_latin1_table() -> dict[int, str]:
    """A ``str.translate`` table: byte-level character → the latin-1 character of its byte; every
    other character below U+0144 → U+FFFF (so that ``.encode("latin-1")`` fails on it)."""
    dec = byte_level_decoder()
    table = {c: "\uffff" for c in range(0x144)}
    for ch, b in dec.items():
        table[ord(ch)] = chr(b)
    return table


# ---- structure checks ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Core:
    """What ``tokenizer.json`` alone determines (model, pre-tokenizer, normalizer): checked once
    and shared by the tokenizer objects loaded from the same file."""

    encoding: tiktoken.Encoding
    pattern: str
    nfc: bool
    description: str


_CORES: OrderedDict[bytes, _Core | str] = OrderedDict()  # content key → core or why not
_CORES_MAX: Final = 8


def _pre_tokenizer_pattern(pre: Mapping[str, Any] | None) -> str:
    """The regex of a supported byte-level pre-tokenizer (raises ValueError with the reason)."""
    if pre is None:
        raise ValueError("no pre-tokenizer (not byte-level)")
    steps: list[Mapping[str, Any]] = list(pre["pretokenizers"]) if pre.get("type") == "Sequence" else [pre]
    if len(steps) == 1:
        bl = steps[0]
        if bl.get("type") != "ByteLevel" or not bl.get("use_regex", True):
            raise ValueError(f"pre-tokenizer {_types(steps)} is not byte-level with a regex")
        if bl.get("add_prefix_space", True):  # tokenizers' default is True
            raise ValueError("ByteLevel add_prefix_space is set")
        return GPT2_PATTERN
    if len(steps) != 2:
        raise ValueError(f"pre-tokenizer {_types(steps)}: only one Split before ByteLevel is supported")
    split, bl = steps
    if split.get("type") != "Split" or bl.get("type") != "ByteLevel":
        raise ValueError(f"pre-tokenizer {_types(steps)} is not Split + ByteLevel")
    if bl.get("use_regex", True) or bl.get("add_prefix_space", True):
        raise ValueError("ByteLevel after Split must have use_regex and add_prefix_space off")
    pattern = split.get("pattern") or {}
    if "Regex" not in pattern:
        raise ValueError("Split pattern is not a regex")
    if split.get("behavior") != "Isolated" or split.get("invert"):
        raise ValueError(f"Split behavior {split.get('behavior')!r} invert={split.get('invert')!r}")
    return str(pattern["Regex"])


def _types(steps: Iterable[Mapping[str, Any]]) -> str:
    return "[" + ", ".join(str(s.get("type")) for s in steps) + "]"


def _normalizer_is_nfc(norm: Mapping[str, Any] | None) -> bool:
    """False for no normalizer, True for NFC (raises ValueError for anything else)."""
    if norm is None:
        return False
    kind = norm.get("type")
    if kind == "NFC":
        return True
    if kind == "Sequence":
        inner = list(norm.get("normalizers") or [])
        if not inner:
            return False
        if len(inner) == 1:
            return _normalizer_is_nfc(inner[0])
    raise ValueError(f"normalizer {kind!r} is not supported (only none or NFC)")


def _check_model(model: Mapping[str, Any]) -> bool:
    """Raises ValueError unless the model is a plain BPE; returns ``ignore_merges``."""
    if model.get("type") != "BPE":
        raise ValueError(f"model {model.get('type')!r} is not BPE")
    if model.get("dropout") not in (None, 0, 0.0):
        raise ValueError("BPE dropout is set")
    if model.get("byte_fallback"):
        raise ValueError("BPE byte_fallback is set")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise ValueError("BPE continuing_subword_prefix/end_of_word_suffix is set")
    return bool(model.get("ignore_merges", False))


def _ranks(vocab: Mapping[str, int]) -> dict[bytes, int]:
    """Byte-level vocabulary → tiktoken ranks (entries that are not byte-level strings are left out:
    byte-level BPE can never produce them)."""
    table = _to_latin1_table()
    ranks: dict[bytes, int] = {}
    try:  # all of it at once: one character is one byte
        blob = "".join(vocab).translate(table).encode("latin-1")
    except UnicodeEncodeError:
        for tok, i in vocab.items():
            try:
                ranks[tok.translate(table).encode("latin-1")] = i
            except UnicodeEncodeError:
                continue
    else:
        pos = 0
        for tok, i in vocab.items():
            end = pos + len(tok)
            ranks[blob[pos:end]] = i
            pos = end
    if len(set(ranks.values())) != len(ranks):
        raise ValueError("two vocabulary entries share an id")
    missing = [b for b in range(256) if bytes((b,)) not in ranks]
    if missing:
        raise ValueError(f"{len(missing)} single bytes are not in the vocabulary")
    return ranks


def _merge_pairs(merges: Sequence[Any]) -> list[tuple[str, str]]:
    if not merges:
        return []
    # the legacy "a b" form (byte-level tokens hold no space) or [a, b]
    raw = [m.split(" ") for m in merges] if isinstance(merges[0], str) else merges
    pairs: list[tuple[str, str]] = list(map(tuple, raw))
    if any(len(p) != 2 for p in pairs):
        raise ValueError("malformed merges")
    return pairs


def _check_merges(vocab: Mapping[str, int], pairs: Sequence[tuple[str, str]], *, need_layout: bool) -> bool:
    """Raises ValueError unless merge priority follows the ids of the merged tokens. True when the
    merges are all the splits of the vocabulary; False when they are one merge per token (not
    told apart, and False, when ``need_layout`` is off and there are no ties). (tokenizers itself
    refuses merges whose parts or result are not in the vocabulary.)"""
    get = vocab.get
    ids = [get(a + b) for a, b in pairs]
    if None in ids:
        raise ValueError("a merge's result is not in the vocabulary")
    if ids != sorted(ids):  # type: ignore[type-var]
        raise ValueError("merge priority does not follow the ids of the merged tokens")
    ties = len(set(ids)) != len(ids)
    if not ties and not need_layout:
        return False
    # Are all the splits of every token into two tokens merges? The merges are splits, so counting
    # the splits is enough.
    if len(set(pairs)) != len(pairs):
        raise ValueError("duplicate merges")
    splits = 0
    for t in vocab:
        for i in range(1, len(t)):
            if t[:i] in vocab and t[i:] in vocab:
                splits += 1
    if splits == len(pairs):
        return True
    if ties:
        raise ValueError(
            f"merges tie on result ids but are not all the splits of the vocabulary "
            f"({len(pairs)} merges, {splits} splits)"
        )
    return False


def _self_encoding_tokens(
    hf: tokenizers.Tokenizer, vocab: Mapping[str, int], ranks: Mapping[bytes, int]
) -> list[int]:
    """Ids of the ranks' tokens that HF's model, given the token alone as a word, does not encode as
    itself."""
    ids = set(ranks.values())
    items = [(tok, i) for tok, i in vocab.items() if i in ids]  # byte-level strings: a model's words
    # The same model with nothing around it but a whitespace split (no byte-level character is
    # whitespace): one call for the whole vocabulary.
    bare = tokenizers.Tokenizer(hf.model)
    bare.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    got = bare.encode(" ".join(tok for tok, _ in items), add_special_tokens=False)
    if got.ids == [i for _, i in items]:
        return []
    per_word: list[list[int]] = [[] for _ in items]
    for i, w in zip(got.ids, got.word_ids, strict=True):
        if w is not None:
            per_word[w].append(i)
    return [i for (_, i), out in zip(items, per_word, strict=True) if out != [i]]


# ---- NFC ----------------------------------------------------------------------------------------------


@functools.cache
def _nfc_probes() -> tuple[str, ...]:
    """Short texts that Python calls NFC, around every character of planes 0-2 that Python's Unicode
    database gives a combining class or a canonical decomposition (in the contexts where a wrong
    class or decomposition shows), and around every code point of planes 0-1 it has unassigned (which
    a newer table could make a mark: reordered against U+0316 / U+0301 then)."""
    probes: list[str] = []
    for cp in range(0xA0, 0x30000):
        if 0xD800 <= cp < 0xE000:
            continue
        c = chr(cp)
        decomposition = unicodedata.decomposition(c)
        if unicodedata.combining(c):
            texts = [f"a{c}\u0316", f"a\u0301{c}", f"{c}\u0301", f"e{c}", f"{c}{c}", f"\u1100{c}"]
        elif decomposition and not decomposition.startswith("<"):
            texts = [c, unicodedata.normalize("NFD", c), f"{c}\u0316\u0301"]
        elif cp < 0x20000 and unicodedata.category(c) == "Cn":
            texts = [f"a\u0316{c}", f"a{c}\u0316", f"a\u0301{c}", c]
        else:
            continue
        probes.extend(t for t in texts if unicodedata.is_normalized("NFC", t))
    return tuple(probes)


def _nfc_agrees(normalize: Callable[[str], str]) -> str | None:
    """None when the tokenizer's NFC leaves alone all text Python calls NFC; else why not.

    Python's tables (Unicode 14 in 3.11) are newer than tokenizers' (there, a few dozen marks of
    Unicode 11-14 are class-0 starters): so text NFC in Python's view is NFC in tokenizers' too, and
    only text Python would change needs the tokenizer's own (slower) normalizer. Probed, since a
    later tokenizers could have newer tables than the Python running it."""
    probes = _nfc_probes()
    step = 4096
    for start in range(0, len(probes), step):
        chunk = probes[start : start + step]
        if normalize("|".join(chunk)) != "|".join(chunk):
            bad = next(p for p in chunk if normalize(p) != p)
            return f"the tokenizer's NFC changes {bad!r}, which Python's unicodedata calls NFC"
    return None


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


def _cached_core(hf: tokenizers.Tokenizer, d: Mapping[str, Any], key: bytes | None) -> _Core:
    if key is not None and key in _CORES:
        _CORES.move_to_end(key)
        hit = _CORES[key]
        if isinstance(hit, str):
            raise ValueError(hit)
        return hit
    try:
        core: _Core | str = _build_core(hf, d)
    except ValueError as e:
        core = str(e)
    if key is not None:
        _CORES[key] = core
        while len(_CORES) > _CORES_MAX:
            _CORES.popitem(last=False)
    if isinstance(core, str):
        raise ValueError(core)
    return core


def _build_core(hf: tokenizers.Tokenizer, d: Mapping[str, Any]) -> _Core:
    """The checks of the model, pre-tokenizer and normalizer, and the tiktoken encoding (raises
    ValueError with the reason when the structure is not supported)."""
    model = d.get("model") or {}
    ignore_merges = _check_model(model)
    pattern = _pre_tokenizer_pattern(d.get("pre_tokenizer"))
    nfc = _normalizer_is_nfc(d.get("normalizer"))
    if nfc:
        assert hf.normalizer is not None
        why = _nfc_agrees(hf.normalizer.normalize_str)
        if why is not None:
            raise ValueError(why)
    vocab: Mapping[str, int] = model.get("vocab") or {}
    ranks = _ranks(vocab)
    pairs = _merge_pairs(model.get("merges") or [])
    all_splits = _check_merges(vocab, pairs, need_layout=ignore_merges)
    if ignore_merges and not all_splits:
        # HF looks whole words up, but whether its merges alone reach each token is unchecked
        raise ValueError("ignore_merges with one merge per token (not all splits)")
    if not ignore_merges:
        merge_results = {vocab[a + b] for a, b in pairs}
        failing = set(_self_encoding_tokens(hf, vocab, ranks))
        if failing & merge_results:
            raise ValueError(
                f"tokens {sorted(failing & merge_results)[:5]} are merge results but do not encode "
                "to themselves"
            )
        # No merge gives them and HF does not look words up: HF never produces them, and without
        # them in the ranks neither does tiktoken (GPT-2's "<|endoftext|>").
        ranks = {tok: i for tok, i in ranks.items() if i not in failing}
    try:
        encoding = tiktoken.Encoding(
            "shepherd-fast-bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens={}
        )
    except Exception as e:  # tiktoken's regex engine refusing the pattern, mostly
        raise ValueError(f"tiktoken refuses the tokenizer: {type(e).__name__}: {e}") from e
    description = (
        f"{'GPT-2 pattern' if pattern == GPT2_PATTERN else 'Split regex'}, "
        f"{'NFC' if nfc else 'no normalizer'}, "
        f"merges: {'all splits' if all_splits else 'one merge per token'}, ignore_merges={ignore_merges}"
    )
    return _Core(encoding, pattern, nfc, description)


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
        self._encode_ordinary = core.encoding.encode_ordinary
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
        cls, hf: tokenizers.Tokenizer, tokenizer_json: Mapping[str, Any], *, content_key: bytes | None = None
    ) -> tuple[FastBPE | None, str]:
        """``(encoder, what it does)`` or ``(None, why not)``."""
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
            core = _cached_core(hf, tokenizer_json, content_key)
            wrap = _learn_wrap(hf, tokenizer_json.get("post_processor"))
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


def fast_bpe_for(
    hf: tokenizers.Tokenizer,
    tokenizer_json: Mapping[str, Any] | None = None,
    *,
    content_key: bytes | None = None,
) -> tuple[FastBPE | None, str]:
    """``FastBPE.build_with_reason`` once per tokenizer object: later calls for the same ``hf`` get
    the same encoder. ``tokenizer_json`` defaults to ``hf.to_str()`` parsed."""
    fp = _fingerprint(hf)
    hit = _BUILT.get(hf)
    if hit is not None and hit[0] == fp:
        return hit[1], hit[2]
    d = tokenizer_json if tokenizer_json is not None else orjson.loads(hf.to_str())
    fast, why = FastBPE.build_with_reason(hf, d, content_key=content_key)
    if fast is None:
        log.info("fast BPE off: %s", why)
    _BUILT[hf] = (fp, fast, why)
    return fast, why
