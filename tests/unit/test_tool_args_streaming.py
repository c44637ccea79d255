"""A streamed hermes call starts once its name came and sends its arguments as they are generated.

- ``json_canon.CanonicalJson``: for any JSON object, written any way (spaced, compact, indented, ASCII
  escapes, surrogate pairs) and cut anywhere, what it returns is at every step a prefix of
  ``json.dumps(obj, ensure_ascii=False)`` and adds up to it at the end; what cannot be JSON stops it;
- the hermes parser with ``stream_args``: the call's start comes before its end marker, the argument
  pieces add up to the whole call's arguments (what a non-streamed answer has), whatever the chunking;
  an unknown tool or another layout is held to its end as before (text, or a call);
- the node's stream (the chat pipeline with the openai SDK's accumulation, in ``test_chat_tools_pipeline``)
  and the Messages stream carry the pieces as they come.
"""

from __future__ import annotations

import json
import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.node.anthropic.messages import MessageEvents
from shepherd.node.anthropic.requests import parse_messages
from shepherd.node.output.chat import ChatOutput
from shepherd.parsers import get_tool_parser
from shepherd.parsers.events import TextDelta, ToolCallArgs, ToolCallStart, ToolEvent
from shepherd.parsers.json_canon import CanonicalJson
from shepherd.parsers.tool_delimited import DelimitedToolParser

keys = st.text(max_size=6)
leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
values = st.recursive(
    leaves, lambda ch: st.lists(ch, max_size=4) | st.dictionaries(keys, ch, max_size=4), max_leaves=12
)
objects = st.dictionaries(keys, values, max_size=5)


def writings(obj: Any) -> list[str]:
    return [
        json.dumps(obj),
        json.dumps(obj, ensure_ascii=False),
        json.dumps(obj, separators=(",", ":")),
        json.dumps(obj, indent=2),
    ]


@settings(max_examples=300, deadline=None)
@given(objects, st.randoms(use_true_random=False))
def test_canonical_stream_is_always_a_prefix_and_ends_whole(obj: dict[str, Any], rnd: random.Random) -> None:
    want = json.dumps(obj, ensure_ascii=False)
    for raw in writings(obj):
        c = CanonicalJson()
        got = ""
        i = 0
        while i < len(raw):
            k = rnd.randint(1, 9)
            got += c.feed(raw[i : i + k])
            assert want.startswith(got), (raw, got)
            i += k
        assert c.done and not c.broken and got == want


def test_canonical_stream_stops_at_what_cannot_be_json() -> None:
    for bad in (
        '{"a": tru }',
        '{"a": 1,}',
        '{"a" 1}',
        '{"a": "x\ny"}',
        '{"a": [1 2]}',
        '{"a": \\q}',
        '{"a": 01x}',
    ):
        c = CanonicalJson()
        c.feed(bad)
        assert c.broken, bad
    c = CanonicalJson()
    assert c.feed('{"a": "\\ud83d') == '{"a": "'  # a high surrogate waits for its low half
    assert c.feed('\\ude00"}') == '😀"}'
    c = CanonicalJson()
    assert c.feed('{"a": "\\ud83d\\') == '{"a": "'
    assert c.feed('n"}') == '\ud83d\\n"}'  # a lone one: written alone, the next escape read again


