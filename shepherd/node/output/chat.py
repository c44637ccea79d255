"""The parser stage of chat answers: what one request asks for (``ChatShaping``), and per choice the
reasoning and tool-call parsers between the stop matcher and the encoder (``ChoiceParsing``).

Which parsers apply:

- reasoning: the model's reasoning family (``--reasoning-parser``, the model's ``reasoning_parser``,
  else by model name), unless ``separate_reasoning`` is false or the request turned thinking off
  (``chat_template_kwargs``: ``enable_thinking`` / ``thinking``, per family) or the template closed
  the think block itself; the rendered prompt says whether the think block is already open; with
  ``include_reasoning`` false (vLLM's) the reasoning is still parsed out of the output, and dropped
  (no ``reasoning_content``, no reasoning deltas);
- tool calls: the model's tool-call family with ``tool_choice`` auto; the ``json`` family when a call
  is forced (``required`` / named: the engine is held to a JSON array of calls); none with
  ``tool_choice: none`` or without tools. Calls to tools the request did not define come back as text.
  ``parallel_tool_calls: false`` keeps only the first call. A Kimi K2 model's calls are answered with
  the ids its templates write into the history, ``functions.NAME:N`` with N counting on from the calls
  already in the conversation (SGLang's and SMG's ids for it, whatever id the model wrote: a model that
  repeats an id, or restarts at ``:0`` under a strict tool's structural tag, would answer two calls of
  one message, or of one conversation, under one id).

When neither applies, ``ChatShaping.output`` is None and the token path has no parser stage at all.
Parsers are per choice and per request: ``ChatOutput.choice()`` builds fresh ones.

With a tool parser (or the harmony format) the detokenizer keeps special tokens (SGLang does the
same): the formats' markers are special tokens in the models' vocabularies. Stop strings and stop
tokens are applied before the parsers, so a stop word never reaches them nor the client.

Answer shape (OpenAI's): ``message.tool_calls`` ``[{id, type: "function", function: {name,
arguments}}]``, ``content`` null when the answer is only calls (white space before a call, or after the
last one, is no content: dropped from streams as from whole answers), ``finish_reason: "tool_calls"`` when
a choice that called tools stopped by itself; ``reasoning_content`` beside ``content`` when a
reasoning parser ran (the chat completions API adds vLLM's ``reasoning`` per ``--reasoning-field``, and
answers a legacy ``functions`` request's call as ``function_call``: ``api_choice``). Streamed:
``delta.reasoning_content`` (and/or ``delta.reasoning``: ``ChatChunks``), and per call ``delta.tool_calls[0]``
with ``index``, ``id``, ``type`` and ``function.name`` first, then ``function.arguments`` (a call is
reported once complete, so its arguments come in one fragment).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from shepherd.node.openai.requests import ChatRequest, Sampling
from shepherd.node.openai.structured import Constraint, OutputChecks, response_format_constraint
from shepherd.node.openai.tool_choice import (
    ToolChoiceError,
    call_array_schema,
    structural_tag,
    template_tools,
)
from shepherd.parsers import (
    REASONING_FAMILIES,
    ReasoningParser,
    TextDelta,
    ToolCallStart,
    ToolEvent,
    ToolParser,
    get_reasoning_parser,
    get_tool_parser,
    prompt_closes_think,
    prompt_opens_think,
    reasoning_family_name,
    thinking_enabled,
)
from shepherd.parsers.reasoning import ThinkSpec
from shepherd.parsers.registry import ReasoningFamily
from shepherd.parsers.tool_delimited import DelimitedToolParser
from shepherd.proto.openai_errors import bad

__all__ = [
    "ChatOutput",
    "ChatShaping",
    "ChoiceEncoder",
    "ChoiceParsing",
    "ParsedChoice",
    "api_choice",
    "chat_message",
    "encode_events",
    "final_reason",
    "replay",
    "shape_chat",
]

_dumps = orjson.dumps


class ChoiceEncoder(Protocol):
    """What the parser stage writes a streamed choice's events to: ``shepherd.node.openai.sse.ChatChunks``
    (chat completion chunks) or the Responses API's event encoder (``shepherd.node.output.responses``)."""

    def content(self, index: int, text: str, logprobs: dict[str, Any] | None = None) -> bytes: ...

    def reasoning(self, index: int, text: str, logprobs: dict[str, Any] | None = None) -> bytes: ...

    def tool_call(
        self, index: int, call: int, call_id: str, name: str, logprobs: dict[str, Any] | None = None
    ) -> bytes: ...

    def tool_args(self, index: int, call: int, fragment: str) -> bytes: ...


