"""What the mock "model" says: deterministic, word-like output tokens, fake logprobs, scripted answers.

Output tokens are a deterministic function of (engine seed, request seed, prompt ids, sample index):
a fixed English paragraph is encoded once at start-up and each sample walks it (cyclically) from an
offset chosen by hashing those inputs, so decoded output reads like text. With temperature 0 the
sample index is left out, so all samples of a greedy request agree, as they would on a real engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shepherd.proto.engine_types import PromptLogprobs, TokenLogprob

PARAGRAPH = (
    "The river ran slowly past the old mill, and the morning light settled on the water like a thin "
    "sheet of gold. A few boats were tied along the bank, their ropes creaking as the current pulled "
    "at them. Near the bridge, a woman was selling bread and apples from a wooden cart, calling out "
    "prices to anyone who walked by. Children ran between the stalls, laughing, while their parents "
    "talked about the weather, the harvest, and the news from the city. Later in the day the wind "
    "turned cold, clouds gathered over the hills, and the first drops of rain began to fall on the "
    "roofs. People hurried home along the narrow streets, carrying baskets and umbrellas, and the "
    "square grew quiet again. In the evening the lamps were lit one by one, and the sound of music "
    "drifted out of an open window, soft and patient, as if it had all the time in the world."
)

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """The request fields that shape the output (wire-independent)."""

    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    greedy: bool = False
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class SamplePlan:
    """The whole output of one sample, decided when the request arrives."""

    token_ids: tuple[int, ...]
    finish_reason: str
    matched_token_id: int | None = None


@dataclass(frozen=True, slots=True)
class ScriptedResponse:
    """A queued answer: used (and consumed) by the first request whose decoded prompt contains ``match``."""

    token_ids: tuple[int, ...]  # the encoded text, plus EOS unless finish_reason says otherwise
    match: str = ""
    times: int = 1
    finish_reason: str | None = None
    text: str = ""


@dataclass(slots=True)
class _Slot:
    entry: ScriptedResponse
    remaining: int


class ScriptQueue:
    """First-match queue of scripted responses. Bounded."""

    def __init__(self, limit: int = 1024) -> None:
        self._slots: list[_Slot] = []
        self._limit = limit

    def __len__(self) -> int:
        return len(self._slots)

    def add(self, entry: ScriptedResponse) -> None:
        if len(self._slots) >= self._limit:
            raise ValueError(f"too many scripted responses (limit {self._limit})")
        if entry.times < 1:
            raise ValueError("times must be >= 1")
        self._slots.append(_Slot(entry, entry.times))

    def clear(self) -> None:
        self._slots.clear()

    def take(self, prompt_text: str) -> ScriptedResponse | None:
        """The first entry whose ``match`` occurs in ``prompt_text``, consuming one of its uses."""
        for i, slot in enumerate(self._slots):
            if slot.entry.match in prompt_text:
                slot.remaining -= 1
                if slot.remaining <= 0:
                    del self._slots[i]
                return slot.entry
        return None

    def snapshot(self) -> list[dict[str, object]]:
        return [
            {
                "text": s.entry.text,
                "match": s.entry.match,
                "remaining": s.remaining,
                "finish_reason": s.entry.finish_reason,
            }
            for s in self._slots
        ]


class OutputModel:
    """Deterministic output planner over a corpus of word-like token ids."""

    def __init__(
        self,
        corpus_ids: Sequence[int],
        eos_token_id: int,
        *,
        seed: int = 0,
        default_len: int = 32,
        vocab_size: int = 151_643,
        context_length: int = 32_768,
    ) -> None:
        if not corpus_ids:
            raise ValueError("empty corpus")
        self._corpus = tuple(corpus_ids)
        self.eos_token_id = eos_token_id
        self.seed = seed
        self.default_len = default_len
        self.vocab_size = max(vocab_size, 2)
        self.context_length = context_length

    def start_offset(self, prompt: tuple[int, ...], index: int, spec: OutputSpec) -> int:
        # ints only: the hash of a tuple of ints is the same in every process (hash(None) is not, in 3.11)
        request_seed = -1 if spec.seed is None else spec.seed
        h = hash((self.seed, request_seed, 0 if spec.greedy else index, prompt))
        return h % len(self._corpus)

    def plan(
        self,
        prompt: tuple[int, ...],
        spec: OutputSpec,
        index: int = 0,
        scripted: ScriptedResponse | None = None,
    ) -> SamplePlan:
        """The output of sample ``index``; ``max_new_tokens`` is assumed already clamped to the context."""
        limit = spec.max_new_tokens
        if scripted is not None:
            body: tuple[int, ...] = scripted.token_ids
            natural_finish = scripted.finish_reason or FINISH_STOP
            ends_with_eos = natural_finish == FINISH_STOP and bool(body) and body[-1] == self.eos_token_id
            if ends_with_eos and spec.ignore_eos:
                body = body[:-1]
                natural_finish = FINISH_LENGTH
        else:
            natural = max(self.default_len, spec.min_new_tokens)
            if spec.ignore_eos:
                natural = limit if limit is not None else natural
            body = self._walk(self.start_offset(prompt, index, spec), natural, spec)
            if spec.ignore_eos:
                natural_finish = FINISH_LENGTH
            else:
                body += (self.eos_token_id,)
                natural_finish = FINISH_STOP
        stop_ids = spec.stop_token_ids
        if stop_ids:
            for i in range(spec.min_new_tokens, len(body) if limit is None else min(len(body), limit)):
                if body[i] in stop_ids:
                    return SamplePlan(body[: i + 1], FINISH_STOP, body[i])
        if limit is not None and len(body) > limit:
            return SamplePlan(body[:limit], FINISH_LENGTH)
        if natural_finish == FINISH_STOP and body and body[-1] == self.eos_token_id:
            return SamplePlan(body, FINISH_STOP, self.eos_token_id)
        return SamplePlan(body, natural_finish)

    def _walk(self, offset: int, length: int, spec: OutputSpec) -> tuple[int, ...]:
        corpus = self._corpus
        n = len(corpus)
        if length <= 0:
            return ()
        reps = (offset + length) // n + 1
        out = (corpus * reps)[offset : offset + length]
        stop_ids = spec.stop_token_ids
        if stop_ids and spec.min_new_tokens and any(t in stop_ids for t in out[: spec.min_new_tokens]):
            # a real engine never samples a stop token before min_new_tokens: skip them in the walk
            kept: list[int] = []
            pos = offset
            for _ in range(length + n * 4):  # bounded even if every corpus token is a stop token
                t = corpus[pos % n]
                pos += 1
                if len(kept) < spec.min_new_tokens and t in stop_ids:
                    continue
                kept.append(t)
                if len(kept) == length:
                    break
            out = tuple(kept)
        return out

    def prompt_logprobs(self, prompt: Sequence[int], top_n: int | None) -> PromptLogprobs | None:
        """Deterministic fake prompt logprobs (None: ``top_n`` None, not asked), as ``logprobs`` makes them
        for each prompt token after the first (which has none): its alternatives, when ``top_n``, are the
        prompt token first (the mock's model always ranks it best) and ``top_n - 1`` others, as both
        engines' servicers list them then."""
        if top_n is None:
            return None
        lps = self.logprobs(prompt[1:], 1, top_n)
        starts = [0, 0]
        ids: list[int] = []
        vals: list[float] = []
        for lp in lps:
            ids.extend(t for t, _ in lp.top)
            vals.extend(v for _, v in lp.top)
            starts.append(len(ids))
        return PromptLogprobs(tuple(prompt), [None, *(lp.logprob for lp in lps)], starts, ids, vals)

    def logprobs(self, token_ids: Sequence[int], start_pos: int, top_n: int) -> list[TokenLogprob]:
        """Deterministic fake logprobs: the sampled token first, ``top_n`` alternatives (best first)."""
        out: list[TokenLogprob] = []
        vocab = self.vocab_size
        for i, t in enumerate(token_ids):
            pos = start_pos + i
            lp = -0.01 - ((t * 2654435761 + pos * 40503) % 1000) / 1000.0
            top: tuple[tuple[int, float], ...] = ()
            if top_n > 0:
                top = ((t, lp), *(((t + j * 7919) % vocab, lp - 0.5 * j - 0.25) for j in range(1, top_n)))
            out.append(TokenLogprob(token_id=t, logprob=lp, top=top))
        return out