TOOLS = [
    {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]


def streaming_parser() -> DelimitedToolParser:
    p = get_tool_parser("hermes", tools=TOOLS, known_names_only=True)
    assert isinstance(p, DelimitedToolParser)
    p.stream_args = True
    return p


def run(text: str, cuts: list[int]) -> list[tuple[int, list[ToolEvent]]]:
    """(characters fed so far, events) per piece, then the finish's."""
    p = streaming_parser()
    out = []
    last = 0
    for at in [*cuts, len(text)]:
        out.append((at, p.feed(text[last:at])))
        last = at
    out.append((len(text), p.finish(False)))
    return out


@settings(max_examples=200, deadline=None)
@given(objects, st.lists(st.integers(1, 400), max_size=40), st.booleans())
def test_a_streamed_call_starts_early_and_its_pieces_add_up(
    args: dict[str, Any], cuts: list[int], spaced: bool
) -> None:
    body = json.dumps({"name": "write_file", "arguments": args}, separators=None if spaced else (",", ":"))
    text = f"Writing.\n<tool_call>\n{body}\n</tool_call>"
    steps = run(text, sorted({c for c in cuts if c < len(text)}))
    events = [ev for _, evs in steps for ev in evs]
    whole = get_tool_parser("hermes", tools=TOOLS, known_names_only=True)
    want = [ev for ev in [*whole.feed(text), *whole.finish(False)] if not isinstance(ev, TextDelta)]
    assert isinstance(want[1], ToolCallArgs) and want[1].json == json.dumps(args, ensure_ascii=False)
    starts = [ev for ev in events if isinstance(ev, ToolCallStart)]
    assert [(s.index, s.name, s.partial) for s in starts] == [(0, "write_file", False)]
    assert "".join(ev.json for ev in events if isinstance(ev, ToolCallArgs)) == want[1].json
    assert "".join(ev.text for ev in events if isinstance(ev, TextDelta)) == "Writing.\n"
    # the start came as soon as the head did, before the end marker
    end = text.index("</tool_call>")
    head = text.index('"arguments"') + len('"arguments"')
    started_at = next(at for at, evs in steps if any(isinstance(ev, ToolCallStart) for ev in evs))
    after_head = [c for c in cuts if head + 2 < c < end]  # (pieces ending past the arguments' "{")
    if after_head:
        assert started_at <= min(after_head)


def test_a_long_argument_goes_out_as_it_is_generated() -> None:
    content = "line\n" * 200
    body = json.dumps({"name": "write_file", "arguments": {"path": "a.py", "content": content}})
    text = f"<tool_call>\n{body}\n</tool_call>"
    p = streaming_parser()
    sent = ""
    pieces = 0
    for i in range(0, len(text), 7):
        for ev in p.feed(text[i : i + 7]):
            if isinstance(ev, ToolCallArgs):
                sent += ev.json
                pieces += 1
        if i + 7 < text.index("</tool_call>"):
            assert len(sent) >= i - 80  # nothing held back but the piece under way and the head
    for ev in p.finish(False):
        if isinstance(ev, ToolCallArgs):
            sent += ev.json
    assert json.loads(sent) == {"path": "a.py", "content": content} and pieces > 100


def test_an_unknown_tool_or_another_layout_is_held_to_its_end() -> None:
    for text in (
        '<tool_call>\n{"name": "launch", "arguments": {"x": 1}}\n</tool_call>',
        '<tool_call>\n{"arguments": {"x": 1}, "name": "get_time"}\n</tool_call>',
        '<tool_call>\n{"name": "get_time", "arguments": "{}"}\n</tool_call>',
    ):
        p = streaming_parser()
        early = [ev for i in range(len(text) - 12) for ev in p.feed(text[i])]
        assert not any(isinstance(ev, ToolCallStart) for ev in early), text


# ---- the Messages API: Anthropic's opt-in (fine-grained tool streaming, eager_input_streaming) ----

MSG_TOOLS = [{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object"}}}]
LONG_CALL = (
    '<tool_call>\n{"name": "write_file", "arguments": {"path": "a.py", "content": "'
    + "x = 1\\n" * 40
    + '"}}\n</tool_call>'
)


def messages_stream(live: bool) -> list[bytes]:
    """A Messages stream of ``LONG_CALL`` fed five characters at a time."""
    out = ChatOutput(None, False, "hermes", tuple(MSG_TOOLS), True, partial_calls=True, live_calls=live)
    enc = MessageEvents("msg_1", "m", 10)
    post = out.choice(enc, 0)
    chunks: list[bytes] = []
    for i in range(0, len(LONG_CALL), 5):
        step: list[bytes] = []
        post.stream(LONG_CALL[i : i + 5], None, step)
        chunks.append(b"".join(step))
    end: list[bytes] = []
    post.stream_end(end, False)
    chunks.append(b"".join(end))
    return chunks


def test_messages_stream_tool_input_as_generated_only_when_asked() -> None:
    eager = messages_stream(True)
    held = messages_stream(False)
    ends = LONG_CALL.index("</tool_call>") // 5
    assert sum(c.count(b"input_json_delta") for c in eager[:ends]) > 10  # before the call's end
    assert sum(c.count(b"input_json_delta") for c in held[:ends]) == 0
    assert sum(c.count(b"input_json_delta") for c in held) == 1


def test_the_opt_in_is_the_beta_or_a_tools_eager_input_streaming() -> None:
    tool = {"name": "write_file", "input_schema": {"type": "object"}}
    base: dict[str, Any] = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    assert not parse_messages({**base, "tools": [tool]}).eager_tools
    assert parse_messages({**base, "tools": [tool]}, "fine-grained-tool-streaming-2025-05-14").eager_tools
    assert parse_messages({**base, "tools": [{**tool, "eager_input_streaming": True}]}).eager_tools


# ---- qwen3_coder: <function=NAME><parameter=KEY>VALUE</parameter>... ----

CODER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "content": {"type": "string"},
                    "n": {"type": "integer"},
                    "opts": {"type": "object"},
                },
            },
        },
    }
]
values = st.text(alphabet=st.sampled_from(list('ab <>/\n"\\é中nulNUL=')), max_size=30)