@dataclass(frozen=True, slots=True)
class ChatOutput:
    """The parser configuration of one request; ``choice()`` makes one choice's fresh parsers."""

    reasoning: str | None  # reasoning family, None: off
    prompt_opened_think: bool
    tool_parser: str | None  # tool-call family, None: off
    tools: tuple[Mapping[str, Any], ...]
    parallel_tool_calls: bool
    include_reasoning: bool = True  # vLLM's ``include_reasoning``: false parses the reasoning out, drops it
    # a call the output was cut off inside is a partial call (the Messages API's ``tool_use`` block under
    # ``max_tokens``), not text: ``get_tool_parser``'s ``partial_calls``
    partial_calls: bool = False
    kimi_ids: int | None = None  # calls get Kimi K2's ids, counting on from this many (``ChoiceParsing``)
    # streamed, a call starts before its end and its arguments go out as they are generated (vLLM's and
    # SGLang's streaming; the Messages API: only on Anthropic's opt-in, ``MessagesRequest.eager_tools``)
    live_calls: bool = True

    def choice(self, enc: ChoiceEncoder | None = None, index: int = 0, live: bool = True) -> ChoiceParsing:
        """Fresh parsers for one choice; ``enc`` and ``index`` for a streamed one (``live``: as it is
        generated, its calls started before their end; not a whole answer replayed)."""
        reasoning = (
            get_reasoning_parser(
                self.reasoning,
                prompt_opened_think=self.prompt_opened_think,
                tool_calls=self.tool_parser is not None,
            )
            if self.reasoning
            else None
        )
        tools = (
            get_tool_parser(
                self.tool_parser, tools=self.tools, known_names_only=True, partial_calls=self.partial_calls
            )
            if self.tool_parser
            else None
        )
        if enc is not None and live and self.live_calls and isinstance(tools, DelimitedToolParser):
            tools.stream_args = True  # a streamed answer: calls start before their end (hermes)
        return ChoiceParsing(
            reasoning,
            tools,
            single_call=not self.parallel_tool_calls,
            enc=enc,
            index=index,
            drop_reasoning=not self.include_reasoning,
            kimi_ids=self.kimi_ids,
        )

    def message(self, text: str) -> tuple[dict[str, Any], ParsedChoice | None]:
        """The OpenAI ``message`` of a complete (non-streamed) choice, and what the parsers made of it
        (None when they made nothing of it: plain content). Equal to ``chat_message`` of
        ``choice().whole(text)``, without building the parsers when a think-tag reasoning parser alone
        would pass the text through whole (the output does not begin with the start marker)."""
        spec = (
            _passthrough_spec(self.reasoning, self.prompt_opened_think) if self.tool_parser is None else None
        )
        if spec is not None:
            t = text.lstrip()
            if t and not t.startswith(spec.start) and not spec.start.startswith(t):
                return {"role": "assistant", "content": text, "reasoning_content": None}, None
        parsed = self.choice().whole(text)
        return chat_message(parsed, self.reasoning is not None), parsed


# the families named by their canonical key (the registry resolves the key to itself)
_CANONICAL_FAMILIES: Mapping[str, ReasoningFamily] = {
    k: f for k, f in REASONING_FAMILIES.items() if reasoning_family_name(k) == k
}


