"""Engine logprobs (``TokenLogprob``) to the OpenAI wire formats.

Token strings come from the tokenizer's vocabulary, not from decoding each id alone: a byte-level BPE
token is mapped back through the GPT-2 byte table to its real bytes, a SentencePiece byte-fallback
piece ``<0xE4>`` is the byte 0xE4, ``▁`` is a space. A token holding part of a UTF-8 sequence keeps
its exact bytes in ``"bytes"`` and gets a best-effort string with the incomplete bytes escaped
(``"\\xe4\\xbd"``, as OpenAI and DeepSeek render them) rather than U+FFFD.

- ``chat_logprobs``/``chat_logprob_entries``: ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}]}]}``.
- ``completion_logprobs``: the legacy ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``;
  streaming callers carry the returned next text offset to the next chunk.
- ``prompt_completion_logprobs``: the same lists over a prompt (``echo`` with ``logprobs``): its first
  token, which has no logprob, has null ``token_logprobs`` and ``top_logprobs`` entries, as vLLM's.
- ``vllm_prompt_logprobs``: vLLM's ``prompt_logprobs`` list: null, then per position
  ``{"<token id>": {"logprob", "rank", "decoded_token"}}``, the prompt token first.
- ``sglang_token_logprobs``/``sglang_top_logprobs``/``sglang_prompt_logprobs``: SGLang's native
  ``meta_info`` lists (``/generate`` with ``return_logprob``): ``[logprob, token id, text or null]`` per
  position, and per position a list of those for the alternatives (null where there are none).
- ``TokenTextCache.for_tokenizer(tok)``: id -> ``TokenText`` (string, bytes, special, width), shared
  per tokenizer object and filled lazily.

Logprobs that JSON cannot carry (-inf, NaN) become -9999.0, as OpenAI and vLLM send them.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final

from tokenizers import Tokenizer

from shepherd.proto.engine_types import PromptLogprobs, TokenLogprob

__all__ = [
    "MIN_LOGPROB",
    "TokenText",
    "TokenTextCache",
    "chat_logprob_entries",
    "chat_logprobs",
    "completion_logprobs",
    "json_logprob",
    "prompt_completion_logprobs",
    "sglang_prompt_logprobs",
    "sglang_token_logprobs",
    "sglang_top_logprobs",
    "vllm_prompt_logprobs",
]

MIN_LOGPROB: Final = -9999.0
JsonDict = dict[str, object]


def json_logprob(value: float) -> float:
    """``value`` if JSON can carry it, else -9999.0 (for -inf and NaN)."""
    return value if value >= MIN_LOGPROB else MIN_LOGPROB


def _gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode`` (used by every byte-level BPE tokenizer)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in table.items()}


_BYTE_DECODER: Final = _gpt2_byte_decoder()


@dataclass(frozen=True, slots=True)
class TokenText:
    """One token as the API shows it.

    ``text``: best-effort string (incomplete UTF-8 escaped as ``\\xNN``); ``raw``: the exact bytes;
    ``byte_list``: ``raw`` as ints for JSON; ``special``: a special added token (dropped from the
    text when ``skip_special_tokens``); ``width``: characters it adds to the decoded text (a character
    split over tokens counts for the token holding its first byte).
    """

    text: str
    raw: bytes
    byte_list: tuple[int, ...]
    special: bool
    width: int


def _token_text(raw: bytes, special: bool) -> TokenText:
    text = raw.decode("utf-8", errors="backslashreplace")
    width = sum(1 for b in raw if b & 0xC0 != 0x80)
    return TokenText(text, raw, tuple(raw), special, width)


class TokenTextCache:
    """id -> ``TokenText`` for one tokenizer, computed on first use. Thread-safe enough: a race only
    computes an entry twice."""

    __slots__ = (
        "_added",
        "_byte_fallback",
        "_byte_level",
        "_entries",
        "_prefix",
        "_replace",
        "_tok",
    )

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._entries: dict[int, TokenText] = {}
        self._added = {i: (t.content, t.special) for i, t in tokenizer.get_added_tokens_decoder().items()}
        self._byte_level = False
        self._byte_fallback = False
        self._replace: list[tuple[str, str]] = []
        self._prefix = ""  # WordPiece continuation prefix
        if tokenizer.decoder is not None:
            self._inspect(json.loads(tokenizer.decoder.__getstate__()))

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> TokenTextCache:
        """The cache shared by every user of ``tokenizer`` (kept while the tokenizer lives)."""
        cache = _SHARED.get(tokenizer)
        if cache is None:
            with _SHARED_LOCK:
                cache = _SHARED.get(tokenizer)
                if cache is None:
                    cache = _SHARED[tokenizer] = cls(tokenizer)
        return cache

    def get(self, token_id: int) -> TokenText:
        entry = self._entries.get(token_id)
        if entry is None:
            entry = self._entries[token_id] = self._compute(token_id)
        return entry

    def __len__(self) -> int:
        return len(self._entries)

    def _inspect(self, spec: dict[str, object]) -> None:
        kind = spec.get("type")
        if kind == "Sequence":
            inner = spec.get("decoders")
            if isinstance(inner, list):
                for d in inner:
                    if isinstance(d, dict):
                        self._inspect(d)
        elif kind == "ByteLevel":
            self._byte_level = True
        elif kind == "ByteFallback":
            self._byte_fallback = True
        elif kind == "Metaspace":
            replacement = spec.get("replacement")
            if isinstance(replacement, str) and replacement:
                self._replace.append((replacement, " "))
        elif kind == "Replace":
            pattern, content = spec.get("pattern"), spec.get("content")
            if (
                isinstance(pattern, dict)
                and isinstance(pattern.get("String"), str)
                and isinstance(content, str)
            ):
                self._replace.append((pattern["String"], content))
        elif kind == "WordPiece":
            prefix = spec.get("prefix")
            if isinstance(prefix, str):
                self._prefix = prefix

    def _compute(self, token_id: int) -> TokenText:
        added = self._added.get(token_id)
        if added is not None:
            return _token_text(added[0].encode(), added[1])
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return _token_text(b"", False)
        if self._byte_level:
            try:
                return _token_text(bytes([_BYTE_DECODER[c] for c in piece]), False)
            except KeyError:
                pass
        if self._byte_fallback and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return _token_text(bytes([int(piece[3:5], 16)]), False)
            except ValueError:
                pass
        if self._prefix and piece.startswith(self._prefix):
            piece = piece[len(self._prefix) :]
        for old, new in self._replace:
            piece = piece.replace(old, new)
        return _token_text(piece.encode(), False)


_SHARED: weakref.WeakKeyDictionary[Tokenizer, TokenTextCache] = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


def _top_entry(cache: TokenTextCache, token_id: int, logprob: float, as_ids: bool) -> JsonDict:
    t = cache.get(token_id)
    return {
        "token": f"token_id:{token_id}" if as_ids else t.text,
        "logprob": json_logprob(logprob),
        "bytes": t.byte_list,
    }


def chat_logprob_entries(
    logprobs: Sequence[TokenLogprob],
    cache: TokenTextCache,
    top_logprobs: int = 0,
    *,
    tokens_as_ids: bool = False,
) -> list[JsonDict]:
    """The ``content`` list of chat logprobs for these tokens (``top_logprobs``: how many alternatives;
    ``tokens_as_ids``: vLLM's ``return_tokens_as_token_ids``, tokens as ``"token_id:<id>"``)."""
    out: list[JsonDict] = []
    for lp in logprobs:
        entry = _top_entry(cache, lp.token_id, lp.logprob, tokens_as_ids)
        entry["top_logprobs"] = (
            [_top_entry(cache, tid, tlp, tokens_as_ids) for tid, tlp in lp.top[:top_logprobs]]
            if top_logprobs > 0
            else []
        )
        out.append(entry)
    return out


def chat_logprobs(
    logprobs: Sequence[TokenLogprob],
    cache: TokenTextCache,
    top_logprobs: int = 0,
    *,
    tokens_as_ids: bool = False,
) -> JsonDict:
    """``{"content": [...]}`` for a chat choice (or one streamed chunk of it)."""
    return {"content": chat_logprob_entries(logprobs, cache, top_logprobs, tokens_as_ids=tokens_as_ids)}


def completion_logprobs(
    logprobs: Sequence[TokenLogprob],
    cache: TokenTextCache,
    top_logprobs: int = 0,
    *,
    text_offset: int = 0,
    skip_special_tokens: bool = True,
    tokens_as_ids: bool = False,
) -> tuple[JsonDict, int]:
    """Legacy completions logprobs and the text offset after these tokens.

    ``top_logprobs``: the request's ``logprobs`` number; each position's dict holds that many
    alternatives plus the sampled token (up to n+1 entries, as the API documents: with 0, the sampled
    token alone, as vLLM's ``_create_completion_logprobs`` keeps it). ``text_offset``: the
    character offset of the first token in the returned text (the prompt's length with ``echo``).
    Special tokens have zero width when ``skip_special_tokens`` (they are not in the text).
    """
    items = ((lp.token_id, lp.logprob, lp.top) for lp in logprobs)
    return _completion_block(items, cache, top_logprobs, text_offset, skip_special_tokens, tokens_as_ids)


def _by_value(alt: tuple[int, float]) -> float:
    return -alt[1]


def _completion_block(
    items: Iterable[tuple[int, float | None, Sequence[tuple[int, float]]]],
    cache: TokenTextCache,
    top_logprobs: int,
    offset: int,
    skip_special_tokens: bool,
    tokens_as_ids: bool,
) -> tuple[JsonDict, int]:
    """Completions logprobs over ``(token id, its logprob or None, best alternatives)``: a position
    without a logprob has null ``token_logprobs`` and ``top_logprobs`` entries (vLLM's, for the
    prompt's first token); and the text offset after them."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for tid, value, alts in items:
        t = cache.get(tid)
        name = f"token_id:{tid}" if tokens_as_ids else t.text
        tokens.append(name)
        if value is None:
            token_logprobs.append(None)
            tops.append(None)
        else:
            logprob = json_logprob(value)
            token_logprobs.append(logprob)
            top: dict[str, float] = {}
            # the best top_logprobs by value, then the token if not among them (vLLM's: up to n + 1
            # entries); by value, as vLLM's servicer lists a prompt token first whatever its rank
            for alt, alp in sorted(alts, key=_by_value)[:top_logprobs]:
                top.setdefault(f"token_id:{alt}" if tokens_as_ids else cache.get(alt).text, json_logprob(alp))
            top.setdefault(name, logprob)
            tops.append(top)
        offsets.append(offset)
        if not (t.special and skip_special_tokens):
            offset += t.width
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }, offset


def prompt_completion_logprobs(
    plp: PromptLogprobs,
    cache: TokenTextCache,
    top_logprobs: int = 0,
    *,
    positions: int | None = None,
    skip_special_tokens: bool = True,
    tokens_as_ids: bool = False,
) -> tuple[JsonDict, int]:
    """Legacy completions logprobs over the prompt (``echo`` with ``logprobs``), from text offset 0, and
    the offset after it. As vLLM's ``_create_completion_logprobs`` over its prompt logprobs: a position
    without a logprob (the first token's) has a null ``token_logprobs`` and ``top_logprobs`` entry;
    the others as ``completion_logprobs`` (the ``top_logprobs`` best alternatives and the token itself).
    ``positions``: the prompt's length (an engine repeating the list is read once)."""
    n = len(plp) if positions is None else min(positions, len(plp))
    ids, vals = plp.token_ids, plp.logprobs

    def items() -> Iterator[tuple[int, float | None, Sequence[tuple[int, float]]]]:
        for i in range(n):
            v = vals[i] if i < len(vals) else None
            yield ids[i], v, (plp.top(i) if v is not None and top_logprobs > 0 else ())

    return _completion_block(items(), cache, top_logprobs, 0, skip_special_tokens, tokens_as_ids)


def vllm_prompt_logprobs(
    plp: PromptLogprobs, cache: TokenTextCache, k: int, *, positions: int | None = None
) -> list[dict[str, dict[str, object]] | None]:
    """vLLM's ``prompt_logprobs`` (``CompletionResponseChoice.prompt_logprobs``, chat's top-level
    ``ChatCompletionResponse.prompt_logprobs``): per prompt position None when it has no logprob (the
    first), else ``{"<id>": {"logprob", "rank", "decoded_token"}}``: the prompt token first, then the
    position's ``k`` best tokens, each once (vLLM's ``append_logprobs_for_next_position``: ``k`` entries
    when the prompt token is among the ``k`` best, ``k + 1`` when it is not). Neither engine's gRPC
    answer carries a rank; the alternatives come best first, so a token's rank is one more than the
    listed tokens above it: exact for the alternatives, and for the prompt token when it is among the
    best the engine listed (else the least rank consistent with them). -inf is -9999.0, as vLLM's
    ``clamp_prompt_logprobs``."""
    out: list[dict[str, dict[str, object]] | None] = []
    n = len(plp) if positions is None else min(positions, len(plp))
    ids, vals = plp.token_ids, plp.logprobs
    for i in range(n):
        v = vals[i] if i < len(vals) else None
        if v is None:
            out.append(None)
            continue
        tid = ids[i]
        alts = [(alt, alp) for alt, alp in plp.top(i) if alt != tid]
        rank = 1 + sum(1 for _, alp in alts if alp > v)
        pos: dict[str, dict[str, object]] = {
            str(tid): {"logprob": json_logprob(v), "rank": rank, "decoded_token": cache.get(tid).text}
        }
        # the k best: the prompt token in its place (its rank) when it is one of them, the alternatives
        # ranked around it
        above = alts[: rank - 1] if rank <= k else alts[:k]
        below = alts[rank - 1 : k - 1] if rank <= k else []
        ranked = [
            *zip(above, range(1, k + 1), strict=False),
            *zip(below, range(rank + 1, k + 1), strict=False),
        ]
        for (alt, alp), j in ranked:
            key = str(alt)
            if key not in pos:
                pos[key] = {"logprob": json_logprob(alp), "rank": j, "decoded_token": cache.get(alt).text}
        out.append(pos)
    return out


# SGLang's native lists: a position is ``[logprob, token id, text]`` (the text null unless asked:
# ``return_text_in_logprobs``; the token decoded alone, as its ``tokenizer.batch_decode``)
SglangEntry = list[float | int | str | None]


def sglang_token_logprobs(
    logprobs: Sequence[TokenLogprob], text: Callable[[int], str] | None = None
) -> list[SglangEntry]:
    """SGLang's ``output_token_logprobs``: ``[logprob, token id, text or null]`` per output token."""
    return [[json_logprob(lp.logprob), lp.token_id, text(lp.token_id) if text else None] for lp in logprobs]


def sglang_top_logprobs(
    logprobs: Sequence[TokenLogprob], k: int, text: Callable[[int], str] | None = None
) -> list[list[SglangEntry] | None]:
    """SGLang's ``output_top_logprobs``: per output token its ``k`` best alternatives as
    ``[logprob, token id, text or null]``, best first (null: the engine sent none for it)."""
    return [
        [[json_logprob(v), t, text(t) if text else None] for t, v in lp.top[:k]] if lp.top else None
        for lp in logprobs
    ]


def sglang_prompt_logprobs(
    plp: PromptLogprobs,
    ids: Sequence[int],
    start: int,
    k: int,
    text: Callable[[int], str] | None = None,
) -> tuple[list[SglangEntry], list[list[SglangEntry] | None]]:
    """SGLang's ``input_token_logprobs`` and ``input_top_logprobs`` of prompt ``ids`` from position
    ``start`` (its ``logprob_start_len``): one entry per position from there, the first with a null
    logprob and no alternatives whatever ``start`` is (SGLang pads it so: its prefill computes the
    logprobs of the positions after it), the others the engine's value and its ``k`` best alternatives
    (by value: vLLM's servicer lists the prompt token first whatever its rank)."""
    vals = plp.logprobs
    tokens: list[SglangEntry] = []
    tops: list[list[SglangEntry] | None] = []
    for i in range(start, len(ids)):
        tid = ids[i]
        v = vals[i] if i > start and i < len(vals) else None
        tokens.append([None if v is None else json_logprob(v), tid, text(tid) if text else None])
        if v is None or k <= 0:
            tops.append(None)
            continue
        best = sorted(plp.top(i), key=_by_value)[:k]
        tops.append([[json_logprob(a), t, text(t) if text else None] for t, a in best])
    return tokens, tops
