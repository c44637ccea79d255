"""Chat templates rendered the way ``transformers.apply_chat_template`` renders them.

A template is compiled once in the jinja2 sandbox of chat_env.py and rendered with the context
transformers gives it: ``messages`` (prepared as in chat_messages.py), ``tools``, ``documents``,
``add_generation_prompt``, the special-token strings (``bos_token``, ``eos_token``, ...),
``strftime_now`` and any extra keyword arguments (``enable_thinking``, ``reasoning_effort``, ...).

Rendered prompts are kept in a bounded LRU keyed by an order-preserving serialization of the inputs:
key order matters (``tojson`` and ``items()`` render dict keys in insertion order), so keys are NOT
sorted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Final, Literal

import jinja2
import orjson
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment

from shepherd.tokens.chat_env import _environment
from shepherd.tokens.chat_messages import (
    ChatTemplateError,
    Message,
    _cut_at_tag,
    _prepare_messages,
    _tag_final_message,
    name_tool_outputs,
    normalize_tool_call_arguments,
    normalize_tool_call_ids,
)
from shepherd.tokens.chat_skeleton import MARK_OPEN, SENTINEL, SkeletonCache

__all__ = ["ChatTemplate", "ToolCallShape"]

ClockReads = tuple[tuple[str, str], ...]  # the strftime_now calls of one render: (format, value)


@dataclass(frozen=True, slots=True)
class ToolCallShape:
    """What a template accepts in ``tool_calls`` (see ``ChatTemplate.tool_call_shape``)."""

    arguments: Literal["object", "string", "either", "unknown"]
    id_length: int | None


# gpt-oss's template writes a tool's description as one comment and a tool whose parameters have no
# properties as taking none; vLLM renders gpt-oss's prompt with openai-harmony instead, which writes a
# comment line per line of the description (none for no description, where the template's "+" of a
# null fails: a 400 for a tool OpenAI, vLLM and SMG take), and gives an object without properties
# (MCP's no-argument tools) or an empty schema as a parameter (harmony's ``template_tools_section``)
_HARMONY_REWRITES: Final = (
    (
        r'{{- "// " + tool.description + "\n" }}',
        r'{%- set harmony_desc = (tool.description or "").replace("\r\n", "\n") %}'
        r'{%- for line in (harmony_desc[:-1] if harmony_desc.endswith("\n") else harmony_desc).split("\n")'
        r' if harmony_desc %}{{- "// " + line + "\n" }}{%- endfor %}',
    ),
    (
        r'{{- "() => any;\n\n" }}',
        r'{%- if tool.parameters is mapping and tool.parameters.type == "object" %}'
        r'{{- "(_: " + ("// " + tool.parameters.description + "\n" if tool.parameters.description is string'
        r' else "") + "{\n}) => any;\n\n" }}'
        r"{%- elif tool.parameters is mapping and tool.parameters.type is not defined"
        r' and tool.parameters.oneOf is not defined %}{{- "(_: any) => any;\n\n" }}'
        r'{%- else %}{{- "() => any;\n\n" }}{%- endif %}',
    ),
)


# gpt-oss's template writes one tool call per assistant message (``tool_calls[0]``: the others lost), its
# arguments and a tool's output through ``tojson`` (a string quoted), names every tool output after the
# last call, refuses an assistant message with both ``content`` and ``thinking`` beside its calls (what
# the gpt-oss parser makes of a preamble after the analysis: a 400 for the next turn of any agent loop),
# and writes ``content`` beside calls as analysis (dropped once a final answer follows). vLLM, SGLang and
# SMG render gpt-oss's prompt with openai-harmony, which writes each call as a message of its own (the
# header as the template writes it, ``assistant to=functions.X<|channel|>commentary json``), the arguments
# and a tool's output as they are, each output named after its call (``tool_call_id``: set as the
# message's ``name`` by ``ChatTemplate``); here ``content`` beside calls is the preamble the gpt-oss parser
# made of a commentary message, and is written back so (after the analysis, as the model writes them).
_HARMONY_CALLS: Final = """            {{- "<|start|>assistant to=" }}
            {{- "functions." + tool_call.name + "<|channel|>commentary " }}
            {{- (tool_call.content_type if tool_call.content_type is defined else "json") + "<|message|>" }}
            {{- tool_call.arguments|tojson }}
            {{- "<|call|>" }}
            {%- set last_tool_call.name = tool_call.name %}"""
_HARMONY_MESSAGE_REWRITES: Final = (
    (
        _HARMONY_CALLS,
        r"{%- for harmony_call in message.tool_calls %}"
        r"{%- set tool_call = harmony_call.function if harmony_call.function else harmony_call %}"
        r'{{- "<|start|>assistant to=functions." + tool_call.name + "<|channel|>commentary " }}'
        r'{{- (tool_call.content_type if tool_call.content_type is defined else "json") + "<|message|>" }}'
        r"{{- tool_call.arguments if tool_call.arguments is string else tool_call.arguments|tojson }}"
        r'{{- "<|call|>" }}{%- set last_tool_call.name = tool_call.name %}{%- endfor %}',
    ),
    (
        r'{{- raise_exception("Cannot pass both content and thinking in an assistant message with tool calls!'
        r' Put the analysis message in one or the other, but not both.") }}',
        r"{%- if not future_final_message.found %}"
        r'{{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}'
        r"{%- endif %}"
        r'{{- "<|start|>assistant<|channel|>commentary<|message|>" + message.content + "<|end|>" }}',
    ),
    (
        "{%- elif message.content and not future_final_message.found %}\n                "
        r'{{- "<|start|>assistant<|channel|>analysis<|message|>" + message.content + "<|end|>" }}',
        r"{%- elif message.content %}"
        r'{{- "<|start|>assistant<|channel|>commentary<|message|>" + message.content + "<|end|>" }}',
    ),
    (
        r'{{- "<|start|>functions." + last_tool_call.name }}',
        r'{{- "<|start|>functions." + (message.name if message.name is string and message.name'
        r" else last_tool_call.name) }}",
    ),
    (
        r'" to=assistant<|channel|>commentary<|message|>" + message.content|tojson + "<|end|>"',
        r'" to=assistant<|channel|>commentary<|message|>"'
        r' + (message.content if message.content is string else message.content|tojson) + "<|end|>"',
    ),
)


def _as_harmony_renders(source: str) -> str:
    """gpt-oss's template with its tool header and its tool calls and outputs written as openai-harmony
    writes them (others as given)."""
    if "render_tool_namespace" not in source:
        return source
    for old, new in _HARMONY_REWRITES:
        source = source.replace(old, new)
    if _HARMONY_CALLS in source:
        for old, new in _HARMONY_MESSAGE_REWRITES:
            source = source.replace(old, new)
    return source


class ChatTemplate:
    """One compiled template plus the special-token strings it is rendered with, and a render cache.

    ``special_tokens`` is transformers' ``special_tokens_map`` (``bos_token``, ``eos_token``,
    ``pad_token``, ...: strings, absent when unset); template kwargs override it.
    """

    def __init__(
        self,
        source: str,
        *,
        name: str = "default",
        special_tokens: Mapping[str, Any] | None = None,
        cache_size: int = 1024,
        cache_bytes: int = 32 << 20,
        env: SandboxedEnvironment | None = None,
        fix_tool_calls: bool = True,
    ) -> None:
        self.name = name
        self.fix_tool_calls = fix_tool_calls
        self._tool_call_shape: ToolCallShape | None = None
        self.source = source
        # gpt-oss's: tool calls and outputs as openai-harmony writes them (``_as_harmony_renders``)
        self.harmony_calls = "render_tool_namespace" in source and _HARMONY_CALLS in source
        self.special_tokens: dict[str, Any] = dict(special_tokens or {})
        try:
            self._template = (env or _environment()).from_string(_as_harmony_renders(source))
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template {name!r} does not compile: {e}") from e
        # A template that reads the clock is cached with what it read, and a hit must read the same.
        self.uses_clock = "strftime_now" in source
        self.cacheable = cache_size > 0
        self._cache: OrderedDict[bytes, tuple[str, ClockReads]] = OrderedDict()
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        self._bytes = 0  # keys + texts held (texts counted as their length in characters)
        self.hits = 0
        self.misses = 0
        # (bounded in bytes too: a shape key holds the tools and template kwargs; in the node and in
        # every pool worker, each template has its own)
        self.skeletons = (
            SkeletonCache(size=cache_size, max_bytes=cache_bytes // 2) if cache_size > 0 else None
        )
        # Plain conversations (every message just a role and a text) skip the copies and the JSON shape
        # key: the template gets the caller's messages, which an immutable sandbox cannot change.
        self._plain_skeletons = (
            self.skeletons is not None
            and not self.uses_clock
            and isinstance(self._template.environment, ImmutableSandboxedEnvironment)
        )

    @classmethod
    def from_file(
        cls, path: str | Path, *, name: str = "default", special_tokens: Mapping[str, Any] | None = None
    ) -> ChatTemplate:
        return cls(Path(path).read_text(encoding="utf-8"), name=name, special_tokens=special_tokens)

    @staticmethod
    def serialize(
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        continue_final_message: bool | str,
        template_kwargs: Mapping[str, Any] | None,
    ) -> bytes | None:
        """The render inputs as order-preserving JSON: the render-cache key, and what a pool worker
        receives (None when they are not plain JSON data: such renders are neither cached nor sent).

        Keys are not sorted: dict order shows in renders (``tojson``, ``items()``)."""
        try:
            return orjson.dumps(
                (messages, tools, add_generation_prompt, continue_final_message, template_kwargs)
            )
        except TypeError:
            return None

    def render_serialized_for_parent(self, payload: bytes) -> tuple[str, ClockReads, list[Any] | None]:
        """Render from ``serialize``'s output in a pool worker: the text, its clock reads, and the
        skeleton of the conversation's shape when it is a plain one (``adopt_skeleton`` takes it in
        the parent, which then fills that shape itself)."""
        messages, tools, add_generation_prompt, continue_final_message, template_kwargs = orjson.loads(
            payload
        )
        text, reads = self.render_recorded(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            template_kwargs=template_kwargs,
        )
        skeleton = None
        if self._plain_skeletons and tools is None and not continue_final_message:
            plain = _plain_shape(messages, add_generation_prompt, template_kwargs)
            if plain is not None:
                assert self.skeletons is not None
                skeleton = self.skeletons.export(plain[0])
        return text, reads, skeleton

    def adopt_skeleton(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None,
        skeleton: Any,
    ) -> bool:
        """Take the skeleton a pool worker made for the shape of these (plain) messages."""
        if not self._plain_skeletons or skeleton is None:
            return False
        plain = _plain_shape(messages, add_generation_prompt, template_kwargs)
        if plain is None:
            return False
        assert self.skeletons is not None
        return self.skeletons.adopt(plain[0], skeleton)

    def cached(self, key: bytes | None) -> str | None:
        """The cached render for ``key`` (counts a hit or a miss)."""
        if key is None or not self.cacheable:
            self.misses += 1
            return None
        entry = self._cache.get(key)
        if entry is None:
            self.misses += 1
            return None
        text, reads = entry
        if reads and any(datetime.now().strftime(fmt) != value for fmt, value in reads):
            del self._cache[key]  # the day (or whatever it printed) has changed
            self._bytes -= len(key) + len(text)
            self.misses += 1
            return None
        self._cache.move_to_end(key)
        self.hits += 1
        return text

    @property
    def cached_count(self) -> int:
        """Renders held in the cache."""
        return len(self._cache)

    def clear_cache(self) -> None:
        self._cache.clear()
        self._bytes = 0
        if self.skeletons is not None:
            self.skeletons.clear()

    def store(self, key: bytes | None, text: str, clock_reads: ClockReads = ()) -> None:
        """Remember a render; ``clock_reads`` are the ``strftime_now`` calls it made (format, value)."""
        if key is None or not self.cacheable:
            return
        size = len(key) + len(text)
        if size > self._cache_bytes:
            return
        old = self._cache.pop(key, None)
        if old is not None:
            self._bytes -= len(key) + len(old[0])
        self._cache[key] = (text, clock_reads)
        self._bytes += size
        while len(self._cache) > self._cache_size or self._bytes > self._cache_bytes:
            k, (t, _) = self._cache.popitem(last=False)
            self._bytes -= len(k) + len(t)

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool | str = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Render through the cache."""
        key = self.serialize(messages, tools, add_generation_prompt, continue_final_message, template_kwargs)
        text = self.cached(key)
        if text is None:
            text, reads = self.render_recorded(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                template_kwargs=template_kwargs,
            )
            self.store(key, text, reads)
        return text

    def render_from_skeleton(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str | None:
        """The render, when a plain conversation (every message a role and a text) has the shape of
        one rendered before and its skeleton fits: a fill, no jinja. None otherwise (nothing done)."""
        if not self._plain_skeletons or tools is not None:
            return None
        plain = _plain_shape(messages, add_generation_prompt, template_kwargs)
        if plain is None:
            return None
        assert self.skeletons is not None
        return self.skeletons.fill(*plain)

    def tool_call_shape(self) -> ToolCallShape:
        """How this template wants tool calls in assistant messages, found once by rendering probes:
        ``arguments`` "object" (transformers' convention: a string would be double-encoded or crash),
        "string" (concatenated as text: DeepSeek V3), "either" or "unknown"; ``id_length`` when the
        template refuses other ids (Mistral: 9)."""
        if self._tool_call_shape is None:
            self._tool_call_shape = self._probe_tool_calls()
        return self._tool_call_shape

    def _probe_tool_calls(self) -> ToolCallShape:
        shape = self._probe_tool_calls_with(None)
        if shape.arguments == "unknown":  # a template that renders only with tools (Hermes' tool_use)
            fn = {"name": "probe_fn", "description": "probe", "parameters": {"type": "object"}}
            shape = self._probe_tool_calls_with([{"type": "function", "function": fn}])
        return shape

    def _probe_tool_calls_with(self, tools: list[dict[str, Any]] | None) -> ToolCallShape:
        def attempt(args: Any, ident: str, content: str | None) -> str | None:
            call = {"id": ident, "type": "function", "function": {"name": "probe_fn", "arguments": args}}
            chat: list[dict[str, Any]] = [
                {"role": "user", "content": "probe"},
                {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": ident, "content": "probe result"},
            ]
            if content is not None:
                chat[1]["content"] = content
            try:
                return self._render(chat, tools, False, False, None)[0]
            except ChatTemplateError:
                return None

        as_dict, as_str = {"probe_arg": 1}, '{"probe_arg": 1}'
        for content in ("", None):
            for ident in ("call_probe0123456789", "Pr0beId42"):
                d, s = attempt(as_dict, ident, content), attempt(as_str, ident, content)
                if d is None and s is None:
                    continue
                id_length = len(ident) if ident == "Pr0beId42" else None
                if d is not None and s is None:
                    return ToolCallShape("object", id_length)
                if s is not None and d is None:
                    return ToolCallShape("string", id_length)
                assert s is not None
                return ToolCallShape("object" if '\\"probe_arg\\"' in s else "either", id_length)
        return ToolCallShape("unknown", None)

    def render_uncached(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool | str = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The render, without the cache (see ``render_recorded``)."""
        return self.render_recorded(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            template_kwargs=template_kwargs,
        )[0]

    def render_recorded(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool | str = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[str, ClockReads]:
        """Render as transformers 5.x ``apply_chat_template(tokenize=False)`` does: message keys whose
        value is None are dropped, reasoning fields are aliased (``reasoning_content`` / ``thinking``),
        ``continue_final_message`` (True, or the name of the field to continue) cuts the render at the
        end of the final message. Also returns the ``strftime_now`` calls made (format, value)."""
        if self._plain_skeletons and not continue_final_message and tools is None:
            plain = _plain_shape(messages, add_generation_prompt, template_kwargs)
            if plain is not None:
                key, contents = plain
                assert self.skeletons is not None
                return self.skeletons.render(
                    key,
                    messages,  # type: ignore[arg-type]  # a list of dicts: checked by _plain_shape
                    range(len(contents)),
                    lambda c: self._render_plain(c, None, add_generation_prompt, False, template_kwargs)[0],
                    contents,
                ), ()
        chat = _prepare_messages(messages)
        if self.fix_tool_calls and any("tool_calls" in m for m in chat):
            shape = self.tool_call_shape()
            # "either": objects, as vLLM (``_postprocess_messages``), SGLang and SMG give them to every
            # template; a string would be printed as the client spaced it where the template writes an
            # object through ``tojson`` (Qwen3, Hermes), or whole where it lays out an object's items
            # (Gemma 4's ``call:f{city:...}``, Kimi K3's typed arguments)
            if self.harmony_calls:  # the arguments as the model wrote them (an object: as JSON text)
                chat = name_tool_outputs(chat)
            if shape.arguments in ("object", "string", "either"):
                try:
                    as_string = shape.arguments == "string" or self.harmony_calls
                    chat = normalize_tool_call_arguments(chat, as_string=as_string)
                except (RecursionError, ValueError, TypeError) as e:
                    raise ChatTemplateError(f"tool call arguments cannot be converted: {e!r}") from None
            if shape.id_length is not None:
                chat = normalize_tool_call_ids(chat, shape.id_length)
        return self._render(chat, tools, add_generation_prompt, continue_final_message, template_kwargs)

    def _render(
        self,
        chat: list[dict[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        continue_final_message: bool | str,
        template_kwargs: Mapping[str, Any] | None,
    ) -> tuple[str, ClockReads]:
        if tools is not None and (
            isinstance(tools, str | bytes | Mapping) or not isinstance(tools, Sequence)
        ):
            raise ChatTemplateError("tools must be a list of JSON schemas")
        if tools is not None:
            for tool in tools:
                if not isinstance(tool, Mapping):
                    raise ChatTemplateError("each tool must be a JSON schema object")
        if continue_final_message:
            if add_generation_prompt:
                raise ChatTemplateError("continue_final_message and add_generation_prompt are not compatible")
            _tag_final_message(chat, continue_final_message, self.source)
        if self.skeletons is not None and not continue_final_message and not self.uses_clock:
            shape = _shape_key(chat, tools, add_generation_prompt, template_kwargs)
            if shape is not None:
                key, slots = shape
                return self.skeletons.render(
                    key,
                    chat,
                    slots,
                    lambda c: self._render_plain(c, tools, add_generation_prompt, False, template_kwargs)[0],
                ), ()
        return self._render_plain(chat, tools, add_generation_prompt, continue_final_message, template_kwargs)

    def _render_plain(
        self,
        chat: list[dict[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        continue_final_message: bool | str,
        template_kwargs: Mapping[str, Any] | None,
    ) -> tuple[str, ClockReads]:
        context: dict[str, Any] = dict(self.special_tokens)
        if template_kwargs:
            context.update(template_kwargs)
        context["messages"] = chat
        context["tools"] = tools
        context.setdefault("documents", None)
        context["add_generation_prompt"] = add_generation_prompt
        reads: list[tuple[str, str]] = []
        if self.uses_clock:

            def strftime_now(fmt: str) -> str:
                value = datetime.now().strftime(fmt)
                reads.append((fmt, value))
                return value

            context["strftime_now"] = strftime_now
        try:
            rendered = self._template.render(context)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template {self.name!r}: {e}") from e
        except Exception as e:  # whatever a template does with the input is a render failure
            # typically a template indexing into a message shape it did not expect
            raise ChatTemplateError(f"chat template {self.name!r} failed on these messages: {e!r}") from e
        if continue_final_message:
            rendered = _cut_at_tag(rendered)
        return rendered, tuple(reads)


def _shape_key(
    chat: list[dict[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    add_generation_prompt: bool,
    template_kwargs: Mapping[str, Any] | None,
) -> tuple[bytes, list[int]] | None:
    """What a render depends on besides the string contents of the messages (see chat_skeleton),
    and the indices of those messages; None when the inputs are not plain JSON data."""
    slots: list[int] = []
    shape: list[Any] = []
    for i, m in enumerate(chat):
        c = m.get("content")
        if type(c) is str and MARK_OPEN not in c and SENTINEL not in c:
            slots.append(i)
            shape.append([k if k == "content" else (k, v) for k, v in m.items()])
        else:
            shape.append(m)
    try:
        return orjson.dumps((shape, tools, add_generation_prompt, template_kwargs)), slots
    except TypeError:
        return None


_ROLE_CONTENT: Final = ["role", "content"]


def _plain_shape(
    messages: object, add_generation_prompt: bool, template_kwargs: Mapping[str, Any] | None
) -> tuple[tuple[Any, ...], list[str]] | None:
    """For a list of messages that are all exactly ``{"role": str, "content": str}`` (in that key
    order): the skeleton key of the conversation's shape (the roles, ``add_generation_prompt``, the
    template kwargs) and the contents. None for anything else (``_shape_key`` handles it). Renders
    from such messages need no preparation (no None values, no reasoning fields, no tool calls).
    Every content is a slot; one holding marker characters is no obstacle to filling a skeleton
    (``SkeletonCache.render`` only refuses to build one from it)."""
    if type(messages) is not list or not messages or type(add_generation_prompt) is not bool:
        return None  # (a template printing add_generation_prompt would tell 1 from True)
    roles: list[str] = []
    contents: list[str] = []
    for m in messages:
        if type(m) is not dict or len(m) != 2 or [*m] != _ROLE_CONTENT:
            return None
        role = m["role"]
        content = m["content"]
        if type(role) is not str or type(content) is not str:
            return None
        roles.append(role)
        contents.append(content)
    if template_kwargs:
        try:  # typed JSON: true and 1 render differently
            kwargs_key: bytes | None = orjson.dumps(template_kwargs)
        except TypeError:
            return None
    else:
        kwargs_key = None  # {} renders as None does
    return (add_generation_prompt, kwargs_key, tuple(roles)), contents