@functools.lru_cache(maxsize=64)
def _passthrough_spec(reasoning: str | None, opened: bool) -> ThinkSpec | None:
    """The think-tag spec of a reasoning family whose parser, fresh, turns output that does not begin
    with the start marker into content as it is (no block opened by the prompt or forced, no content
    markers to drop); None for any other family."""
    family = REASONING_FAMILIES.get(reasoning) if reasoning is not None and not opened else None
    spec = family.spec if family is not None else None
    if spec is None or spec.forced or spec.content_drop:
        return None
    return spec


@dataclass(slots=True)
class ChatShaping:
    """Everything a chat request changes about generation and output beyond plain text (read-only by
    convention: built per request, where a frozen dataclass costs ~0.5 µs more)."""

    sampling: Sampling  # the request's, with skip_special_tokens off when parsers need the markers
    output: ChatOutput | None
    constraint: Constraint | None
    checks: OutputChecks | None
    legacy_functions: bool = False  # answer tool calls as the legacy ``function_call``
    # the chat completions API's finish reason for a choice that called tools (``final_reason``'s
    # ``tool_calls``): ``stop`` when ``tool_choice`` named the function (OpenAI's, and vLLM's since it
    # aligned: the call was asked for, not chosen), ``function_call`` for a legacy ``functions`` request
    calls_finish: str = "tool_calls"


def shape_chat(families: tuple[str | None, str | None], req: ChatRequest, prompt: str) -> ChatShaping:
    """``families``: the model's (reasoning, tool-call) parser families; ``prompt``: the rendered
    prompt text (it tells whether the template opened a think block)."""
    reasoning_family, tool_family = families
    reasoning, opened = reasoning_side(reasoning_family, req, prompt)
    # the common case: no tools, no format, no constraint, no checks
    if not req.tools and req.response_format is None and req.guided is None:
        sampling = req.sampling
        if reasoning == "gpt_oss" and sampling.skip_special_tokens:
            sampling = dataclasses.replace(sampling, skip_special_tokens=False)
        include = req.include_reasoning and req.separate_reasoning
        parallel = req.parallel_tool_calls
        plain = None if reasoning is None else _reasoning_only(reasoning, opened, parallel, include)
        return ChatShaping(sampling, plain, None, None)
    return _shape_tools(tool_family, req, reasoning, opened)


def reasoning_side(family: str | None, req: ChatRequest, prompt: str) -> tuple[str | None, bool]:
    """The reasoning parser a request's output goes through (None: off) and whether the rendered prompt
    left a think block open."""
    if not family:
        return None, False
    fam = _CANONICAL_FAMILIES.get(family)
    if not req.separate_reasoning:
        # harmony (gpt-oss) is parsed all the same: its channels are markup, not text to show (the
        # reasoning is then dropped: ``include_reasoning`` off with ``separate_reasoning``)
        harmony = fam.spec is None if fam is not None else reasoning_family_name(family) == "gpt_oss"
        return (family, False) if harmony else (None, False)
    if fam is not None and not req.template_kwargs:  # the common case, without the registry's calls:
        if fam.thinking_kwarg and not fam.thinking_default:  # thinking is off unless asked for
            return None, False
        spec = fam.spec  # a prompt without the start marker near its end neither closes nor opens a block
        if spec is None or prompt.find(spec.start, len(prompt) - 4096) == -1:
            return family, False
    if (
        family
        and req.separate_reasoning
        and thinking_enabled(family, req.template_kwargs)
        and not prompt_closes_think(family, prompt)
    ):
        return family, prompt_opens_think(family, prompt)
    return None, False