def coder_run(text: str, cuts: list[int], stream: bool) -> list[ToolEvent]:
    p = get_tool_parser("qwen3_coder", tools=CODER_TOOLS, known_names_only=True)
    assert isinstance(p, DelimitedToolParser)
    p.stream_args = stream
    out: list[ToolEvent] = []
    last = 0
    for at in [*cuts, len(text)]:
        out += p.feed(text[last:at])
        last = at
    return out + p.finish(False)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["path", "content", "other"]), values), max_size=3, unique_by=lambda p: p[0]
    ),
    st.integers(0, 7),
    st.booleans(),
    st.lists(st.integers(1, 300), max_size=30),
)
def test_a_streamed_qwen3_coder_call_adds_up_to_the_whole_one(
    params: list[tuple[str, str]], n: int, newlines: bool, cuts: list[int]
) -> None:
    """Whatever the values hold (markers' pieces, ``null`` spellings, newlines, quotes) and however the
    text is cut, the pieces are a prefix of the whole call's arguments at every step and add up to them
    (a value whose end only the whole parse can tell stops the stream: the end sends the rest). A key
    given twice is the one case they part (documented)."""
    nl = "\n" if newlines else ""
    body = "".join(f"<parameter={k}>{nl}{v}{nl}</parameter>\n" for k, v in params)
    body += f"<parameter=n>{n}</parameter>\n"
    text = f"Writing.\n<tool_call>\n<function=write_file>\n{body}</function>\n</tool_call>"
    whole = [ev for ev in coder_run(text, [], False) if not isinstance(ev, TextDelta)]
    if not whole:  # (a body the whole parse refuses: text either way)
        return
    want = "".join(ev.json for ev in whole if isinstance(ev, ToolCallArgs))
    got = ""
    for ev in coder_run(text, sorted({c for c in cuts if c < len(text)}), True):
        if isinstance(ev, ToolCallArgs):
            got += ev.json
            assert want.startswith(got), (text, got, want)
    assert got == want


def test_a_long_qwen3_coder_value_goes_out_as_it_is_generated() -> None:
    content = "def f():\n    return '<b>'\n" * 30
    call = f"<function=write_file>\n<parameter=content>\n{content}</parameter>\n</function>"
    text = f"<tool_call>\n{call}\n</tool_call>"
    p = get_tool_parser("qwen3_coder", tools=CODER_TOOLS, known_names_only=True)
    assert isinstance(p, DelimitedToolParser)
    p.stream_args = True
    pieces = [
        ev for i in range(0, len(text), 6) for ev in p.feed(text[i : i + 6]) if isinstance(ev, ToolCallArgs)
    ]
    pieces += [ev for ev in p.finish(False) if isinstance(ev, ToolCallArgs)]
    assert len(pieces) > 50 and json.loads("".join(ev.json for ev in pieces)) == {
        "content": content.rstrip("\n") + "\n"[:0] or content[:-1]
    }
