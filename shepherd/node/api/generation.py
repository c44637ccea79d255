"""Generation driving: one API call's engine streams, from dispatch to the encoded answer (streamed as
SSE or as one JSON body), with usage, logprobs, stop and parser stages and in-band errors."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import sys
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import orjson
from aiohttp import web

from shepherd.node.api.admission import TICKET_KEY
from shepherd.node.api.common import KEEPALIVE_TICKER, MODEL_KEY, STREAM_KEY, public_engine_message
from shepherd.node.dispatch.gateway import Gateway
from shepherd.node.dispatch.stream import EngineStream, Retry
from shepherd.node.http.types import LeanStreamResponse, lean_request, stream_response
from shepherd.node.metrics import ENDPOINTS
from shepherd.node.observe import logs, tracing
from shepherd.node.openai.logprobs import TokenTextCache, prompt_completion_logprobs, vllm_prompt_logprobs
from shepherd.node.openai.requests import Sampling
from shepherd.node.openai.sse import (
    DONE,
    KEEPALIVE,
    ChatChunks,
    CompletionChunks,
    error_event,
    usage,
    vllm_stop_reason,
    with_choice_ids,
    with_prompt_ids,
    with_usage,
)
from shepherd.node.openai.structured import Constraint, Violation, header_value
from shepherd.node.output.chat import (
    ChatShaping,
    ChoiceEncoder,
    ChoiceParsing,
    api_choice,
    final_reason,
)
from shepherd.node.output.choice import ChoiceState, LogprobFormatter
from shepherd.node.output.plain_step import PlainStep, plain_step
from shepherd.proto.engine_types import (
    EngineChunk,
    EngineComplete,
    EngineError,
    EngineEvent,
    EngineTimeout,
    GenerateRequest,
    PromptChunk,
    PromptLogprobs,
    SamplingDefaults,
    SamplingParams,
    TokenLogprob,
)
from shepherd.proto.openai_errors import ApiError
from shepherd.tokens.tokenizer import Tokenizer

# what a client going away raises in its handler: aiohttp cancels the handler (handler_cancellation), a
# write to its closed connection raises ConnectionResetError (aiohttp's ClientConnectionResetError too)
GONE = (asyncio.CancelledError, ConnectionResetError)
CLIENT_DISCONNECT = "client_disconnect"  # the abort reason (smg_engine_aborts_total{reason=...})


def _engine_ends_them(states: Sequence[ChoiceState], engine_done: Sequence[bool]) -> bool:
    """Whether the engine ends every choice by itself: completed already, or stopped at a token the
    engine stops at too (EOS unless ``ignore_eos``, the request's ``stop_token_ids``: the gateway saw
    it in a chunk before the engine's Complete came). Not a stop string's end (the engine would go
    on generating)."""
    return all(done or type(st.matched) is int for st, done in zip(states, engine_done, strict=True))


def abort_reason(e: BaseException) -> str:
    """The abort reason of an engine stream ended by a failure (``smg_engine_aborts_total{reason}``, the
    engine call span's ``shepherd.engine.abort_reason``): ``timeout`` for the request timeout,
    ``cancelled`` for any other (the engine's error, a broken stream); never ``stop``, a gateway-side
    stop's, nor ``client_disconnect`` (``GONE``, handled before)."""
    return "timeout" if isinstance(e, TimeoutError | EngineTimeout) else "cancelled"


@contextlib.asynccontextmanager
async def closing_engine_call(es: EngineStream, gone: Callable[[], str]) -> AsyncIterator[EngineStream]:
    """``es`` closed however the work on it ends: with ``gone()`` when the task is cancelled (the client
    left, or why else the caller knows), with the failure's reason (``abort_reason``), else as a stop
    (the engine would go on past a gateway-side stop string; nothing when it completed)."""
    try:
        yield es
    except GONE:
        await es.close(gone())
        raise
    except BaseException as e:
        await es.close(abort_reason(e))
        raise
    finally:
        await es.close("stop")


PROMPTS_AHEAD = 8  # a streamed list of prompts: engine calls open beyond the prompt being relayed
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}
_SSE_LEAN_HEADERS = {k: v for k, v in SSE_HEADERS.items() if k != "Connection"}


def sse_response(request: web.Request, extra: dict[str, str]) -> web.StreamResponse:
    """An SSE response to ``request`` with the ``extra`` headers, not yet prepared (the lean server
    writes its own Connection header: it would drop ours, one pass over them less)."""
    headers = dict(SSE_HEADERS if lean_request(request) is None else _SSE_LEAN_HEADERS)
    headers.update(extra)
    return stream_response(request, headers=headers)


# (id of a Sampling, max_new_tokens, stream_interval, the model's defaults) -> (that Sampling, its
# SamplingParams): a request without a constraint maps a memoized Sampling (parse_sampling) to the same
# SamplingParams each time. An entry holds its Sampling alive, so an id in the table cannot be another
# object's.
_ENGINE_SAMPLING: dict[
    tuple[int, int | None, int | None, SamplingDefaults | None], tuple[Sampling, SamplingParams]
] = {}
ENGINE_SAMPLING_MAX = 1024


def engine_sampling(
    s: Sampling,
    max_new_tokens: int | None,
    stream_interval: int | None,
    constraint: Constraint | None = None,
    defaults: SamplingDefaults | None = None,
    stop_string_ids: tuple[int, ...] = (),
) -> SamplingParams:
    """The engine's sampling parameters of a request: ``max_new_tokens`` None leaves the engine's own
    bound (the client gave none); ``defaults``: the model's sampling defaults (its engines'), which fill
    the fields the client left unset (``s.unset``); ``stop_string_ids``: the ids of the request's stop
    strings that are one token each (``single_token_stops``)."""
    if constraint is not None or s.logit_bias or s.stop or s.stop_token_ids:
        # not memoized: an entry keeps its Sampling alive, and these hold up to ~200 kB of request bytes
        return _engine_sampling(s, max_new_tokens, stream_interval, constraint, defaults, stop_string_ids)
    key = (id(s), max_new_tokens, stream_interval, defaults)
    hit = _ENGINE_SAMPLING.get(key)
    if hit is not None and hit[0] is s:
        return hit[1]
    p = _engine_sampling(s, max_new_tokens, stream_interval, None, defaults)
    if len(_ENGINE_SAMPLING) >= ENGINE_SAMPLING_MAX:
        _ENGINE_SAMPLING.clear()
    _ENGINE_SAMPLING[key] = (s, p)
    return p


def _engine_sampling(
    s: Sampling,
    max_new_tokens: int | None,
    stream_interval: int | None,
    constraint: Constraint | None,
    defaults: SamplingDefaults | None = None,
    stop_string_ids: tuple[int, ...] = (),
) -> SamplingParams:
    kind = constraint.kind if constraint is not None else ""
    value = constraint.value if constraint is not None else None
    temperature, top_p, top_k, min_p, repetition_penalty = (
        s.temperature,
        s.top_p,
        s.top_k,
        s.min_p,
        s.repetition_penalty,
    )
    if defaults is not None and s.unset:  # the model's defaults, for what the client left unset
        unset = s.unset
        if defaults.temperature is not None and "temperature" in unset:
            temperature = defaults.temperature
        if defaults.top_p is not None and "top_p" in unset:
            top_p = defaults.top_p
        if defaults.top_k is not None and "top_k" in unset:
            top_k = defaults.top_k  # (-1: every token; vLLM's request gets max(top_k, 0): engine_requests)
        if defaults.min_p is not None and "min_p" in unset:
            min_p = defaults.min_p
        if defaults.repetition_penalty is not None and "repetition_penalty" in unset:
            repetition_penalty = defaults.repetition_penalty
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=s.frequency_penalty,
        presence_penalty=s.presence_penalty,
        repetition_penalty=repetition_penalty,
        max_new_tokens=max_new_tokens,
        min_new_tokens=s.min_tokens,
        stop_token_ids=s.stop_token_ids,
        stop_string_ids=stop_string_ids,
        stop_strings=s.stop,
        ignore_eos=s.ignore_eos,
        skip_special_tokens=s.skip_special_tokens,
        spaces_between_special_tokens=s.spaces_between_special_tokens,
        n=s.n,
        seed=s.seed,
        logit_bias=s.logit_bias,
        stream_interval=stream_interval,
        json_schema=value if kind == "json_schema" else None,
        regex=value if kind == "regex" else None,
        ebnf=value if kind == "ebnf" else None,
        structural_tag=value if kind == "structural_tag" else None,
        choice=tuple(orjson.loads(value)) if kind == "choice" and value else None,
        json_object=kind == "json_object",
    )


class StreamEvents(ChoiceEncoder, Protocol):
    """A streamed answer's encoder other than chat / completion chunks (the Responses API's events): the
    parser stage writes to it as to ``ChatChunks``; ``role`` opens the stream, ``finish`` ends a
    choice, ``end`` makes the last bytes once every job is done (it may store the answer first, and
    raise ``ApiError`` when it cannot), ``failed`` an in-band failure's last bytes."""

    def role(self, index: int) -> bytes: ...

    def cache(self, cached: int) -> None:
        """The prompt's tokens the engine read from its prefix cache, as an event tells it (before that
        event's bytes are made)."""

    def opening(self) -> bytes:
        """What opens the stream, made once (nothing after): with the headers when the engine is slow to
        answer, else with its first answer."""

    def finish(self, index: int, reason: str, matched: str | int | None = None) -> bytes: ...

    async def end(self, prompt: int, completion: int, cached: int) -> bytes: ...

    def failed(self, message: str, code: str) -> bytes: ...


@dataclass(slots=True)
class Job:
    """One engine request of an API call (a completions call with several prompts has several)."""

    ids: list[int]
    text: str
    states: list[ChoiceState]
    index_base: int
    echo: str = ""
    # vLLM's return_token_ids: each choice's output ids (kept: those after a stop are not), set by _drive
    out_ids: list[list[int]] | None = None
    # the prompt's logprobs, when asked (Generation.prompt_lps): the first the engine sent, set by _drive
    prompt_lps: PromptLogprobs | None = None


@dataclass(slots=True)
class Totals:
    prompt: int = 0
    completion: int = 0
    cached: int = 0


_ID_PREFIX = os.urandom(6).hex()  # unique per process; a counter makes ids unique within it
_ID_COUNTER = itertools.count(1)


def fresh_id(prefix: str) -> str:
    """An id unique on this node (and, by its random part, across nodes): ``prefix`` + hex."""
    return f"{prefix}{_ID_PREFIX}{next(_ID_COUNTER):x}"


def _engine_id(rid: str) -> str:
    """An engine call's request id: a token of fixed width unique to this call first (the node's random
    part, a 16-digit counter), then the client's id. Unique whatever the client sent (a reused
    ``x-request-id`` must not let one caller's disconnect abort another caller's generation), and no
    engine call's id is a prefix of another's: SGLang aborts every request whose id *starts with* the
    one named (its scheduler's ``req.rid.startswith(abort.rid)``), so an Abort for one call (a stop
    string's end, a disconnect) must not name a prefix of another call's id (a completions prompt list's
    other prompts, another request with the same client id). Every engine call gets its own."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}.{rid}"


engine_id = _engine_id  # (the other routes' engine calls: native.py)


# per tokenizer (not kept alive by it): (stop strings, skip_special_tokens) -> their single-token ids
_STOP_IDS: weakref.WeakKeyDictionary[Tokenizer, dict[tuple[tuple[str, ...], bool], tuple[int, ...]]] = (
    weakref.WeakKeyDictionary()
)
_STOP_IDS_MAX = 1024  # entries per tokenizer (emptied when full); stop sets over 256 characters not kept


def single_token_stops(tok: Tokenizer, stops: tuple[str, ...], skip_special_tokens: bool) -> tuple[int, ...]:
    """The token ids of the stop strings that are exactly one token: it encodes to that one id, and that
    id decodes (as the request decodes: ``skip_special_tokens``) to exactly the string. An engine that
    stops at such a token stops where the gateway's stop matcher would (the token's text is the stop
    string); SGLang gets them as ``stop_token_ids`` (as SMG's resolve_string_stops does). Multi-token
    strings stay the gateway's alone (a flat id list cannot express them)."""
    memo = _STOP_IDS.get(tok)
    if memo is None:
        memo = _STOP_IDS[tok] = {}
    key = (stops, skip_special_tokens)
    hit = memo.get(key)
    if hit is not None:
        return hit
    out: list[int] = []
    for stop in stops:
        ids = tok.encode_uncached(stop, add_special_tokens=False)
        if len(ids) == 1 and tok.decode(ids, skip_special_tokens=skip_special_tokens) == stop:
            out.append(ids[0])
    got = tuple(dict.fromkeys(out))
    if sum(map(len, stops)) <= 256:
        if len(memo) >= _STOP_IDS_MAX:
            memo.clear()
        memo[key] = got
    return got


class Generation:
    """Drives the engine stream(s) of one API call and encodes the answer in its API's shape.

    Invariants: one instance per API call; it opens one engine stream per job (prompt) and closes every
    stream it opened, on success, error, timeout or client disconnect (a stream not completed is
    aborted on its engine); once a stream's headers are sent, a failure is reported in-band (an SSE
    error event, then ``[DONE]``), never as a second status; ``totals`` add up the usage of every job
    and choice, and the usage block the client gets is those totals.
    """

    def __init__(
        self,
        request: web.Request,
        gw: Gateway,
        model: str,
        tok: Tokenizer,
        sampling: Sampling,
        *,
        chat: bool,
        rid: str,
        t0: float,
        logprobs: int | None,
        shaping: ChatShaping | None = None,
        events: StreamEvents | None = None,
        constraint: Constraint | None = None,
        context_param: tuple[str, str] = ("messages", "max_tokens"),
    ) -> None:
        self.request = request
        # the request fields a context error names: the prompt's and the output bound's
        self.context_param = context_param
        self.return_ids = False  # vLLM's return_token_ids: prompt and output ids in the answer
        # the prompt's logprobs (``prompt_logprobs`` and completions' ``echo`` with ``logprobs``): the
        # alternatives per position asked of the engine (None: not asked), vLLM's ``prompt_logprobs``
        # field (its number; None: not in the answer), and whether the echoed prompt's logprobs lead each
        # completion choice's ``logprobs``; set by the handler
        self.prompt_lps: int | None = None
        self.prompt_field: int | None = None
        self.echo_logprobs = False
        self.gw = gw
        self.model = model
        self.tok = tok
        self.s = sampling
        self.chat = chat
        self.rid = rid
        logs.bind_request(rid)  # the rest of the request's log lines carry it (JSON logs, access log)
        self.t0 = t0
        self.t_first = 0.0  # when the first engine event came (perf_counter; 0: none yet)
        self.created = int(time.time())
        self.logprobs = logprobs
        self.lpfmt = LogprobFormatter(tok, sampling.skip_special_tokens) if logprobs is not None else None
        self.totals = Totals()
        self.engine_seconds = 0.0
        # the model's metric children for the route (SMG's ``endpoint`` label), looked up once
        endpoint = ENDPOINTS.get(getattr(request, "path", "")) or ("chat" if chat else "completions")
        self.mm = gw.metrics.for_model(model, endpoint)
        request[MODEL_KEY] = model  # the request metrics' model label, whatever the outcome
        # chat: the parser stage (None: plain text, no parser work per token) and structured output
        if shaping is not None:
            self.output = shaping.output
            self.constraint = shaping.constraint
            self.checks = shaping.checks
            self.legacy_functions = shaping.legacy_functions
            self.calls_finish = shaping.calls_finish
        else:
            self.output = None
            self.constraint = constraint  # completions: response_format or a guided field
            self.checks = None
            self.legacy_functions = False
            self.calls_finish = "tool_calls"
        # built by _encoder when streaming (``events``: the Responses API's, given)
        self._enc: ChatChunks | CompletionChunks | StreamEvents | None = events
        self._events = events

    def _lp(self, entries: Sequence[TokenLogprob], index: int = 0) -> dict[str, Any] | None:
        if self.lpfmt is None or not entries:
            return None
        if self.chat:
            return self.lpfmt.chat(entries, self.logprobs or 0)
        return self.lpfmt.completion(entries, self.logprobs or 0, index)

    def _prompt_of(self, job: Job) -> PromptLogprobs:
        """The prompt's logprobs the engine sent for ``job``; an engine that sent none (asked for them)
        fails the call: an answer whose logprobs miss its prompt would be silently wrong."""
        plp = job.prompt_lps
        if plp is None:
            raise EngineError("the engine did not return the prompt's logprobs", retryable=False)
        return plp

    def _prompt_field(self, job: Job) -> list[Any] | None:
        """vLLM's ``prompt_logprobs`` of ``job``'s prompt, when the request asked for it (else None)."""
        if self.prompt_field is None:
            return None
        cache = TokenTextCache.for_tokenizer(self.tok.hf)  # (the formatter's, when logprobs are asked)
        return vllm_prompt_logprobs(self._prompt_of(job), cache, self.prompt_field, positions=len(job.ids))

    def _echo_lp(self, job: Job, index: int) -> dict[str, Any]:
        """The echoed prompt's completions logprobs for choice ``index`` (vLLM's: a null first entry); its
        output's offsets then continue after the echoed text. A prompt given as token ids is echoed
        with its special tokens' text, so their width counts."""
        assert self.lpfmt is not None
        fmt = self.lpfmt
        block, _ = prompt_completion_logprobs(
            self._prompt_of(job),
            fmt.cache,
            self.logprobs or 0,
            positions=len(job.ids),
            skip_special_tokens=fmt.skip_special and bool(job.text),
            tokens_as_ids=fmt.tokens_as_ids,
        )
        fmt.offsets[index] = len(job.echo)
        return block

    def _echoed_lp(self, job: Job, index: int, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        """A whole completion choice's logprobs with ``echo``: the prompt's, then its output's."""
        head = self._echo_lp(job, index)
        tail = self._lp(entries, index)
        if tail is not None:
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                head[key] = [*head[key], *tail[key]]
        return head

    def _echo_heads(self, job: Job) -> list[bytes]:
        """A streamed completion's first chunk per choice of ``job`` with ``echo`` and ``logprobs``: the
        prompt's text with its logprobs (then the output's chunks, their offsets after it)."""
        enc = self._encoder()
        assert isinstance(enc, CompletionChunks)
        heads = [
            enc.content(job.index_base + st.index, job.echo, self._echo_lp(job, job.index_base + st.index))
            for st in job.states
        ]
        if self.return_ids:  # a choice's first chunk: its prompt's ids (the echo's none)
            heads = [with_choice_ids(h, (), job.ids) for h in heads]
        return self._with_usage(heads, job) if self.s.continuous_usage and self._events is None else heads

    async def prompt_only(self, jobs: list[Job], logprobs: bool = True) -> None:
        """Each prompt's logprobs alone, into its job (``echo`` with ``max_tokens`` 0 and the prompt's
        logprobs asked): one engine call per prompt generating one token, dropped, as vLLM's
        echo_without_generation does (its max_tokens 1); one sample whatever ``n`` (a prompt's logprobs
        are the same for every choice). Without ``logprobs``, the prompt's prefill alone (Anthropic's
        ``max_tokens: 0``, which fills the engine's prefix cache): the engine's cached tokens go to the
        totals. Raises what the engine call raises."""
        s = self.s
        self.s = replace(s, max_tokens=1, min_tokens=0, n=1, stop=(), stop_token_ids=())

        async def run(i: int, job: Job) -> None:
            es = await self._open(job, i, False)
            try:
                async for batch in es.batches():
                    if job.prompt_lps is None:
                        job.prompt_lps = _prompt_lps_in(batch)
                    for ev in batch:
                        if isinstance(ev, EngineComplete):
                            if ev.finish_reason in ENGINE_FAILED:
                                raise EngineError(
                                    f"the engine ended the prompt's call with {ev.finish_reason!r}",
                                    code="engine_abort",
                                    retryable=False,
                                )
                            es.completed = True
                            self.totals.cached += ev.cached_tokens
                    if es.completed:
                        break
            finally:
                await es.close("done" if es.completed else "cancelled")
            if logprobs:
                self._prompt_of(job)

        try:
            await _each_job(jobs, run)
        finally:
            self.s = s

    def _gen_request(self, job: Job, max_new: int, stream: bool) -> GenerateRequest:
        """Job ``job``'s engine request, an id of its own (``_engine_id``). ``max_new``: what the context
        leaves (``check_context``): the node's bound (``token_limit``), sent as ``max_new_tokens`` only
        when the client asked for it (``max_tokens``; else the engine applies its own). The model's
        sampling defaults fill what the client left unset (the target worker's, the decode pool's in
        PD); ``require_reasoning`` (SGLang) when the request thinks first: a reasoning parser runs on
        its output (the family's thinking on, the template did not close the think block)."""
        s = self.s
        gw = self.gw
        facts = gw.engine_facts(self.model, self.request.headers.get("x-smg-target-worker"))
        if s.min_tokens and facts.skip_tokenizer_init:
            raise ApiError(
                400,
                f"'min_tokens' is not supported by model '{self.model}': its SGLang workers run with "
                "--skip-tokenizer-init, which refuses a minimum output length.",
                param="min_tokens",
                code="unsupported_parameter",
            )
        stop_ids = single_token_stops(self.tok, s.stop, s.skip_special_tokens) if s.stop else ()
        output = self.output
        return GenerateRequest(  # by position: (request_id, input_ids, sampling, stream, logprobs, top)
            _engine_id(self.rid),
            job.ids,
            engine_sampling(
                s, s.max_tokens, gw.cfg.stream_interval, self.constraint, facts.defaults, stop_ids
            ),
            stream,
            self.logprobs is not None,
            self.logprobs or 0,
            require_reasoning=output is not None and output.reasoning is not None,
            token_limit=max_new,
            prompt_logprobs=self.prompt_lps,
        )

    def _open(
        self, job: Job, i: int, stream: bool, max_new: int | None = None, retry: Retry | None = None
    ) -> Awaitable[EngineStream]:
        """Open job ``i``'s engine stream (``max_new``: what ``check_context`` gave, if already asked;
        ``retry``: the tries so far): the gateway's coroutine, for the caller to await at once."""
        if max_new is None:
            max_new = self.gw.check_context(self.model, len(job.ids), self.s.max_tokens, *self.context_param)
        gen = self._gen_request(job, max_new, stream)
        h = self.request.headers
        return self.gw.open_stream(
            self.model,
            gen,
            target=h.get("x-smg-target-worker"),
            routing_key=h.get("x-smg-routing-key"),
            retry=retry,
        )

    async def _drive(
        self,
        es: EngineStream,
        job: Job,
        emit: Callable[[list[bytes], bool], Awaitable[None]] | None,
        emit_now: Callable[[list[bytes], bool], bool] | None = None,
        drain: Callable[[], Awaitable[None]] | None = None,
        writer: Callable[[], tuple[Any, Callable[[bytes], bool], list[bytes]] | None] | None = None,
    ) -> None:
        """Consume one engine stream into ``job.states``; ``emit`` gets the encoded chunks of each batch
        of engine events (streaming), so one network read from the engine is one write to the client.
        ``emit_now`` (a client write that does not wait: True when the client's transport wants a
        pause) and ``drain`` (the wait for it) let an engine client that can ``push`` run each later
        batch from its connection's frame loop, with no task wake-up per engine message; a pause hands
        back to this loop, which waits for the drain before taking more. ``writer`` (with ``push``): the
        keep-alive entry, the connection's ``send_framed`` and the pending chunks, when the client's chunks
        may be written straight (``plain_step``: a plain choice's tokens then go through one C step)."""
        states = job.states
        n = len(states)
        remaining = n
        engine_open = n
        seen_chunks = [False] * n
        # per choice: the chunk tokens received and the last chunk's ids (the final delta's check), and
        # whether its engine Complete came (SGLang's non-streamed n > 1 numbers every Complete 0)
        got = [0] * n
        last_ids: list[Sequence[int]] = [()] * n
        engine_done = [False] * n
        enc = self._encoder() if emit is not None else None
        posts: list[ChoiceParsing] | None = None
        if self.output is not None and enc is not None:  # fresh parsers per choice (chat answers only)
            assert not isinstance(enc, CompletionChunks)
            posts = [self.output.choice(enc, job.index_base + st.index) for st in states]
        mm = self.mm
        itl = mm.itl
        last = [time.perf_counter()]  # the last batch's time (lists: the C step updates them too)
        first = True
        out: list[bytes] = []
        cached = [self.totals.cached]
        events = self._events if enc is not None else None
        # stream_options.continuous_usage_stats: each chunk gets its choice's usage as of the engine event
        # it came from (vLLM's per-step counts), not as of the end of the batch of events it came in
        per_event_usage = emit is not None and self.s.continuous_usage and self._events is None
        # return_token_ids: every choice's kept output ids; streamed, each event's chunks carry its ids (those
        # of events whose text was held go with the choice's next chunk), a completion's first its prompt's
        rids = job.out_ids = [[] for _ in states] if self.return_ids else None
        unsent: list[list[int]] = [[] for _ in states] if rids is not None and emit is not None else []
        prompt_due = [not self.chat and not job.echo] * n if unsent else []
        per_event = per_event_usage or bool(unsent)
        want_plp = self.prompt_lps is not None
        # streamed echo with logprobs: each choice's echo (with the prompt's logprobs) leads its stream,
        # written once the first events (which carry those logprobs) are in
        echo_due = want_plp and self.echo_logprobs and enc is not None
        # the tokens a choice may have (what the engine was asked for): an engine sending more is cut there,
        # the choice ended as "length" and the call aborted (a runaway engine cannot flood the client)
        limit = self.s.max_tokens
        if limit is None:  # (a context a tokenizer reports as 1e30: bounded to what the C step takes)
            limit = min(max(self.gw.context_length(self.model) - len(job.ids), 0), sys.maxsize)

        def event_chunks(start: int) -> None:
            """The chunks ``out[start:]`` (one event's, of one choice) with their token ids and usage."""
            chunks = out[start:]
            if unsent:
                assert isinstance(enc, ChatChunks | CompletionChunks)
                i = enc.index_of(chunks[0]) - job.index_base
                chunks[0] = with_choice_ids(chunks[0], unsent[i], job.ids if prompt_due[i] else None)
                unsent[i] = []
                prompt_due[i] = False
            out[start:] = self._with_usage(chunks, job) if per_event_usage else chunks

        def take(batch: list[EngineEvent]) -> bool:
            """One batch of engine events into the states and ``out``: whether the stream is over for
            us (every engine choice completed, or every choice ended on a gateway-side stop)."""
            nonlocal first, remaining, engine_open, echo_due
            now = time.perf_counter()
            timed = not first  # the first batch's wait is the TTFT, not an inter-token latency
            if first:
                mm.ttft.observe(now - self.t0)
                if not self.t_first:
                    self.t_first = now
                first = False
                if events is not None:  # the stream's opening (the Messages API's message_start) goes out
                    # with the engine's first answer, with the cache split it tells, whatever it holds
                    events.cache(max(cached[0], max((ev.cached_tokens for ev in batch), default=0)))
                    out.append(events.opening())
            ntok = 0
            if want_plp:
                if job.prompt_lps is None:
                    job.prompt_lps = _prompt_lps_in(batch)
                if echo_due:
                    echo_due = False
                    out.extend(self._echo_heads(job))
            mark = len(out)  # (per_event_usage) the first chunk of the event being taken
            for ev in batch:
                if per_event:
                    if len(out) > mark:  # the previous event's chunks, with its ids and the usage it left
                        event_chunks(mark)
                    mark = len(out)
                i = ev.index
                if i >= n:
                    raise EngineError(f"engine sent choice index {i} for n={n}", retryable=False)
                st = states[i]
                idx = job.index_base + i
                if ev.cached_tokens > cached[0]:
                    cached[0] = ev.cached_tokens
                if isinstance(ev, EngineChunk):
                    ntok += len(ev.token_ids)
                    seen_chunks[i] = True
                    got[i] += len(ev.token_ids)
                    last_ids[i] = ev.token_ids
                    ended = st.finished  # (a local: mypy would keep st.finished narrowed past feed)
                    if ended:
                        continue
                    lps = ev.logprobs
                    ids = ev.token_ids
                    runaway = st.tokens + len(ids) > limit
                    if runaway:  # more than the engine was asked for: the rest is not taken
                        ids = ids[: max(limit - st.tokens, 0)]
                        lps = lps[: len(ids)]
                    text = st.feed(ids, lps) if ids else ""
                    if lps and st.finished:
                        lps = lps[: st.kept]  # not those of the tokens after the stop
                    if runaway and not st.finished:
                        text += st.end("length")
                    if rids is not None:
                        kept = ids[: st.kept] if ids else ()
                        rids[i].extend(kept)
                        if unsent:
                            unsent[i].extend(kept)
                    if enc is not None:
                        if posts is not None:
                            if text or lps:
                                posts[i].stream(text, self._lp(lps, idx) if lps else None, out)
                        elif text or lps:
                            out.append(enc.content(idx, text, self._lp(lps, idx) if lps else None))
                    if st.finished:
                        remaining -= 1
                        if enc is not None:
                            self._finish_chunk(enc, posts, i, idx, st, out)
                    continue
                if engine_done[i]:
                    # a second Complete for one index: SGLang's request manager numbers choices only
                    # when streaming (every non-streamed Complete says 0): by order of arrival
                    i = _next_open(engine_done)
                    if i < 0:
                        raise EngineError(f"engine sent more than n={n} completions", retryable=False)
                    st = states[i]
                    idx = job.index_base + i
                engine_done[i] = True
                engine_open -= 1
                if ev.finish_reason in ENGINE_FAILED:
                    # the engine gave up on the choice (SGLang's abort, vLLM's error): not an answer
                    raise EngineError(
                        f"the engine ended choice {i} with finish_reason {ev.finish_reason!r}",
                        code="engine_abort",
                        retryable=False,
                    )
                if st.finished:
                    continue
                lps = ()
                out_ids = ev.output_ids
                fed: Sequence[int] = ()
                reason = ev.finish_reason
                elps = ev.logprobs
                whole = not seen_chunks[i] and bool(out_ids)
                if whole or (
                    out_ids and final_delta_is_new(out_ids, ev.completion_tokens, got[i], last_ids[i])
                ):
                    if st.tokens + len(out_ids) > limit:  # a runaway engine: as for chunks
                        out_ids = out_ids[: max(limit - st.tokens, 0)]
                        elps = elps[: len(out_ids)]
                        reason = "length"
                    fed = out_ids
                if whole:
                    text = st.whole(out_ids, elps, reason) if out_ids else st.end(reason)
                    lps = elps[: st.kept]
                elif fed:
                    # the last tokens came in the Complete only (SGLang's in-tree server)
                    text = st.feed(out_ids, elps) + st.end(reason)
                    lps = elps[: st.kept]
                else:
                    text = st.end(reason)
                if rids is not None and fed:
                    rids[i].extend(fed[: st.kept])
                    if unsent:
                        unsent[i].extend(fed[: st.kept])
                if enc is not None:
                    if posts is not None:
                        if text or lps:
                            posts[i].stream(text, self._lp(lps, idx), out)
                    elif text or lps:
                        out.append(enc.content(idx, text, self._lp(lps, idx)))
                remaining -= 1
                if enc is not None:
                    self._finish_chunk(enc, posts, i, idx, st, out)
            if per_event and len(out) > mark:
                event_chunks(mark)
            if ntok and timed:
                itl.observe((now - last[0]) / ntok)
            last[0] = now
            return engine_open == 0 or remaining == 0

        paused = False

        def take_and_write(batch: list[EngineEvent]) -> bool:
            # (push) one batch, written at once: stop at the end, or when the client's transport is full
            nonlocal paused
            over = take(batch)
            if out:
                assert emit_now is not None
                paused = emit_now(out, over)
                out.clear()
                return over or paused
            return over

        push = getattr(es.agen, "push", None) if emit_now is not None and drain is not None else None
        fast: PlainStep | None = None  # the C step (plain_step), once it can write
        fast_ok = (
            writer is not None
            and n == 1
            and job.index_base == 0
            and self.logprobs is None
            and self.prompt_lps is None
            and enc is not None
            and not self.return_ids
        )
        over = False
        async for batch in es.batches():
            over = take(batch)
            if out and emit is not None:
                await emit(out, over)
                out.clear()
            if over:
                break
            if push is not None:
                if fast_ok and fast is None:
                    assert writer is not None and enc is not None
                    w = writer()
                    if w is not None:
                        fast = plain_step(
                            states[0],
                            posts[0] if posts is not None else None,
                            getattr(enc, "content0", None),
                            observe=itl.observe,
                            last=last,
                            cached=cached,
                            got=got,
                            last_ids=last_ids,
                            seen=seen_chunks,
                            ka=w[0],
                            send=w[1],
                            pending=w[2],
                            fallback=take_and_write,
                            itl=itl,
                            limit=limit,
                        )
                        fast_ok = fast is not None
                await push(fast if fast is not None else take_and_write)
                if engine_open == 0 or remaining == 0:
                    over = True
                    break
                if fast is not None and fast.paused:  # (the C step's write left the transport full)
                    fast.paused = False
                    paused = True
                if paused:  # the client's transport is full: nothing more is taken until it drains
                    paused = False
                    assert drain is not None
                    await drain()
        if over and (engine_open == 0 or (remaining == 0 and _engine_ends_them(states, engine_done))):
            # every choice's end is the engine's own too: no Abort for it (its Complete is on the way;
            # closing the call is enough), only for a choice cut by a stop string the engine never saw
            es.completed = True
        if cached[0] > self.totals.cached:  # (the prompts of a list may be driven at once)
            self.totals.cached = cached[0]
        if es.trace is not None:  # the engine call's answer on its CLIENT span (tracing on)
            es.trace.response(self.rid, states, len(job.ids), cached[0])
        if remaining:
            raise EngineError("the engine ended the stream before every choice finished", retryable=False)

    def _finish_chunk(
        self,
        enc: ChatChunks | CompletionChunks | StreamEvents,
        posts: list[ChoiceParsing] | None,
        i: int,
        idx: int,
        st: ChoiceState,
        out: list[bytes],
    ) -> None:
        if posts is None:
            out.append(enc.finish(idx, st.finish_reason or "stop", st.matched))
            return
        post = posts[i]
        post.stream_end(out, st.finish_reason == "length")
        out.append(enc.finish(idx, *final_reason(st.finish_reason, st.matched, post.has_calls)))

    def _encoder(self) -> ChatChunks | CompletionChunks | StreamEvents:
        """The response's event encoder (stateless: one per response, shared by its streams)."""
        enc = self._enc
        if enc is None:
            if self.chat:
                field = self.gw.cfg.reasoning_field
                enc = self._enc = ChatChunks(
                    self.rid, self.created, self.model, field, self.legacy_functions, self.calls_finish
                )
            else:
                enc = self._enc = CompletionChunks(self.rid, self.created, self.model)
            enc.stop_ids = self.s.stop_token_ids
        return enc

    def _with_usage(self, chunks: list[bytes], job: Job) -> list[bytes]:
        """``stream_options.continuous_usage_stats``: each chunk with its own choice's usage so far, as
        vLLM counts it: that prompt's tokens and the tokens that choice has generated (not totals)."""
        enc = self._encoder()
        assert isinstance(enc, ChatChunks | CompletionChunks)  # (continuous usage: no events of their own)
        prompt, base, states = len(job.ids), job.index_base, job.states
        return [with_usage(c, prompt, states[enc.index_of(c) - base].tokens) for c in chunks]

    def _account(self, job: Job) -> None:
        states = job.states
        completion = states[0].tokens if len(states) == 1 else sum(st.tokens for st in states)
        prompt = len(job.ids)
        totals = self.totals
        totals.prompt += prompt
        totals.completion += completion
        mm = self.mm
        mm.prompt_tokens.value += prompt
        mm.completion_tokens.value += completion

    def done(self) -> None:
        """The call is answered: its model for the request metrics, its end-to-end latency."""
        self.request[MODEL_KEY] = self.model
        now = time.perf_counter()
        self.mm.e2e.observe(now - self.t0)
        if self.t_first:  # SMG's generation duration: first token to last token
            self.mm.generation.observe(now - self.t_first)

    # ---- non-streaming ----------------------------------------------------------------------------

    def answer_body(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """The whole (non-streamed) answer's object around ``choices``, with the usage accounted."""
        return {
            "id": self.rid,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(self.totals.prompt, self.totals.completion, self.totals.cached),
        }

    def sse_response(self) -> web.StreamResponse:
        """The streamed answer's response, not yet prepared."""
        return sse_response(self.request, self.headers())  # x-smg-gateway-ms: the time before dispatch

    async def respond(self, jobs: list[Job]) -> web.Response:
        choices, violations = await self.collect(jobs, packed=True)
        body = self.answer_body(choices)
        if self.chat and self.prompt_field is not None:  # vLLM's: the prompt's logprobs beside the choices
            body["prompt_logprobs"] = self._prompt_field(jobs[0])
        if self.return_ids and self.chat:  # vLLM's return_token_ids: the prompt's ids beside the choices
            body["prompt_token_ids"] = jobs[0].ids
        if self.chat and self.output is not None:
            field, legacy = self.gw.cfg.reasoning_field, self.legacy_functions
            for c in choices:
                api_choice(c, field, legacy, self.calls_finish)
        self.done()
        headers = self.headers()
        if violations:
            strict = self.rejected(violations)
            if strict:  # the operator asked for conforming output or an error
                raise strict_violation(strict)
            headers["x-smg-schema-violation"] = header_value(violations)
        return web.Response(body=orjson.dumps(body), content_type="application/json", headers=headers)

    def rejected(self, violations: Sequence[Violation]) -> list[Violation]:
        """The violations that make the answer an error (``strict_violation``): those of a strict schema
        or tool, when the operator opted into rejection (``--reject-schema-violations``); otherwise none:
        the answer goes out as generated, the violation reported (header and ``schema_violation``)."""
        if not self.gw.cfg.reject_schema_violations:
            return []
        return [v for v in violations if v.strict]

    async def collect(
        self, jobs: list[Job], engine_stream: bool = False, *, packed: bool = False
    ) -> tuple[list[dict[str, Any]], list[Violation]]:
        """Run every job to its end without streaming: the final choices (chat: with the parsed
        ``message``) and the structured-output violations found in them. ``engine_stream``: the engine
        streams the output all the same (a background response: its text so far is there when it is
        cancelled). ``packed``: the choices' logprobs as serialized JSON (``_final_choices``), for an
        answer that only serializes them."""
        gw = self.gw
        max_new = [
            gw.check_context(self.model, len(job.ids), self.s.max_tokens, *self.context_param) for job in jobs
        ]
        # Without stop strings the engine sends everything in one message; with them we stream so that a
        # gateway-side stop can abort generation early.
        engine_stream = engine_stream or bool(self.s.stop)
        targeted = "x-smg-target-worker" in self.request.headers

        failed = [False]  # a prompt of the list failed: the others are cancelled, not gone with the client

        async def run(i: int, job: Job) -> None:
            tries = Retry()
            while True:
                es = await self._open(job, i, engine_stream, max_new[i], tries)
                try:
                    await self._drive(es, job, None)
                except GONE:
                    await es.close("cancelled" if failed[0] else CLIENT_DISCONNECT)
                    raise
                except BaseException as e:
                    await es.close(abort_reason(e))
                    # streamed from the engine (a stop string to catch) but whole to the client: nothing of
                    # it was sent, so a failure midway is asked again from the start on another worker
                    if engine_stream and not targeted and gw.retry_midway(es, e, tries):
                        job.states = [st.restart(job.ids) for st in job.states]
                        continue
                    failed[0] = True
                    raise
                finally:
                    await es.close("stop" if es.completed is False else "done")
                break
            self._account(job)

        t_dispatch = time.perf_counter()
        await _each_job(jobs, run)
        engine_t = time.perf_counter() - t_dispatch
        violations: list[Violation] = []
        if len(jobs) == 1:
            choices = self._final_choices(jobs[0], violations, packed)
        else:
            choices = [c for job in jobs for c in self._final_choices(job, violations, packed)]
        self.engine_seconds = engine_t
        return choices, violations

    def _final_choices(
        self, job: Job, violations: list[Violation], packed: bool = False
    ) -> list[dict[str, Any]]:
        """The job's choices, whole. ``packed``: each choice's logprobs serialized as it is built (an
        ``orjson.Fragment`` in the answer, its engine entries released): ``n`` 128 with 1,000 tokens and
        20 alternatives each is 2.7M entries, ~0.9 GB as dicts all at once, 224 MB as JSON (node RSS
        peak 1.38 -> 0.80 GB); a prompt's logprobs on every completion choice serialized once."""
        out = []
        prompt_lp: Any = None if self.chat else self._prompt_field(job)  # (chat's: beside the choices)
        if packed and prompt_lp is not None:
            prompt_lp = orjson.Fragment(orjson.dumps(prompt_lp))
        for st in job.states:
            idx = job.index_base + st.index
            lp: Any = (
                self._echoed_lp(job, idx, st.logprobs) if self.echo_logprobs else self._lp(st.logprobs, idx)
            )
            if packed and lp is not None:
                lp = orjson.Fragment(orjson.dumps(lp))
                st.logprobs = []
            if self.chat:
                choice = self._chat_choice(st, idx, lp, violations)
            else:
                choice = {
                    "index": job.index_base + st.index,
                    "text": job.echo + st.full_text(),
                    "logprobs": lp,
                    "finish_reason": st.finish_reason,
                    "matched_stop": st.matched,
                    "stop_reason": vllm_stop_reason(st.matched, self.s.stop_token_ids),
                }
                if prompt_lp is not None:  # vLLM's, on each choice of a completion
                    choice["prompt_logprobs"] = prompt_lp
            if job.out_ids is not None:  # vLLM's return_token_ids (a completion's choice: its prompt's too)
                choice["token_ids"] = job.out_ids[st.index]
                if not self.chat:
                    choice["prompt_token_ids"] = job.ids
            out.append(choice)
        return out

    def _chat_choice(self, st: ChoiceState, idx: int, lp: Any, violations: list[Violation]) -> dict[str, Any]:
        reason: str | None = st.finish_reason
        matched: Any = st.matched
        if self.output is None:
            message: dict[str, Any] = {"role": "assistant", "content": st.full_text()}
            calls: list[tuple[str, str]] = []
        else:
            message, parsed = self.output.message(st.full_text())
            calls = [] if parsed is None else [(name, args) for _, name, args in parsed.calls]
            reason, matched = final_reason(reason, matched, bool(calls))
        choice = {
            "index": idx,
            "message": message,
            "logprobs": lp,
            "finish_reason": reason,
            "matched_stop": matched,
            "stop_reason": vllm_stop_reason(matched, self.s.stop_token_ids),
        }
        if self.checks is not None:
            v = self.checks.check(idx, reason, message["content"], calls)
            if v is not None:
                violations.append(v)
                choice["schema_violation"] = v.message
        return choice

    def headers(self) -> dict[str, str]:
        own = time.perf_counter() - self.t0 - self.engine_seconds
        h = {"x-request-id": self.rid, "x-smg-gateway-ms": f"{own * 1000:.3f}"}
        ticket = self.request.get(TICKET_KEY)  # rate limits: x-ratelimit-* (shepherd.node.api.admission)
        return h if ticket is None else {**h, **ticket.headers}

    def run(self, jobs: list[Job]) -> Awaitable[web.StreamResponse]:
        """Dispatch: the prompt work is done, the engine work starts (the answer's coroutine, awaited by
        the caller: no frame of its own around it)."""
        self.gw.metrics.overhead.observe(time.perf_counter() - self.t0)
        if self.s.stream:
            return self.stream(jobs)
        return self.respond(jobs)

    # ---- streaming -----------------------------------------------------------------------------------

    async def stream(self, jobs: list[Job], sink: Any = None) -> web.StreamResponse:
        """Stream the answer to the client; ``sink``: to that instead (what a background Response's
        events go to: ``node.output.event_log.EventLog``, with a response's ``prepare`` / ``write`` /
        ``write_eof``, always prepared)."""
        gw = self.gw
        self.request[STREAM_KEY] = True  # SMG's ``streaming`` label of the request count
        max_new = [
            gw.check_context(self.model, len(job.ids), self.s.max_tokens, *self.context_param) for job in jobs
        ]
        resp: web.StreamResponse = self.sse_response() if sink is None else sink
        keepalive = self.request.app[KEEPALIVE_TICKER]
        # while the engine queues or prefills, the ticker sends the headers and a keep-alive comment once
        # dispatch has waited one interval, then one every interval: proxies see bytes from the start
        # (an SSE comment until the first events are out: the Messages API's ping must follow its
        # message_start, which comes with the first batch; then the events' own keep-alive)
        ka = keepalive.register(resp, KEEPALIVE, self.request)
        own_ka = getattr(self._events, "keepalive", KEEPALIVE)
        # events whose stream opens with an event of their own, before any keep-alive (the Messages API's
        # message_start: ``opening`` makes it once, ``role`` then nothing): it goes out with the headers
        first: Callable[[], bytes] | None = getattr(self._events, "opening", None)
        if first is not None:

            def opening() -> bytes:
                ka.payload = own_ka
                assert first is not None
                return first()

            ka.opening = opening
        try:
            es = await self._open(jobs[0], 0, True, max_new[0])
        except (EngineError, ApiError, TimeoutError) as e:
            keepalive.unregister(resp)
            if not resp.prepared:
                raise  # before the headers: a plain HTTP error
            await resp.write_eof(self._failure(e))  # the headers are gone: in-band
            return resp
        except BaseException as e:
            keepalive.unregister(resp)
            if sink is None:
                await self._stopped(resp, e)
            raise
        # the other prompts of a list: their engine calls opened ahead (the engine runs them together, as
        # vLLM schedules a list; at most PROMPTS_AHEAD beyond the one relayed, whose answers wait for
        # their turn in memory), their answers relayed one prompt after another; closed below if not
        later: list[asyncio.Future[EngineStream]] = []

        def open_ahead(upto: int) -> None:
            while len(later) < min(upto, len(jobs) - 1):
                k = len(later) + 1
                later.append(asyncio.ensure_future(self._open(jobs[k], k, True, max_new[k])))

        enc = self._encoder()
        try:
            open_ahead(PROMPTS_AHEAD)
            await resp.prepare(self.request)  # (a no-op when the ticker sent the headers already)
            pending: list[bytes] = []
            continuous = self.s.continuous_usage and self._events is None

            async def emit(chunks: list[bytes], last: bool = False) -> None:
                # the role chunk rides with the first batch, the last batch with usage and [DONE]:
                # a stream whose tokens arrive together is one write (continuous usage: ``_drive`` put
                # each chunk's in)
                pending.extend(chunks)
                if not last:
                    ka.touch()
                    ka.payload = own_ka
                    await resp.write(b"".join(pending))
                    pending.clear()

            emit_now: Callable[[list[bytes], bool], bool] | None = None
            drain: Callable[[], Awaitable[None]] | None = None
            writer: Callable[[], tuple[Any, Callable[[bytes], bool], list[bytes]] | None] | None = None
            if isinstance(resp, LeanStreamResponse):
                lean = resp
                drain = lean.drain
                sender: list[Callable[[bytes], bool] | None] = [None]

                def emit_now(chunks: list[bytes], last: bool = False) -> bool:
                    # emit's write without the wait (the engine client's push): True to pause
                    if last:
                        pending.extend(chunks)
                        return False
                    ka.last = time.monotonic()  # (ka.touch(), inline: once per engine message)
                    if pending:
                        pending.extend(chunks)
                        data = b"".join(pending)
                        pending.clear()
                    else:
                        data = b"".join(chunks)
                    send = sender[0]
                    if send is None or not data:
                        ka.payload = own_ka  # (the first write: the events' keep-alive from now on)
                        paused = lean.lean_write(data)
                        sender[0] = lean.chunk_sender()  # once the head is out: the chunks go straight
                        return paused
                    return send(data)

                def writer() -> tuple[Any, Callable[[bytes], bool], list[bytes]] | None:
                    # emit_now's write for the C step (plain_step): once the head is out, no usage per chunk
                    send = None if continuous else lean.framed_sender()
                    return None if send is None else (ka, send, pending)

            try:
                for i, job in enumerate(jobs):
                    if i > 0:
                        open_ahead(i + PROMPTS_AHEAD)
                        es = await later[i - 1]
                    if self.chat:
                        assert not isinstance(enc, CompletionChunks)
                        states = job.states
                        if len(states) == 1:
                            heads = [enc.role(job.index_base + states[0].index)]
                        else:
                            heads = [enc.role(job.index_base + st.index) for st in states]
                        if self.return_ids:  # (vLLM's: on each role chunk)
                            heads = [with_prompt_ids(h, job.ids) for h in heads]
                        pending.extend(self._with_usage(heads, job) if continuous else heads)
                    elif job.echo and not self.echo_logprobs:  # (with logprobs: _drive writes them)
                        assert isinstance(enc, CompletionChunks)
                        heads = [enc.content(job.index_base + st.index, job.echo) for st in job.states]
                        if self.return_ids:  # a choice's first chunk: its prompt's ids (the echo's none)
                            heads = [with_choice_ids(h, (), job.ids) for h in heads]
                        pending.extend(self._with_usage(heads, job) if continuous else heads)
                    async with closing_engine_call(es, self._gone_reason):
                        await self._drive(es, job, emit, emit_now, drain, writer)
                    self._account(job)
                tail = pending
                t = self.totals
                if self._events is not None:
                    tail.append(await self._events.end(t.prompt, t.completion, t.cached))
                else:
                    assert isinstance(enc, ChatChunks | CompletionChunks)
                    if self.s.include_usage:
                        tail.append(enc.usage_of(t.prompt, t.completion, t.cached))
                    tail.append(DONE)
                await resp.write_eof(b"".join(tail))  # the last bytes and the end of the body: one write
                self.done()
            except (EngineError, ApiError, TimeoutError) as e:
                # headers are gone: report in-band, then end the stream cleanly
                await resp.write_eof(b"".join(pending) + self._failure(e))
            finally:
                keepalive.unregister(resp)
        except GONE as e:
            if not es.closed:
                await es.close(self._gone_reason())
            if sink is None:  # (a background response's log: its own end is stored as its task ends)
                await self._stopped(resp, e)
            raise
        finally:
            keepalive.unregister(resp)  # (idempotent) also when the headers could not be sent
            if later:
                _close_opened(later, gw.spawn)  # (first: nothing in it awaits, nothing can interrupt it)
            if not es.closed:
                await es.close("cancelled")
        return resp

    def _gone_reason(self) -> str:
        """Why a stream's engine call is aborted when its task is cancelled: the client went away, or the
        node's shutdown grace is over (``Gateway.stopping``)."""
        return CLIENT_DISCONNECT if not self.gw.stopping else "cancelled"

    async def _stopped(self, resp: web.StreamResponse, e: BaseException) -> None:
        """A stream under way cancelled because the node's shutdown grace is over (``Gateway.stopping``):
        it ends with its in-band error and its body's end (``server_shutting_down``), not cut."""
        if not (isinstance(e, asyncio.CancelledError) and self.gw.stopping and resp.prepared):
            return
        if getattr(resp, "lean_ended", False):
            return
        err = EngineError("The node is shutting down.", code="server_shutting_down", retryable=False)
        with contextlib.suppress(Exception):
            await resp.write_eof(self._failure(err))

    def _failure(self, e: EngineError | ApiError | TimeoutError) -> bytes:
        """The last bytes of a stream that failed after its headers: the error event (then ``[DONE]``),
        or the Responses / Messages events' own."""
        msg, code = _describe(e)
        if isinstance(e, EngineError):  # (as the error middleware's answers: no worker address)
            msg = public_engine_message(msg, (w.url for w in self.gw.registry.workers.values()))
        tracing.record_error(e)
        self.gw.metrics.errors.labels(self.request.path, code).inc()
        if self._events is None:
            return error_event(msg, "server_error", code) + DONE
        return self._events.failed(msg, code)


async def _each_job(jobs: list[Job], run: Callable[[int, Job], Coroutine[Any, Any, None]]) -> None:
    """``run(i, job)`` for every job: one awaited as it is; a list of prompts all at once (the engine
    batches them, as vLLM schedules them), the first failure cancelling the rest (their engine calls
    aborted) and raised as it is."""
    if len(jobs) == 1:
        await run(0, jobs[0])
        return
    try:
        async with asyncio.TaskGroup() as tg:
            for i, job in enumerate(jobs):
                tg.create_task(run(i, job))
    except BaseExceptionGroup as eg:
        raise eg.exceptions[0] from None


def _prompt_lps_in(batch: Sequence[EngineEvent]) -> PromptLogprobs | None:
    """The prompt's logprobs the first event of ``batch`` that carries them has (a choice's first chunk,
    or a whole answer); None: none does."""
    for ev in batch:
        p = ev.prompt_logprobs if isinstance(ev, PromptChunk | EngineComplete) else None
        if p is not None:
            return p
    return None


# finish reasons of a choice the engine gave up on: SGLang's "abort" (scheduler-side: preemption, a full
# queue, KV pressure), vLLM's "error": an error to the client, never a 200 with that reason
ENGINE_FAILED = frozenset({"abort", "error"})


def _close_opened(
    opening: Sequence[asyncio.Future[EngineStream]], spawn: Callable[[Coroutine[Any, Any, Any]], None]
) -> None:
    """The engine calls of a stream's later prompts that were not driven to their end: the openings still
    under way cancelled, every stream opened (now, or when its opening completes regardless) closed in
    the background (``spawn``: the gateway's); failures retrieved. Nothing awaited: a second cancellation
    of the handler cannot stop it halfway."""

    def settle(fut: asyncio.Future[EngineStream]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        es = fut.result()
        if not es.closed:
            spawn(es.close("cancelled"))

    for fut in opening:
        if fut.done():
            settle(fut)
        else:
            fut.add_done_callback(settle)
            fut.cancel()


def _next_open(done: list[bool]) -> int:
    """The first choice without its engine Complete (-1: none)."""
    for j, d in enumerate(done):
        if not d:
            return j
    return -1


def final_delta_is_new(out: Sequence[int], count: int, got: int, last: Sequence[int]) -> bool:
    """Whether a streamed choice's Complete carries tokens its chunks did not (``out``: its
    ``output_ids``; ``count``: its ``completion_tokens``; ``got``: the chunk tokens received; ``last``:
    the last chunk's ids). Servicers differ: SMG's (SGLang and vLLM) send the final delta in a chunk and
    again in the Complete; SGLang's in-tree server sends it in the Complete only. A cumulative count
    that includes ``out`` on top of the chunks says new; else ``out`` repeating the end of the last
    chunk says repeated; anything else is new."""
    if got and count == got + len(out):
        return True
    k = len(out)
    return not (k <= len(last) and list(last[len(last) - k :]) == list(out))


def strict_violation(strict: Sequence[Violation]) -> ApiError:
    """The 422 of an answer that breaks the structure it was promised to keep (strict schemas, with
    ``--reject-schema-violations``): a deterministic failure, so not a status SDKs retry (the openai
    SDK retries 408, 409, 429 and 5xx: a 502 ran ``parse()``'s generation three times)."""
    return ApiError(
        422,
        "The engine's output does not conform to the requested structure: " + header_value(strict),
        type="server_error",
        param=strict[0].param,
        code="schema_violation",
    )


def _describe(e: BaseException) -> tuple[str, str]:
    if isinstance(e, ApiError):
        return e.message, e.code or "error"
    if isinstance(e, EngineError):
        return str(e), e.code
    return "the request timed out", "timeout"