def _shape_tools(
    tool_family: str | None, req: ChatRequest, reasoning: str | None, opened: bool
) -> ChatShaping:
    """``shape_chat`` for any request (tools, response formats), once the reasoning side is known."""
    choice = req.tool_choice
    tools = req.tools or []
    tool_parser: str | None = None
    constraint: Constraint | None = None
    forced = ""
    if tools and choice.mode != "none":
        if choice.forces_call and req.guided is not None:
            msg = f"'{req.guided_param}' cannot be combined with a forced tool call ('tool_choice')."
            raise bad(msg, param=req.guided_param, code="conflicting_constraints")
        if choice.forces_call:
            tool_parser = "json"
            forced = choice.name or "required"
            try:
                schema = call_array_schema(tools, choice, req.parallel_tool_calls)
            except ToolChoiceError as e:
                raise bad(str(e), param="tools") from None
            constraint = Constraint("json_schema", orjson.dumps(schema).decode())
        else:
            tool_parser = tool_family
            own = req.guided is not None or response_format_constraint(req.response_format) is not None
            tag = structural_tag(tool_family, tools) if tool_family and not own else None
            if tag is not None:
                constraint = Constraint("structural_tag", tag)
    if constraint is None:
        # a guided field or a response_format the request set wins over the (strict) tools' structural
        # tag under tool_choice auto, as SGLang's and vLLM's HTTP servers apply them (the request's
        # constraint is the one the engine applies; the calls are still checked against their schemas)
        constraint = req.guided or response_format_constraint(req.response_format)
    checks = OutputChecks.build(req.response_format, tools if tool_parser else None, forced)
    sampling = req.sampling
    if sampling.skip_special_tokens and (tool_parser is not None or reasoning == "gpt_oss"):
        # the markers of these formats are special tokens in the models' vocabularies
        sampling = dataclasses.replace(sampling, skip_special_tokens=False)
    output = None
    if reasoning is not None or tool_parser is not None:
        callable_tools = tuple(template_tools(tools, choice) or ())  # a named choice: only that one
        include = req.include_reasoning and req.separate_reasoning
        kimi = _history_calls(req.messages) if tool_parser is not None and tool_family == "kimi_k2" else None
        output = ChatOutput(
            reasoning, opened, tool_parser, callable_tools, req.parallel_tool_calls, include, kimi_ids=kimi
        )
    named = choice.forces_call and choice.name is not None
    calls_finish = "stop" if named else "function_call" if req.legacy_functions else "tool_calls"
    return ChatShaping(sampling, output, constraint, checks, req.legacy_functions, calls_finish)


def _history_calls(messages: Sequence[Mapping[str, Any]]) -> int:
    """The tool calls the conversation's assistant messages made (the ``N`` of Kimi K2's next id: its
    templates number the calls of the whole history)."""
    n = 0
    for m in messages:
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        n += len(calls) if isinstance(calls, list) else 0
    return n


@functools.lru_cache(maxsize=64)
def _reasoning_only(
    reasoning: str, opened: bool, parallel_tool_calls: bool, include_reasoning: bool = True
) -> ChatOutput:
    """The (immutable) parser configuration of a request with a reasoning parser and no tools."""
    return ChatOutput(reasoning, opened, None, (), parallel_tool_calls, include_reasoning)


# ---- per choice ----------------------------------------------------------------------------------------

log = logging.getLogger("shepherd.node.output")


class _TextTools:
    """Stands in for a tool parser that raised: the rest of the output is content."""

    __slots__ = ()

    def feed(self, text: str) -> list[ToolEvent]:
        return [TextDelta(text)] if text else []

    def finish(self, cut: bool = True) -> list[ToolEvent]:
        return []


class _TextReasoning:
    """Stands in for a reasoning parser that raised: the rest of the output is content."""

    __slots__ = ("passthrough",)

    def __init__(self) -> None:
        self.passthrough = True

    def feed(self, text: str) -> tuple[str, str]:
        return "", text

    def finish(self) -> tuple[str, str]:
        return "", ""


@dataclass(frozen=True, slots=True)
class ParsedChoice:
    reasoning: str
    content: str
    calls: tuple[tuple[str, str, str], ...]  # (id, name, arguments JSON)


