"""Reasoning parsers: realistic outputs per family, and chunking invariance (every split of an output
gives what one feed gives)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.parsers import get_reasoning_parser, run_reasoning
from shepherd.parsers.registry import REASONING_FAMILIES

# (family, parser kwargs, model output, expected reasoning, expected content)
CASES: list[tuple[str, dict[str, bool], str, str, str]] = [
    # DeepSeek-R1-0528 writes <think>; R1 / R1-distill get it from the prompt and only close it
    (
        "deepseek_r1",
        {},
        "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nThe answer is **4**.",
        "The user wants 2+2. That is 4.\n",
        "The answer is **4**.",
    ),
    ("deepseek_r1", {}, "Okay, 2+2=4.\n</think>\n\n4", "Okay, 2+2=4.\n", "4"),
    ("deepseek_r1", {}, "Still thinking when max_tokens hit", "Still thinking when max_tokens hit", ""),
    (
        "qwen3",
        {},
        "<think>\nGreeting.\n</think>\n\nHello! How can I help?",
        "Greeting.\n",
        "Hello! How can I help?",
    ),
    ("qwen3", {"thinking_enabled": False}, "Hello! How can I help?", "", "Hello! How can I help?"),
    ("qwen3", {}, "Plain answer, no <think> block.", "", "Plain answer, no <think> block."),
    # Qwen3 sometimes opens a tool call without closing the think block
    (
        "qwen3",
        {},
        '<think>\nNeed weather.\n<tool_call>\n{"name": "w", "arguments": {}}\n</tool_call>',
        "Need weather.\n",
        '<tool_call>\n{"name": "w", "arguments": {}}\n</tool_call>',
    ),
    # ... and then may still close it: the end marker is no content
    (
        "qwen3",
        {},
        '<think>\nI might call <tool_call>\n{"name": "w", "arguments": {}}\n</tool_call>\n</think>\n\nNo.',
        "I might call ",
        '<tool_call>\n{"name": "w", "arguments": {}}\n</tool_call>\n\n\nNo.',
    ),
    # Cohere's text block opens the answer whether or not tools are parsed; its action block only with them
    (
        "cohere",
        {"tool_calls": False},
        "<|START_THINKING|>plan<|START_TEXT|>Answer<|END_TEXT|>",
        "plan",
        "Answer",
    ),
    (
        "cohere",
        {"tool_calls": False},
        "<|START_THINKING|>plan<|START_ACTION|>[]<|END_ACTION|>",
        "plan<|START_ACTION|>[]<|END_ACTION|>",
        "",
    ),
    # without tool parsing, a tool-call opener inside the block is reasoning (vLLM's think parsers)
    (
        "qwen3",
        {"tool_calls": False},
        '<think>\nI might call <tool_call>\n{"name": "w", "arguments": {}}\n</tool_call>\n</think>\n\nNo.',
        'I might call <tool_call>\n{"name": "w", "arguments": {}}\n</tool_call>\n',
        "No.",
    ),
    ("qwen3", {"prompt_opened_think": True}, "Thinking.\n</think>\n\nDone.", "Thinking.\n", "Done."),
    ("qwen3_thinking", {}, "Let me see.\n</think>\n\nParis.", "Let me see.\n", "Paris."),
    ("qwen3_thinking", {}, "<think>\nLet me see.\n</think>\n\nParis.", "Let me see.\n", "Paris."),
    ("kimi", {}, "◁think▷The user greets me.◁/think▷Hi there!", "The user greets me.", "Hi there!"),
    ("kimi", {}, "Hi there!", "", "Hi there!"),
    (
        "kimi_k2",
        {},
        "<think>use tool</think><|tool_calls_section_begin|>",
        "use tool",
        "<|tool_calls_section_begin|>",
    ),
    ("glm45", {}, "<think>Simple.</think>\nThe capital is Paris.", "Simple.", "The capital is Paris."),
    ("glm45", {"prompt_opened_think": True}, "Simple.</think>Paris.", "Simple.", "Paris."),
    (
        "gpt_oss",
        {},
        "<|channel|>analysis<|message|>User asks capital of France. Answer: Paris.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>The capital of France is Paris.<|return|>",
        "User asks capital of France. Answer: Paris.",
        "The capital of France is Paris.",
    ),
    (
        "gpt_oss",
        {},
        "<|channel|>analysis<|message|>Need weather; call tool.<|end|>"
        "<|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"location":"Tokyo"}<|call|>',
        "Need weather; call tool.",
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"location":"Tokyo"}<|call|>',
    ),
    ("gpt_oss", {}, "no harmony markers at all", "", "no harmony markers at all"),
    ("gpt_oss", {}, "<|channel|>analysis<|message|>cut off here", "cut off here", ""),
    ("deepseek_v3", {"prompt_opened_think": True}, "Think.</think>Answer.", "Think.", "Answer."),
    ("deepseek_v3", {"thinking_enabled": False}, "Answer.", "", "Answer."),
    ("minimax", {}, "Reasoning here.\n</think>\n\nAnswer here.", "Reasoning here.\n", "Answer here."),
    ("step3", {}, "Hmm.</think>Ok.", "Hmm.", "Ok."),
    (
        "cohere",
        {"prompt_opened_think": True},
        "The user says hi.<|END_THINKING|><|START_TEXT|>Hello there!<|END_TEXT|>",
        "The user says hi.",
        "Hello there!",
    ),
    (
        "cohere",
        {},
        "<|START_THINKING|>Call a tool.<|END_THINKING|><|START_ACTION|>[...]<|END_ACTION|>",
        "Call a tool.",
        "<|START_ACTION|>[...]<|END_ACTION|>",
    ),
    ("cohere", {}, "<|START_TEXT|>Direct answer.<|END_TEXT|>", "", "Direct answer."),
    ("nemotron", {"prompt_opened_think": True}, "Plan.\n</think>\nResult.", "Plan.\n", "Result."),
    ("nemotron", {}, "<think></think>Result.", "", "Result."),
]

IDS = [f"{c[0]}-{i}" for i, c in enumerate(CASES)]


@pytest.mark.parametrize(("family", "kwargs", "text", "reasoning", "content"), CASES, ids=IDS)
def test_one_feed(family: str, kwargs: dict[str, bool], text: str, reasoning: str, content: str) -> None:
    assert run_reasoning(get_reasoning_parser(family, **kwargs), [text]) == (reasoning, content)


@pytest.mark.parametrize(("family", "kwargs", "text", "reasoning", "content"), CASES, ids=IDS)
def test_every_single_split_and_char_by_char(
    family: str, kwargs: dict[str, bool], text: str, reasoning: str, content: str
) -> None:
    expected = (reasoning, content)
    for cut in range(len(text) + 1):
        got = run_reasoning(get_reasoning_parser(family, **kwargs), [text[:cut], text[cut:]])
        assert got == expected, cut
    assert run_reasoning(get_reasoning_parser(family, **kwargs), list(text)) == expected


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(CASES), data=st.data())
def test_any_chunking_matches_one_feed(
    case: tuple[str, dict[str, bool], str, str, str], data: st.DataObject
) -> None:
    family, kwargs, text, reasoning, content = case
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=12)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert run_reasoning(get_reasoning_parser(family, **kwargs), chunks) == (reasoning, content)


_ALPHABET = st.sampled_from(
    ["<think>", "</think>", "<", "/", "think", ">", "a", " ", "\n", "<tool_call>", "x"]
)


@settings(max_examples=200, deadline=None)
@given(
    family=st.sampled_from(
        ["deepseek_r1", "qwen3", "qwen3_thinking", "glm45", "nemotron", "cohere", "gpt_oss"]
    ),
    opened=st.booleans(),
    tools=st.booleans(),
    pieces=st.lists(_ALPHABET, max_size=25),
    data=st.data(),
)
def test_arbitrary_text_is_chunking_invariant_and_loses_nothing(
    family: str, opened: bool, tools: bool, pieces: list[str], data: st.DataObject
) -> None:
    text = "".join(pieces)
    kw = {"prompt_opened_think": opened, "tool_calls": tools}
    whole = run_reasoning(get_reasoning_parser(family, **kw), [text])
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=10)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert run_reasoning(get_reasoning_parser(family, **kw), chunks) == whole
    if family != "gpt_oss":  # markers and some whitespace are removed, nothing else
        r, c = whole
        assert _markers_deleted("".join(text.split()), "".join((r + c).split())), (text, whole)


def _markers_deleted(src: str, out: str) -> bool:
    """Whether ``out`` is ``src`` with some whole ``<think>`` / ``</think>`` occurrences deleted (which
    ones the parser took is its own business: a ``str.replace`` over the joined output could find one
    spanning reasoning and content, as in ``<think</think>>``: reasoning ``<think``, content ``>``)."""
    seen: set[tuple[int, int]] = set()
    todo = [(0, 0)]
    while todo:  # bounded: each (i, j) once
        i, j = todo.pop()
        if (i, j) in seen:
            continue
        seen.add((i, j))
        if i == len(src) and j == len(out):
            return True
        todo.extend((i + len(m), j) for m in ("<think>", "</think>") if src.startswith(m, i))
        if i < len(src) and j < len(out) and src[i] == out[j]:
            todo.append((i + 1, j + 1))
    return False


_HARMONY = st.sampled_from(
    [
        "<|channel|>",
        "analysis",
        "final",
        "commentary",
        "<|message|>",
        "<|end|>",
        "<|start|>",
        "assistant",
        " to=functions.f",
        "<|constrain|>json",
        "<|call|>",
        "<|return|>",
        "x y",
        "<|",
        "{}",
    ]
)


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(_HARMONY, max_size=25), data=st.data())
def test_harmony_arbitrary_text_is_chunking_invariant(pieces: list[str], data: st.DataObject) -> None:
    text = "".join(pieces)
    whole = run_reasoning(get_reasoning_parser("gpt_oss"), [text])
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=10)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert run_reasoning(get_reasoning_parser("gpt_oss"), chunks) == whole
    assert run_reasoning(get_reasoning_parser("gpt_oss"), list(text)) == whole


def test_harmony_recipient_before_channel_is_a_tool_call() -> None:
    text = (
        "<|channel|>analysis<|message|>call it<|end|>"
        '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"q": 1}<|call|>'
    )
    reasoning, content = run_reasoning(get_reasoning_parser("gpt_oss"), [text])
    assert reasoning == "call it"
    assert (
        content
        == '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"q": 1}<|call|>'
    )


_HARMONY_CALL = (
    "<|channel|>analysis<|message|>call it<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.lookup <|constrain|>json<|message|>{"q": 1}<|call|>'
)
_HARMONY_BROWSER = (
    "<|channel|>analysis<|message|>search it<|end|>"
    '<|start|>assistant<|channel|>analysis to=browser.search code<|message|>{"query": "x"}<|call|>'
    "<|start|>assistant<|channel|>final<|message|>Done.<|return|>"
)


@pytest.mark.parametrize("split", ["whole", "chars"])
def test_harmony_call_not_parsed_is_no_content(split: str) -> None:
    """vLLM's ``parse_chat_output`` (harmony_utils) answers a message with a recipient as neither reasoning
    nor content: with no tool parser (``tool_choice: none``, no tools) a call's markup must not reach the
    client, nor a call to a built-in tool (``browser.search``: no function call) with one."""

    def run(text: str, tool_calls: bool) -> tuple[str, str]:
        deltas = [text] if split == "whole" else list(text)
        return run_reasoning(get_reasoning_parser("gpt_oss", tool_calls=tool_calls), deltas)

    assert run(_HARMONY_CALL, tool_calls=False) == ("call it", "")
    assert run(_HARMONY_BROWSER, tool_calls=True) == ("search it", "Done.")
    assert run(_HARMONY_BROWSER, tool_calls=False) == ("search it", "Done.")
    # cut off inside such a message, or inside its header
    assert run(_HARMONY_CALL[:-12], tool_calls=False) == ("call it", "")
    assert run(_HARMONY_BROWSER[: _HARMONY_BROWSER.index('"x"')], tool_calls=True) == ("search it", "")
    cut_header = (
        "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary to=functions.lo"
    )
    assert run(cut_header, tool_calls=False) == ("a", "")
    # a function call with tools parsed still goes to the tool parser, markers included
    assert run(_HARMONY_CALL, tool_calls=True) == (
        "call it",
        _HARMONY_CALL[_HARMONY_CALL.index("<|start|>") :],
    )


_QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("split", ["whole", "chars"])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_thinking", "nemotron"])
def test_tool_call_opener_mentioned_in_reasoning_is_reasoning(family: str, split: str) -> None:
    """A ``<tool_call>`` the model only mentions while thinking (not followed by a call's body) does not
    end the think block: vLLM's Qwen3ReasoningParser ends it there only when ``<function=`` follows. It
    ended the block, so the rest of the thinking became content and swallowed the real call after
    ``</think>`` (the hermes parser read it all as one malformed call: text)."""

    def run(text: str) -> tuple[str, str]:
        deltas = [text] if split == "whole" else list(text)
        return run_reasoning(get_reasoning_parser(family, prompt_opened_think=True), deltas)

    mention = "I should emit a <tool_call> block with the JSON.\n"
    assert run(f"{mention}</think>\n\n{_QWEN_CALL}") == (mention, _QWEN_CALL)
    # the opener of a real call (hermes JSON, qwen3_coder function) still ends the block unclosed
    assert run(f"{mention}{_QWEN_CALL}</think>") == (mention, _QWEN_CALL)
    coder = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
    assert run(f"x\n{coder}") == ("x\n", coder)
    # cut off right after the opener, or a run of white space after it: reasoning
    assert run("x <tool_call>\n ") == ("x <tool_call>\n ", "")
    spaced = "x <tool_call>" + " " * 100 + "{}</think>done"
    assert run(spaced) == (spaced[: spaced.index("</think>")], "done")


def test_partial_marker_is_held_then_released() -> None:
    p = get_reasoning_parser("qwen3")
    assert p.feed("<thi") == ("", "")
    assert p.feed("nk>ab") == ("ab", "")
    assert p.feed("c</thi") == ("c", "")
    assert p.feed("nk>\n\nDone") == ("", "Done")
    q = get_reasoning_parser("deepseek_r1")
    assert q.feed("x </thin") == ("x ", "")
    assert q.finish() == ("</thin", "")  # cut off: the held text is reasoning after all


def test_fresh_parser_per_request_shares_nothing() -> None:
    a = get_reasoning_parser("qwen3")
    b = get_reasoning_parser("qwen3")
    assert a is not b
    assert a.feed("<think>secret") == ("secret", "")
    assert b.feed("Hello") == ("", "Hello")
    assert a.feed(" more") == (" more", "")


def test_unknown_family_raises() -> None:
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        get_reasoning_parser("no-such-family")


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(sorted(REASONING_FAMILIES)),
    st.lists(st.sampled_from(["<think>", "</think>", "<", "/", "think>", " ", "\n", "a", "b."]), max_size=12),
    st.lists(st.text(alphabet="<>/thinkab \n", max_size=6), max_size=6),
    st.booleans(),
    st.booleans(),
)
def test_passthrough_means_feed_returns_its_text_as_content(
    family: str, head: list[str], tail: list[str], thinking: bool, opened: bool
) -> None:
    """Once a parser says ``passthrough`` (a caller then skips ``feed``), every later ``feed`` gives
    its text back as content and ``finish`` nothing: skipping them changes nothing."""
    p = get_reasoning_parser(family, thinking_enabled=thinking, prompt_opened_think=opened)
    for piece in head:
        p.feed(piece)
    if not p.passthrough:
        return
    for piece in tail:
        assert p.feed(piece) == ("", piece)
        assert p.passthrough
    assert p.finish() == ("", "")


def test_a_think_tag_parser_passes_through_after_its_block() -> None:
    p = get_reasoning_parser("qwen3")
    seen = [p.passthrough]
    assert p.feed("<think>\nhm</think>\n\n") == ("hm", "")
    seen.append(p.passthrough)  # the white space after the block is still being dropped
    assert p.feed("Answer") == ("", "Answer")
    seen.append(p.passthrough)
    assert seen == [False, False, True]
    assert get_reasoning_parser("qwen3", thinking_enabled=False).passthrough
