"""Incremental detokenization: output token ids in, text that is final out.

Built on ``tokenizers.decoders.DecodeStream`` (the prefix/read-offset technique of vLLM and HF-TGI,
run inside the Rust library: one call per step, about 1 µs per token, half the cost of the same
algorithm driven from Python; see bench/detok_bench.py). The wrapper adds what DecodeStream lacks:

- left context from the prompt, so a SentencePiece/metaspace first token keeps its leading space
  (``"▁Paris"`` after a prompt is ``" Paris"``, as vLLM and SGLang report it);
- ``finish()``: text held back because it ends in an incomplete UTF-8 sequence is flushed at the end
  (as U+FFFD, exactly as a one-shot ``decode`` renders it);
- bounded work per step: after ``_MAX_PENDING`` ids without new text (a run of skipped special tokens,
  or garbage bytes) the held ids are flushed and the stream restarted, so the decode window never grows
  without bound; a DecodeStream "invalid prefix" error (byte-fallback garbage) is recovered the same way;
- ``special_ids``: extra ids to drop when ``skip_special_tokens``; ``spaces_between_special_tokens``.

Invariant (for any chunking of ids that decode to valid text): the concatenation of everything ``step``
and ``finish`` return equals ``tokenizer.decode(ids, skip_special_tokens=...)``, and no returned piece
ends in a U+FFFD that a later id would have completed into a character.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence, Set
from typing import Final

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

__all__ = ["IncrementalDetokenizer", "added_token_contents"]

REPLACEMENT_CHAR: Final = "\ufffd"
_CONTEXT_IDS: Final = 6  # ids of left context (prompt tail, or last emitted ids) for priming and flushes
_MAX_PENDING: Final = 32  # ids held without new text before a forced flush
_MAX_PARTIAL_IDS: Final = 4  # a UTF-8 character spans at most 4 bytes, so at most 4 trailing ids

_ADDED: weakref.WeakKeyDictionary[Tokenizer, dict[int, str]] = weakref.WeakKeyDictionary()


def added_token_contents(tokenizer: Tokenizer) -> dict[int, str]:
    """id -> content of every added token of ``tokenizer`` (special or not); cached per tokenizer."""
    table = _ADDED.get(tokenizer)
    if table is None:
        table = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        _ADDED[tokenizer] = table
    return table


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text, one chunk of ids at a time.

    ``tokenizer`` is the raw ``tokenizers.Tokenizer``. ``skip_special_tokens`` drops the tokens the
    tokenizer marks special (and any id in ``special_ids``); when false they are rendered as their
    content. Added tokens that are not special (Qwen3 ``<think>``, ``<tool_call>``) are always rendered,
    as in vLLM and SGLang. ``prompt_ids``: the prompt (only its last few ids are used) as left context.
    ``spaces_between_special_tokens=False`` (with ``skip_special_tokens=False``) renders consecutive
    added tokens without a separating space; tokenizers with a decoder never insert one anyway, so it
    only changes the output of decoder-less tokenizers (vLLM's behaviour).
    """

    __slots__ = (
        "_added",
        "_context",
        "_drop",
        "_emitted",
        "_finished",
        "_ids",
        "_last_added",
        "_parts",
        "_skip",
        "_stream",
        "_tok",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        special_ids: Set[int] | None = None,
        prompt_ids: Sequence[int] | None = None,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._drop: Set[int] = special_ids if (skip_special_tokens and special_ids) else frozenset()
        self._added: dict[int, str] | None = None
        if not skip_special_tokens and not spaces_between_special_tokens:
            self._added = added_token_contents(tokenizer) or None
        self._last_added = False
        self._ids: list[int] = []  # every output id fed (after dropping ``special_ids``)
        self._emitted = 0  # ids[:emitted] have produced all their text
        self._parts: list[str] = []
        self._finished = False
        context: list[int] = []
        if prompt_ids:
            context = [i for i in prompt_ids[-_CONTEXT_IDS:] if i not in self._drop]
        stream = self._primed(context)
        self._context = context if stream is not None else []  # left context before the first output
        self._stream = stream or DecodeStream(skip_special_tokens=skip_special_tokens)

    # -- public -----------------------------------------------------------------------------------

    @property
    def text(self) -> str:
        """Everything returned so far by ``step`` and ``finish``."""
        parts = self._parts
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0] if parts else ""

    @property
    def token_ids(self) -> Sequence[int]:
        """Output ids fed so far (ids in ``special_ids`` dropped when skipping)."""
        return self._ids

    @property
    def pending(self) -> int:
        """Number of trailing ids whose text is held back (incomplete character or no text yet)."""
        return len(self._ids) - self._emitted

    def step(self, ids: Sequence[int]) -> str:
        """Feed the next output ids; return the text that became final (often ``""``)."""
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer.step() after finish()")
        if self._drop and not self._drop.isdisjoint(ids):
            ids = [i for i in ids if i not in self._drop]
        if not ids:
            return ""
        if self._added is not None:
            out = "".join([self._step_added_aware(i) for i in ids])
        else:
            out = self._step(ids if type(ids) is list else list(ids))
        if out:
            self._parts.append(out)
        return out

    def finish(self) -> str:
        """End of output: return any held text (an incomplete UTF-8 tail renders as U+FFFD).

        Idempotent; ``step`` may not be called afterwards.
        """
        if self._finished:
            return ""
        self._finished = True
        if self._emitted == len(self._ids):
            return ""
        out = self._decode_after(self._left_context(), self._ids[self._emitted :])
        self._emitted = len(self._ids)
        if out:
            self._parts.append(out)
        return out

    # -- internals (they return text; ``step``/``finish`` record it) ------------------------------

    def _step(self, ids: list[int]) -> str:
        self._ids.extend(ids)
        try:
            out = self._stream.step(self._tok, ids[0] if len(ids) == 1 else ids)
        except Exception:  # DecodeStream "invalid prefix" (byte-fallback garbage): restart the stream
            return self._flush_pending(keep_partial=False)
        if out is None:
            if len(self._ids) - self._emitted > _MAX_PENDING:
                return self._flush_pending(keep_partial=True)
            return ""
        self._emitted = len(self._ids)
        return out

    def _step_added_aware(self, token_id: int) -> str:
        assert self._added is not None
        out = self._step([token_id])
        content = self._added.get(token_id)
        if content is not None and self._last_added and out:
            out = content  # drop the separator a decoder-less join puts before an added token
        self._last_added = content is not None
        return out

    def _primed(self, context: list[int]) -> DecodeStream | None:
        """A stream that has seen ``context``; None when the context ends mid-character (unusable:
        the stream would emit the context's tail with the first output)."""
        stream = DecodeStream(skip_special_tokens=self._skip)
        # step() gives None when the context decodes to nothing (fine) or ends mid-character.
        if (
            context
            and stream.step(self._tok, context) is None
            and self._tok.decode(context, skip_special_tokens=self._skip).endswith(REPLACEMENT_CHAR)
        ):
            return None
        return stream

    def _left_context(self) -> list[int]:
        emitted = self._emitted
        if emitted >= _CONTEXT_IDS or not self._context:
            return self._ids[max(0, emitted - _CONTEXT_IDS) : emitted]
        return (self._context + self._ids[:emitted])[-_CONTEXT_IDS:]

    def _decode_after(self, context: list[int], ids: list[int]) -> str:
        """Text of ``ids`` when they follow ``context`` (keeps metaspace leading spaces)."""
        decode = self._tok.decode
        if not context:
            return decode(ids, skip_special_tokens=self._skip)
        base = decode(context, skip_special_tokens=self._skip)
        full = decode(context + ids, skip_special_tokens=self._skip)
        if full.startswith(base):
            return full[len(base) :]
        return decode(ids, skip_special_tokens=self._skip)

    def _flush_pending(self, *, keep_partial: bool) -> str:
        """Return the held ids' text from a plain decode and restart the stream after them.

        With ``keep_partial``, trailing ids that end in an incomplete character stay held (re-fed to
        the new stream) unless no cut within the last few ids gives clean text (garbage bytes).
        """
        context = self._left_context()
        pending = self._ids[self._emitted :]
        text = self._decode_after(context, pending)
        keep = 0
        if keep_partial and text.endswith(REPLACEMENT_CHAR):
            for k in range(1, min(_MAX_PARTIAL_IDS, len(pending) - 1) + 1):
                cut = self._decode_after(context, pending[:-k])
                if not cut.endswith(REPLACEMENT_CHAR):
                    text, keep = cut, k
                    break
        self._emitted = len(self._ids) - keep
        self._stream = self._primed(self._left_context()) or DecodeStream(skip_special_tokens=self._skip)
        if keep:
            kept = self._ids[self._emitted :]
            del self._ids[self._emitted :]
            text += self._step(kept)
        return text