class ChoiceParsing:
    """One choice's parsers: the reasoning parser, then the tool parser on its content.

    ``feed``/``finish`` → (reasoning delta, content and call events); ``stream``/``stream_end`` do the
    same and append the stream chunks at once (the per-token path: plain content, the common case,
    costs two parser calls and one chunk). Logprobs ride on the first chunk of a step; an empty content
    chunk carries them when the step produced nothing visible."""

    __slots__ = (
        "_content0",
        "_drop_reasoning",
        "_enc",
        "_held",
        "_index",
        "_kimi_ids",
        "_reasoning",
        "_run_text",
        "_single",
        "_tools",
        "has_calls",
    )

    def __init__(
        self,
        reasoning: ReasoningParser | None,
        tools: ToolParser | None,
        *,
        single_call: bool = False,
        enc: ChoiceEncoder | None = None,
        index: int = 0,
        drop_reasoning: bool = False,
        kimi_ids: int | None = None,
    ) -> None:
        self._reasoning = reasoning
        self._kimi_ids = kimi_ids  # (``ChatOutput.kimi_ids``)
        self._drop_reasoning = drop_reasoning  # the reasoning is parsed out of the output, not answered
        self._tools = tools
        self._single = single_call
        self._enc = enc
        self._index = index
        # an encoder's content(0, text) parts (the OpenAI chunks have them): a plain content chunk inline
        self._content0: tuple[bytes, bytes] | None = getattr(enc, "content0", None) if index == 0 else None
        self.has_calls = False
        # white space before a tool call is no content (``_calls``): the text run since the start or the
        # last call has shown non-space text (then its text goes out as it comes), else its white space
        # so far, held until non-space text (it goes out with it) or a call (dropped) decides
        self._run_text = False
        self._held: list[str] = []  # white space held (a list: a flood of it is no quadratic copy)

    def feed(self, text: str) -> tuple[str, list[ToolEvent]]:
        reasoning = ""
        if self._reasoning is not None:
            reasoning, text = self._reason(text)
            if self._drop_reasoning:
                reasoning = ""
        if self._tools is None:
            return reasoning, [TextDelta(text)] if text else []
        return reasoning, self._calls(self._tool_events(text)) if text else []

    def finish(self, cut: bool = True) -> tuple[str, list[ToolEvent]]:
        """The choice ended (``cut``: by the token limit, a ``length`` finish; see ``partial_calls``): the
        parsers' held reasoning and last events."""
        reasoning = text = ""
        if self._reasoning is not None:
            try:
                reasoning, text = self._reasoning.finish()
            except Exception:
                self._reasoning_failed()
            if self._drop_reasoning:
                reasoning = ""
        if self._tools is None:
            return reasoning, [TextDelta(text)] if text else []
        events = self._tool_events(text) if text else []
        try:
            events.extend(self._tools.finish(cut))
        except Exception:
            self._tools_failed()
        events = self._calls(events)
        if self._held:  # white space the answer ended on: content unless the answer made calls
            held = "".join(self._held)
            self._held.clear()
            if not self.has_calls:
                events.append(TextDelta(held))
        return reasoning, events

    # A parser that raises (a bug: the parsers turn what they cannot parse into text) must not fail the
    # request: it is logged and replaced by one that passes the text on, the text it was fed comes back
    # as content (what it held until then is lost).

    def _reasoning_failed(self) -> None:
        log.exception("reasoning parser failed; the rest of the output is content")
        self._reasoning = _TextReasoning()

    def _tools_failed(self) -> None:
        log.exception("tool-call parser failed; the rest of the output is content")
        self._tools = _TextTools()

    def _reason(self, text: str) -> tuple[str, str]:
        assert self._reasoning is not None
        try:
            return self._reasoning.feed(text)
        except Exception:
            self._reasoning_failed()
            return "", text

    def _tool_events(self, text: str) -> list[ToolEvent]:
        assert self._tools is not None
        try:
            return self._tools.feed(text)
        except Exception:
            self._tools_failed()
            return [TextDelta(text)]

    def _calls(self, events: list[ToolEvent]) -> list[ToolEvent]:
        """The tool parser's events as the client gets them: with ``parallel_tool_calls`` false only the
        first call; a text run (from the start or a call to the next call) of white space only is
        dropped, as a whole answer's content is null when it is only calls and white space (OpenAI's
        and vLLM's answers): held until non-space text or a call decides, so that streamed and whole
        answers agree, whatever the chunking (the end: ``finish``)."""
        if self._run_text:
            for ev in events:
                if type(ev) is not TextDelta:
                    break
            else:
                return events
        if self._single:
            events = [ev for ev in events if type(ev) is TextDelta or ev.index == 0]
        out: list[ToolEvent] = []
        for ev in events:
            if isinstance(ev, TextDelta):
                if self._run_text:
                    out.append(ev)
                    continue
                text = ev.text
                if not text or text.isspace():
                    if text:
                        self._held.append(text)
                    continue
                if self._held:
                    ev = TextDelta("".join(self._held) + text)
                    self._held.clear()
                self._run_text = True
            elif isinstance(ev, ToolCallStart):
                if self._kimi_ids is not None:
                    ev = ToolCallStart(
                        ev.index, f"functions.{ev.name}:{self._kimi_ids + ev.index}", ev.name, ev.partial
                    )
                if not ev.partial:  # (a call cut off by the end is no call made: no ``tool_calls`` finish)
                    self.has_calls = True
                self._held.clear()  # white space before a call: no content
                self._run_text = False
            out.append(ev)
        return out

    def plain_content(self) -> tuple[tuple[bytes, bytes], ReasoningParser | None] | None:
        """With no tool parser and the encoder's ``content0`` parts: those and the reasoning parser (None:
        none): ``stream`` of text without logprobs is then the content chunk ``parts[0] + JSON(text) +
        parts[1]`` whenever the reasoning parser is absent or ``passthrough``."""
        c0 = self._content0
        if c0 is None or self._tools is not None:
            return None
        return c0, self._reasoning

    def stream(self, text: str, logprobs: dict[str, Any] | None, out: list[bytes]) -> None:
        """New visible text of the choice → its stream chunks (needs ``enc``)."""
        enc = self._enc
        assert enc is not None
        index = self._index
        r = self._reasoning
        if r is not None and text and not r.passthrough:
            try:  # (inline, not ``_reason``: the per-token path)
                reasoning, text = r.feed(text)
            except Exception:
                self._reasoning_failed()
                reasoning = ""
            if reasoning and not self._drop_reasoning:
                out.append(enc.reasoning(index, reasoning, logprobs))
                logprobs = None
        if not text:
            if logprobs is not None:
                out.append(enc.content(index, "", logprobs))
            return
        if self._tools is None:
            c0 = self._content0
            if c0 is not None and logprobs is None:
                out.append(c0[0] + _dumps(text) + c0[1])
            else:
                out.append(enc.content(index, text, logprobs))
            return
        try:
            events = self._tools.feed(text)
        except Exception:
            self._tools_failed()
            events = [TextDelta(text)]
        if len(events) == 1 and type(events[0]) is TextDelta and self._run_text:
            out.append(enc.content(index, events[0].text, logprobs))
            return
        encode_events(enc, index, self._calls(events), logprobs, out)

    def stream_end(self, out: list[bytes], cut: bool = True) -> None:
        """The choice ended (``cut``: by the token limit): the parsers' held text and last calls as chunks."""
        assert self._enc is not None
        reasoning, events = self.finish(cut)
        if reasoning:
            out.append(self._enc.reasoning(self._index, reasoning))
        encode_events(self._enc, self._index, events, None, out)

    def whole(self, text: str) -> ParsedChoice:
        """The complete output at once (a non-streamed answer). A partial call (``partial_calls``: the
        output was cut off inside it) is not among the calls: the encoders' answers have it (``replay``)."""
        r1, e1 = self.feed(text)
        r2, e2 = self.finish()
        content: list[str] = []
        heads: dict[int, tuple[str, str]] = {}
        args: dict[int, list[str]] = {}
        cut: set[int] = set()
        for ev in (*e1, *e2):
            if isinstance(ev, TextDelta):
                content.append(ev.text)
            elif isinstance(ev, ToolCallStart):
                if ev.partial:
                    cut.add(ev.index)
                    continue
                heads[ev.index] = (ev.id, ev.name)
                args.setdefault(ev.index, [])
            elif ev.index not in cut:
                args.setdefault(ev.index, []).append(ev.json)
        calls = tuple((*heads[i], "".join(args[i])) for i in sorted(heads))
        return ParsedChoice(r1 + r2, "".join(content), calls)


