"""Per-choice output state: token ids in, visible text out (detokenizer -> stop matcher), plus logprobs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from shepherd.node.openai.logprobs import TokenTextCache, chat_logprobs, completion_logprobs
from shepherd.node.openai.requests import Sampling
from shepherd.node.output.stop import StopMatcher, StoppingDecoder, StopResult
from shepherd.proto.engine_types import TokenLogprob
from shepherd.tokens.detokenizer import IncrementalDetokenizer, fresh_one_shot_equivalent
from shepherd.tokens.tokenizer import Tokenizer


class ChoiceState:
    """One choice of one request: engine token ids in (``feed`` per batch, or ``whole`` for a
    non-streamed answer), visible text out, plus the logprobs and the finish reason.

    Invariants: ``text`` holds exactly the text the client has been (or will be) shown, in order: held
    back text (a possible stop string's prefix) is never in it until it is known not to stop; once
    ``finished`` is True no call adds to ``text``, ``tokens`` or ``logprobs``; ``finish_reason`` is set
    with ``finished``: ``stop`` (a stop string or token, or the engine's own stop), ``length`` or
    ``abort``; ``tokens`` counts the engine tokens of every batch fed before the choice finished.
    Mutated only through ``feed``, ``whole`` and ``end``; one instance per choice, never shared.
    """

    __slots__ = (
        "_dec",
        "_plain",
        "_prompt",
        "_sampling",
        "finish_reason",
        "finished",
        "index",
        "kept",
        "logprobs",
        "matched",
        "matcher",
        "skip_special",
        "text",
        "tok",
        "tokens",
    )

    def __init__(self, index: int, tok: Tokenizer, s: Sampling, prompt_ids: Sequence[int] = ()) -> None:
        self.index = index
        self.matcher = StopMatcher(
            s.stop,
            include_stop_str_in_output=s.include_stop_str_in_output,
            stop_token_ids=s.stop_token_ids,
            eos_token_ids=tok.eos_token_ids,
            ignore_eos=s.ignore_eos,
            min_tokens=s.min_tokens,  # no stop string ends before min_tokens tokens, as vLLM checks them
        )
        # the detokenizer is built on first use: a non-streamed answer is usually decoded in one call
        self._dec: StoppingDecoder | None = None
        # with no stop string: (the detokenizer's step, the stop ids), once the detokenizer is built
        self._plain: tuple[Callable[[Sequence[int]], str], frozenset[int]] | None = None
        self._sampling = s
        self._prompt = prompt_ids
        self.tok = tok
        self.skip_special = s.skip_special_tokens
        self.finished = False
        self.finish_reason: str | None = None
        self.matched: str | int | None = None
        self.tokens = 0
        self.kept = 0  # of the ids of the last feed: those it counted (all but after a stop: see _count)
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []

    def restart(self, prompt_ids: Sequence[int]) -> ChoiceState:
        """A fresh state of the same choice (the same sampling and tokenizer): a whole answer asked again
        from the start on another worker."""
        return ChoiceState(self.index, self.tok, self._sampling, prompt_ids)

    @property
    def dec(self) -> StoppingDecoder:
        """The choice's detokenizer and stop matcher, wired."""
        d = self._dec
        if d is None:
            s = self._sampling
            detok = IncrementalDetokenizer(
                self.tok.hf,
                skip_special_tokens=s.skip_special_tokens,
                spaces_between_special_tokens=s.spaces_between_special_tokens,
                prompt_ids=self._prompt[-24:] or None,
            )
            d = self._dec = StoppingDecoder(detok, self.matcher)
            self._prompt = ()
            if not self.matcher.stop_strings:
                self._plain = (detok.step, self.matcher.stop_token_ids)
        return d

    def plain_detokenizer(self) -> tuple[IncrementalDetokenizer, frozenset[int]] | None:
        """With no stop string and the detokenizer built: it and the stop ids (``feed`` of ids none of which
        is a stop id adds the detokenizer's ``step`` as it is: what ``plain_step.PlainStep`` does in C)."""
        plain = self._plain
        if plain is None or self.finished:
            return None
        detok = self.dec.decoder
        return (detok, plain[1]) if type(detok) is IncrementalDetokenizer else None

    def _one_shot(self) -> bool:
        """Whether one decode of the whole output gives what the detokenizer would (without building
        it when a fresh one is known to agree)."""
        if self._dec is None:
            s = self._sampling
            if fresh_one_shot_equivalent(
                self.tok.hf,
                skip_special_tokens=s.skip_special_tokens,
                spaces_between_special_tokens=s.spaces_between_special_tokens,
                has_prompt=bool(self._prompt),
            ):
                return True
        detok = self.dec.decoder
        return isinstance(detok, IncrementalDetokenizer) and detok.one_shot_equivalent

    def feed(self, ids: Sequence[int], logprobs: Sequence[TokenLogprob] = ()) -> str:
        """New engine tokens -> newly visible text ('' if held back). Marks the choice finished on a stop."""
        if self.finished:
            return ""
        plain = self._plain
        if plain is not None and plain[1].isdisjoint(ids):
            # no stop string, no stop token in ids: the detokenized text is visible as it is
            # (StoppingDecoder.feed's own shortcut, without its call and result)
            self.tokens += len(ids)
            self.kept = len(ids)
            if logprobs:
                self.logprobs.extend(logprobs)
            text = plain[0](ids)
            if text:
                self.text.append(text)
            return text
        dec = self._dec
        if dec is None:
            dec = self.dec
        n: int | None = None
        if len(ids) > 1 and self.matcher.stop_strings:
            # a stop string may end inside this chunk: one token at a time, so that the tokens after the
            # one that completed it are neither shown nor counted (vLLM's usage ends at that token)
            parts: list[str] = []
            for n in range(1, len(ids) + 1):
                res = dec.feed(ids[n - 1 : n])
                if res.visible:
                    parts.append(res.visible)
                if res.finished:
                    break
            visible = "".join(parts)
        else:
            res = dec.feed(ids)
            visible = res.visible
        self._count(ids, logprobs, n, res)
        if res.finished:
            self.finished = True
            self.finish_reason = "stop"
            self.matched = res.matched
        if visible:
            self.text.append(visible)
        return visible

    def whole(self, ids: Sequence[int], logprobs: Sequence[TokenLogprob], reason: str) -> str:
        """The complete output at once (a non-streamed engine answer): one decode call instead of a
        detokenizer step per token, when that gives the same text; else the incremental path."""
        if self.finished:
            return ""
        if self.matcher.stop_strings or not self._one_shot():  # (a stop string: counted token by token)
            return self.feed(ids, logprobs) + self.end(reason)
        self.finished = True
        stop = self.matcher
        res = stop.feed(self.tok.decode(stop.text_ids(ids), skip_special_tokens=self.skip_special), ids)
        visible = res.visible
        self._count(ids, logprobs, None, res)
        if res.finished:
            self.finish_reason = "stop"
            self.matched = res.matched
        else:
            visible += stop.flush()
            self.finish_reason = reason if reason in ("length", "abort") else "stop"
        if visible:
            self.text.append(visible)
        return visible

    def _count(
        self, ids: Sequence[int], logprobs: Sequence[TokenLogprob], n: int | None, res: StopResult
    ) -> None:
        """The tokens of ``ids`` the choice produced, and their logprobs: the first ``n`` (the one that
        completed a stop string, fed one at a time), else up to a stop token (it counts; what came after it
        in its chunk does not), else all."""
        if n is None:
            i = self.matcher.stop_token_index(ids) if res.finished and isinstance(res.matched, int) else -1
            n = len(ids) if i < 0 else i + 1
        self.tokens += n
        self.kept = n
        if logprobs:
            self.logprobs.extend(logprobs[:n])

    def end(self, reason: str) -> str:
        """The engine finished this choice: release held text, settle the finish reason."""
        if self.finished:
            return ""
        self.finished = True
        res = self.dec.finish()
        if res.finished:
            self.finish_reason = "stop"
            self.matched = res.matched
        else:
            self.finish_reason = reason if reason in ("length", "abort") else "stop"
        if res.visible:
            self.text.append(res.visible)
        return res.visible

    def done(self) -> bool:
        return self.finished

    def full_text(self) -> str:
        return "".join(self.text)


class LogprobFormatter:
    """OpenAI logprobs blocks for one response (chat ``content`` lists, legacy completions lists)."""

    __slots__ = ("cache", "offsets", "skip_special", "tokens_as_ids")

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.cache = TokenTextCache.for_tokenizer(tok.hf)
        self.skip_special = skip_special_tokens
        self.offsets: dict[int, int] = {}  # completions: text offset per choice index
        self.tokens_as_ids = False  # vLLM's return_tokens_as_token_ids: tokens as "token_id:<id>"

    def chat(self, entries: Sequence[TokenLogprob], top: int) -> dict[str, Any]:
        return chat_logprobs(entries, self.cache, top, tokens_as_ids=self.tokens_as_ids)

    def completion(self, entries: Sequence[TokenLogprob], top: int, index: int = 0) -> dict[str, Any]:
        block, self.offsets[index] = completion_logprobs(
            entries,
            self.cache,
            top,
            text_offset=self.offsets.get(index, 0),
            skip_special_tokens=self.skip_special,
            tokens_as_ids=self.tokens_as_ids,
        )
        return block
