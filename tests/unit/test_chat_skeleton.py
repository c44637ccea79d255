"""Skeleton renders equal plain renders: every golden conversation shape, contents generated."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shepherd.node.chat_skeleton import SkeletonCache, Traced, _Recorder, parse_skeleton
from shepherd.node.chat_template import ChatTemplate
from tests.unit.test_chat_template_golden import CASES, template

# contents that hit what templates test and transform: think tags, tool-response wrappers, surrounding
# whitespace, markup and JSON characters, marker-like private-use characters
_ATOMS = st.sampled_from(
    [
        "<think>",
        "</think>",
        "<tool_response>",
        "</tool_response>",
        "\n",
        " ",
        "\t",
        '"',
        "\\",
        "<",
        "&",
        "{",
        "}",
        "é",
        "日本",
        "\ue000",
        "SHPRB",
        "[INST]",
        "<|im_end|>",
        "hello",
        "World",
    ]
)
CONTENT = st.one_of(st.text(max_size=30), st.lists(_ATOMS, max_size=8).map("".join))


def _fresh(tpl: ChatTemplate, cache: bool) -> ChatTemplate:
    return ChatTemplate(
        tpl.source, name=tpl.name, special_tokens=tpl.special_tokens, cache_size=512 if cache else 0
    )


def _render(tpl: ChatTemplate, c: dict[str, Any], messages: list[dict[str, Any]]) -> str:
    return tpl.render_recorded(
        messages,
        tools=c["tools"],
        add_generation_prompt=c["add_generation_prompt"],
        continue_final_message=c["continue_final_message"],
        template_kwargs=c["kwargs"],
    )[0]


_SKELETONS: dict[str, ChatTemplate] = {}


def _skeleton_template(c: dict[str, Any]) -> ChatTemplate:
    tpl = _SKELETONS.get(c["id"])
    if tpl is None:
        tpl = _SKELETONS[c["id"]] = _fresh(template(c["family"]), cache=True)
        _render(tpl, c, c["messages"])  # builds the skeleton from the golden contents
    return tpl


@pytest.mark.parametrize("c", CASES, ids=[c["id"] for c in CASES])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_skeleton_render_equals_plain_render(c: dict[str, Any], data: st.DataObject) -> None:
    if "Current date" in template(c["family"]).source or "strftime_now" in template(c["family"]).source:
        pytest.skip("templates that read the clock are never skeletonized")
    tpl = _skeleton_template(c)
    plain = _fresh(template(c["family"]), cache=False)
    messages = copy.deepcopy(c["messages"])
    for m in messages:
        if isinstance(m.get("content"), str):
            m["content"] = data.draw(CONTENT)
    try:
        expected = _render(plain, c, messages)
    except Exception as e:  # the template refuses this content: so must the skeleton path
        with pytest.raises(type(e)):
            _render(tpl, c, messages)
        return
    assert _render(tpl, c, messages) == expected


def test_common_shapes_are_skeletonized_and_hit() -> None:
    """The hot path: system + user on qwen3 and llama 3.1 renders from the skeleton."""
    for cid in ("qwen3-basic", "llama31-basic", "qwen3-tools", "mistral-basic", "deepseek31-basic"):
        c = next(x for x in CASES if x["id"] == cid)
        tpl = _fresh(template(c["family"]), cache=True)
        _render(tpl, c, c["messages"])
        messages = copy.deepcopy(c["messages"])
        messages[-1]["content"] = "A different question, same shape?"
        plain = _fresh(template(c["family"]), cache=False)
        assert _render(tpl, c, messages) == _render(plain, c, messages)
        assert tpl.skeletons is not None
        assert tpl.skeletons.hits == 1, (cid, tpl.skeletons)


def test_guards_follow_the_content() -> None:
    """qwen3 treats a user turn wrapped in <tool_response> differently: a guard sends it to a full
    render instead of reusing the skeleton made from plain text."""
    c = next(x for x in CASES if x["id"] == "qwen3-basic")
    tpl = _fresh(template(c["family"]), cache=True)
    _render(tpl, c, c["messages"])
    messages = copy.deepcopy(c["messages"])
    messages[-1]["content"] = "<tool_response>x</tool_response>"
    plain = _fresh(template(c["family"]), cache=False)
    assert _render(tpl, c, messages) == _render(plain, c, messages)
    assert tpl.skeletons is not None and tpl.skeletons.guard_misses >= 1


@pytest.mark.parametrize(
    ("source", "skeletonized"),
    [
        ("{{ messages[0].content | trim }}", True),
        ("{{ messages[0].content | upper }}", True),
        ("{{ messages[0].content.lstrip('\\n') | replace('a', 'b') }}", True),
        ("{% if messages[0].content.strip() == '' %}-{% else %}{{ messages[0].content }}{% endif %}", True),
        ("{{ messages[0].content | tojson }}", False),
        ("{{ messages[0].content[:3] }}", False),
        ("{{ (messages[0].content ~ '!') | replace('a', 'b') }}", False),
        ("{% for ch in messages[0].content %}{{ ch }}{% endfor %}", False),
        ("{{ messages[0].content.split('b') | join('-') }}", False),
    ],
)
def test_transformations_are_replayed_or_refused(source: str, skeletonized: bool) -> None:
    """Traceable string methods are replayed from the skeleton; what cannot be traced is refused.
    Either way the output equals the plain render."""
    tpl = ChatTemplate(source)
    plain = ChatTemplate(source, cache_size=0)
    for text in ("  abc  ", 'x"y\\z', "\nbanana", "   ", "xyz"):
        msgs = [{"role": "user", "content": text}]
        assert tpl.render_recorded(msgs)[0] == plain.render_recorded(msgs)[0]
    assert tpl.skeletons is not None
    assert (tpl.skeletons.hits >= 2) if skeletonized else (tpl.skeletons.hits == 0), tpl.skeletons


def test_traced_strings_compute_on_the_real_content() -> None:
    rec = _Recorder()
    t = rec.traced("real text", (0, ()))
    assert t.startswith("real") and "text" in t and len(t) == 9 and bool(t)
    assert not rec.tainted and len(rec.guards) == 4
    up = t.upper()
    assert up == "REAL TEXT" and not rec.tainted and rec.refs[-1] == (0, (("upper", ()),))
    joined = "<" + t + ">"
    assert isinstance(joined, Traced) and joined._real == "<real text>"
    assert joined.strip() == "<real text>" and rec.tainted


def test_parse_skeleton_refuses_transformed_markers() -> None:
    assert parse_skeleton("plain") == ["plain"]
    assert parse_skeleton('\\ue000SHPRB0<&\\"') is None
    assert parse_skeleton("a shprb b") is None


def test_cache_is_bounded() -> None:
    cache = SkeletonCache(size=4)
    for n in range(10):
        chat = [{"role": "user", "content": "x"} for _ in range(n + 1)]
        cache.render(bytes([n]), chat, list(range(n + 1)), lambda c: "".join(m["content"] for m in c))
    assert len(cache) == 4
