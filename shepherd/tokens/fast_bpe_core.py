"""What ``tokenizer.json`` alone determines for ``FastBPE`` (fast_bpe.py): the checks of its structure,
and the tiktoken core built on the tokenizer's own ranks (``_Core``, kept per file content).

Checked: model BPE without dropout, byte fallback, subword prefix or word suffix, every single byte in
the vocabulary; pre-tokenizer ``Split(Regex, Isolated)`` followed by ``ByteLevel(use_regex=False)``, or
``ByteLevel(use_regex=True)`` alone (the GPT-2 pattern), without ``add_prefix_space``; normalizer none
(or an empty sequence) or NFC, whose tables must agree with Python's; merges that make HF's
merge-priority BPE the same function as tiktoken's rank BPE (below). The byte-level tables
(``byte_level_decoder``) are here too.

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
"""

from __future__ import annotations

import functools
import itertools
import json
import unicodedata
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import tiktoken
import tokenizers

from shepherd.tokens.table_cache import (
    Record,
    cache_path,
    code_digest,
    forget,
    load_record,
    read_kept,
    store_record,
)

__all__ = ["GPT2_PATTERN", "byte_level_decoder"]

# tokenizers' ByteLevel pre-tokenizer regex (use_regex=True)
GPT2_PATTERN: Final = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


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
    ranks: dict[bytes, int]  # the encoding's ranks (each byte-level token's bytes → id), the same dict
    post_processor: Any  # the file's ``post_processor`` (JSON)


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
    # The ids as int objects of their own, made in a row (``range`` makes one per item): the parsed
    # JSON's ints lie scattered among its strings, and the ranks live as long as the process, so
    # keeping those kept ~17 MB of the parse's pages (mostly free space) that a forked pool shares
    # and that the parent then copied as it filled them (bench/memory_bench.py).
    top = max((i for i in vocab.values() if type(i) is int), default=-1)
    ids = range(top + 1)

    def own(i: int) -> int:
        return ids[i] if type(i) is int and 0 <= i <= top else i

    try:  # all of it at once: one character is one byte
        blob = "".join(vocab).translate(table).encode("latin-1")
    except UnicodeEncodeError:
        for tok, i in vocab.items():
            try:
                ranks[tok.translate(table).encode("latin-1")] = own(i)
            except UnicodeEncodeError:
                continue
    else:
        pos = 0
        for tok, i in vocab.items():
            end = pos + len(tok)
            ranks[blob[pos:end]] = own(i)
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


def _nfc_probes() -> Iterator[str]:
    """Short texts that Python calls NFC, around every character of planes 0-2 that Python's Unicode
    database gives a combining class or a canonical decomposition (in the contexts where a wrong
    class or decomposition shows), and around every code point of planes 0-1 it has unassigned (which
    a newer table could make a mark: reordered against U+0316 / U+0301 then). Generated, not kept:
    139k strings, 12 MB that a cache held for the life of the process (80 ms to make again)."""
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
        yield from (t for t in texts if unicodedata.is_normalized("NFC", t))


def _nfc_agrees(normalize: Callable[[str], str]) -> str | None:
    """None when the tokenizer's NFC leaves alone all text Python calls NFC; else why not.

    Python's tables (Unicode 14 in 3.11) are newer than tokenizers' (there, a few dozen marks of
    Unicode 11-14 are class-0 starters): so text NFC in Python's view is NFC in tokenizers' too, and
    only text Python would change needs the tokenizer's own (slower) normalizer. Probed, since a
    later tokenizers could have newer tables than the Python running it."""
    probes = _nfc_probes()
    while chunk := list(itertools.islice(probes, 4096)):
        if normalize("|".join(chunk)) != "|".join(chunk):
            bad = next(p for p in chunk if normalize(p) != p)
            return f"the tokenizer's NFC changes {bad!r}, which Python's unicodedata calls NFC"
    return None


# ---- what is kept on disk ------------------------------------------------------------------------------
# The structural checks below take ~0.6 s for a 150k vocabulary, parsing the file and making the ranks
# ~0.5 s more, at every process start (node, tokenizer pool, engine). What they give depends on the
# file's content, the tokenizers library (its normalizer and model), Python's Unicode tables and this
# module alone: kept per those (``table_cache``) under bpe-checks/ (the verdict, a small JSON file, also
# when the tokenizer is refused) and bpe-cores/ (a core's pattern, flags, post-processor and ranks).
_VERDICT_FORMAT: Final = 1
_CORE_FORMAT: Final = 1


def _code(fmt: int) -> bytes | None:
    """This module's source digest and a record format's number (None: no source to digest)."""
    d = code_digest(__file__)
    return None if d is None else d + bytes([fmt])


def _verdict_path(key: bytes) -> Path | None:
    return cache_path("bpe-checks", key, _code(_VERDICT_FORMAT), ".json")


def _load_verdict(key: bytes) -> dict[str, Any] | None:
    data = read_kept(_verdict_path(key))
    if data is None:
        return None
    try:
        got = json.loads(data)
    except ValueError:
        return None
    ok = isinstance(got, dict) and (
        isinstance(got.get("error"), str)
        or (
            isinstance(got.get("all_splits"), bool)
            and isinstance(got.get("failing"), list)
            and all(isinstance(i, int) for i in got["failing"])
        )
    )
    return got if ok else None


def _store_verdict(key: bytes, verdict: dict[str, Any]) -> None:
    store_record(_verdict_path(key), json.dumps(verdict).encode())


def _core_path(key: bytes) -> Path | None:
    return cache_path("bpe-cores", key, _code(_CORE_FORMAT))


def _store_core(key: bytes, core: _Core) -> None:
    header = {
        "pattern": core.pattern,
        "nfc": core.nfc,
        "description": core.description,
        "post_processor": core.post_processor,
    }
    store_record(_core_path(key), Record(header, [list(core.ranks)], [list(core.ranks.values())]).dump())