def encode_events(
    enc: ChoiceEncoder,
    index: int,
    events: Sequence[ToolEvent],
    logprobs: dict[str, Any] | None,
    out: list[bytes],
) -> None:
    """Stream chunks for content and call events (consecutive content merged into one chunk)."""
    text: list[str] = []
    for ev in events:
        if isinstance(ev, TextDelta):
            text.append(ev.text)
            continue
        if text:
            out.append(enc.content(index, "".join(text), logprobs))
            logprobs = None
            text = []
        if isinstance(ev, ToolCallStart):
            out.append(enc.tool_call(index, ev.index, ev.id, ev.name, logprobs))
            logprobs = None
        else:
            out.append(enc.tool_args(index, ev.index, ev.json))
    if text:
        out.append(enc.content(index, "".join(text), logprobs))
    elif logprobs is not None:
        out.append(enc.content(index, "", logprobs))


def replay(
    output: ChatOutput | None,
    enc: ChoiceEncoder,
    text: str,
    logprobs: dict[str, Any] | None = None,
    cut: bool = True,
) -> bool:
    """A whole (non-streamed) choice's output written to a stream encoder as a stream of one chunk
    would write it: the same parser stage, the same encoder calls (the caller then ``finish``es the
    choice). The Messages and Responses APIs build their non-streamed answers from what the encoder
    recorded (content blocks, output items), so both answers have the same blocks, in generation
    order. Whether the output made tool calls. ``cut``: the token limit ended the output
    (``partial_calls``)."""
    out: list[bytes] = []
    if output is None:
        if text or logprobs is not None:
            out.append(enc.content(0, text, logprobs))
        return False
    post = output.choice(enc, 0, live=False)
    post.stream(text, logprobs, out)
    post.stream_end(out, cut)
    return post.has_calls