def _load_core(key: bytes) -> _Core | None:
    """The core kept for ``key``, or None (none kept, or a record that is not a core's)."""
    rec = load_record(_core_path(key))
    if rec is None or len(rec.blobs) != 1 or len(rec.ints) != 1 or len(rec.blobs[0]) != len(rec.ints[0]):
        return None
    h = rec.header
    pattern, nfc, description = h.get("pattern"), h.get("nfc"), h.get("description")
    if not (isinstance(pattern, str) and isinstance(nfc, bool) and isinstance(description, str)):
        return None
    ranks = dict(zip(rec.blobs[0], rec.ints[0], strict=True))
    try:
        return _Core(_encoding(pattern, ranks), pattern, nfc, description, ranks, h.get("post_processor"))
    except ValueError:
        return None


def _checks(
    hf: tokenizers.Tokenizer,
    model: Mapping[str, Any],
    vocab: Mapping[str, int],
    ranks: Mapping[bytes, int],
    *,
    ignore_merges: bool,
    nfc: bool,
) -> tuple[bool, set[int]]:
    """The expensive checks (raise ValueError with the reason): whether the merges are all the splits, and
    the ids HF's model does not encode as themselves (left out of the ranks)."""
    if nfc:
        assert hf.normalizer is not None
        why = _nfc_agrees(hf.normalizer.normalize_str)
        if why is not None:
            raise ValueError(why)
    pairs = _merge_pairs(model.get("merges") or [])
    all_splits = _check_merges(vocab, pairs, need_layout=ignore_merges)
    if ignore_merges and not all_splits:
        # HF looks whole words up, but whether its merges alone reach each token is unchecked
        raise ValueError("ignore_merges with one merge per token (not all splits)")
    if ignore_merges:
        return all_splits, set()
    merge_results = {vocab[a + b] for a, b in pairs}
    failing = set(_self_encoding_tokens(hf, vocab, ranks))
    if failing & merge_results:
        raise ValueError(
            f"tokens {sorted(failing & merge_results)[:5]} are merge results but do not encode to themselves"
        )
    return all_splits, failing


def _cached_core(
    hf: tokenizers.Tokenizer,
    source: Callable[[], Mapping[str, Any]],
    key: bytes | None,
    *,
    rebuild: bool = False,
) -> _Core:
    """The core of the file whose content has digest ``key``: this process's, the one kept on disk, or
    built from ``source()`` (the parsed tokenizer.json, asked for only then) and kept. ``rebuild``: a
    core taken before failed its use's checks: built again from the file, and kept in its place."""
    if rebuild and key is not None:
        _CORES.pop(key, None)
        forget(_core_path(key))
    if key is not None and key in _CORES:
        _CORES.move_to_end(key)
        hit = _CORES[key]
        if isinstance(hit, str):
            raise ValueError(hit)
        return hit
    core: _Core | str | None = _load_core(key) if key is not None and not rebuild else None
    if core is None:
        try:
            core = _build_core(hf, source(), key)
        except ValueError as e:
            core = str(e)
        else:
            if key is not None:
                _store_core(key, core)
    if key is not None:
        _CORES[key] = core
        while len(_CORES) > _CORES_MAX:
            _CORES.popitem(last=False)
    if isinstance(core, str):
        raise ValueError(core)
    return core


def _encoding(pattern: str, ranks: dict[bytes, int]) -> tiktoken.Encoding:
    try:
        return tiktoken.Encoding(
            "shepherd-fast-bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens={}
        )
    except Exception as e:  # tiktoken's regex engine refusing the pattern, mostly
        raise ValueError(f"tiktoken refuses the tokenizer: {type(e).__name__}: {e}") from e


def _build_core(hf: tokenizers.Tokenizer, d: Mapping[str, Any], key: bytes | None = None) -> _Core:
    """The checks of the model, pre-tokenizer and normalizer, and the tiktoken encoding (raises
    ValueError with the reason when the structure is not supported). ``key`` (the file's digest): the
    expensive checks' verdict is taken from, or kept in, the disk cache above."""
    model = d.get("model") or {}
    ignore_merges = _check_model(model)
    pattern = _pre_tokenizer_pattern(d.get("pre_tokenizer"))
    nfc = _normalizer_is_nfc(d.get("normalizer"))
    vocab: Mapping[str, int] = model.get("vocab") or {}
    ranks = _ranks(vocab)
    verdict = _load_verdict(key) if key is not None else None
    if verdict is None:
        try:
            all_splits, failing = _checks(hf, model, vocab, ranks, ignore_merges=ignore_merges, nfc=nfc)
            verdict = {"all_splits": all_splits, "failing": sorted(failing)}
        except ValueError as e:
            verdict = {"error": str(e)}
        if key is not None:
            _store_verdict(key, verdict)
    if "error" in verdict:
        raise ValueError(verdict["error"])
    all_splits = verdict["all_splits"]
    if verdict["failing"]:
        # No merge gives them and HF does not look words up: HF never produces them, and without
        # them in the ranks neither does tiktoken (GPT-2's "<|endoftext|>").
        failing = set(verdict["failing"])
        ranks = {tok: i for tok, i in ranks.items() if i not in failing}
    encoding = _encoding(pattern, ranks)
    description = (
        f"{'GPT-2 pattern' if pattern == GPT2_PATTERN else 'Split regex'}, "
        f"{'NFC' if nfc else 'no normalizer'}, "
        f"merges: {'all splits' if all_splits else 'one merge per token'}, ignore_merges={ignore_merges}"
    )
    return _Core(encoding, pattern, nfc, description, ranks, d.get("post_processor"))