def final_reason(reason: str | None, matched: str | int | None, has_calls: bool) -> tuple[str, Any]:
    """A choice that made tool calls and stopped naturally finishes with ``tool_calls``."""
    if has_calls and reason == "stop":
        return "tool_calls", None
    return reason or "stop", matched


def chat_message(parsed: ParsedChoice, with_reasoning: bool) -> dict[str, Any]:
    """The OpenAI ``message`` of a parsed choice: ``content`` null when the answer is only calls, or
    nothing but what a reasoning parser took (shown or dropped: as vLLM's reasoning parsers answer, and
    as a stream of it shows no content); ``with_reasoning``: a reasoning parser ran."""
    text = parsed.content
    content: str | None = text
    if (parsed.calls and not text.strip()) or (not text and (parsed.reasoning or with_reasoning)):
        content = None
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if with_reasoning:
        msg["reasoning_content"] = parsed.reasoning or None
    if parsed.calls:
        msg["tool_calls"] = [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
            for cid, name, args in parsed.calls
        ]
    return msg


def api_choice(
    choice: dict[str, Any], reasoning_field: str, legacy_functions: bool, calls_finish: str
) -> None:
    """A chat completion choice (``_final_choices``' shape: ``message`` with ``reasoning_content`` and
    ``tool_calls``) as the chat completions API answers it: reasoning under ``reasoning`` and/or
    ``reasoning_content`` (``--reasoning-field``: vLLM answers ``reasoning``), for a request that used
    the legacy ``functions`` its call as ``message.function_call``, and a choice that called tools
    finishing with ``calls_finish`` (``ChatShaping.calls_finish``). In place."""
    if choice.get("finish_reason") == "tool_calls":
        choice["finish_reason"] = calls_finish
    message = choice["message"]
    if "reasoning_content" in message and reasoning_field != "reasoning_content":
        value = (
            message["reasoning_content"] if reasoning_field == "both" else message.pop("reasoning_content")
        )
        message["reasoning"] = value
    if legacy_functions:
        calls = message.pop("tool_calls", None)
        if calls:
            fn = calls[0]["function"]
            message["function_call"] = {"name": fn["name"], "arguments": fn["arguments"]}
