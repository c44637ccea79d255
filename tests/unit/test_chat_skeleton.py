"""Skeleton renders equal plain renders: every golden conversation shape, contents generated."""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shepherd.tokens.chat_env import make_environment
from shepherd.tokens.chat_skeleton import SkeletonCache, Traced, _Recorder, parse_skeleton
from shepherd.tokens.chat_template import ChatTemplate, _plain_shape
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


def test_a_ref_behind_a_guard_that_fails_on_other_contents_is_a_full_render() -> None:
    """Cohere2's ``message.content and message.content[0].type == "thinking"``: the skeleton made from
    a text holds ``content[0]``, which an empty content of the same shape cannot give (IndexError, a
    500); the guard on the text's truth decides, in a full render."""
    source = (
        "{% for m in messages %}{% if m.content and m.content[0] == '#' %}H:{% endif %}"
        "{{ m.role }}={{ m.content }};{% endfor %}"
    )
    tpl = ChatTemplate(source)
    plain = ChatTemplate(source, cache_size=0)
    for text in ("hello", "", "#tag", "", "again"):
        msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": text}]
        assert tpl.render_recorded(msgs)[0] == plain.render_recorded(msgs)[0]
        assert tpl.render_from_skeleton(msgs) in (None, plain.render_recorded(msgs)[0])
    assert tpl.skeletons is not None and tpl.skeletons.hits >= 1, tpl.skeletons


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


# ---- plain conversations: the caller's messages straight to the skeleton -----------------------------

_PLAIN_FAMILIES = ("qwen3", "llama-3.1", "mistral-nemo", "deepseek-v3.1")


@pytest.mark.parametrize("family", _PLAIN_FAMILIES)
@settings(max_examples=15, deadline=None)
@given(
    contents=st.lists(CONTENT, min_size=1, max_size=5),
    kwargs=st.sampled_from([None, {}, {"enable_thinking": False}, {"enable_thinking": 0}]),
    generation=st.booleans(),
)
def test_plain_conversations_render_as_prepared_ones(
    family: str, contents: list[str], kwargs: dict[str, Any] | None, generation: bool
) -> None:
    """Messages that are only a role and a text skip preparation and the JSON shape key; the render
    is the one of a template that prepares every message (a mutable sandbox takes the general path)."""
    base = template(family)
    fast = _fresh_plain(family)
    if fast.skeletons is not None:  # this example's skeleton is built from its own contents (an earlier
        fast.skeletons.clear()  # example's skeleton of the same shape may have guards these contents fail)
    general = ChatTemplate(
        base.source, special_tokens=base.special_tokens, env=make_environment(immutable=False)
    )
    mistral = family == "mistral-nemo"
    roles = ["user", "assistant"] if mistral else ["system", "user", "assistant", "user", "assistant"]
    messages = [{"role": roles[i % len(roles)], "content": text} for i, text in enumerate(contents)]
    if mistral and messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": "last"})
    before = copy.deepcopy(messages)

    def render(t: ChatTemplate) -> str:
        return t.render_recorded(messages, add_generation_prompt=generation, template_kwargs=kwargs)[0]

    try:
        expected = render(general)
    except Exception as e:
        with pytest.raises(type(e)):
            render(fast)
        return
    assert render(fast) == expected  # builds the skeleton (or refuses it) ...
    assert render(fast) == expected  # ... and fills it
    # a shape with a usable skeleton is filled (its guards hold: it was built from these contents);
    # a refused or unplain one is not
    plain = _plain_shape(messages, generation, kwargs)
    held = plain is not None and fast.skeletons is not None and fast.skeletons.export(plain[0]) is not None
    assert fast.render_from_skeleton(messages, None, generation, kwargs) == (expected if held else None)
    assert messages == before


_PLAIN_TEMPLATES: dict[str, ChatTemplate] = {}


def _fresh_plain(family: str) -> ChatTemplate:
    if family not in _PLAIN_TEMPLATES:
        _PLAIN_TEMPLATES[family] = _fresh(template(family), cache=True)
    return _PLAIN_TEMPLATES[family]


def test_render_from_skeleton_only_fills_shapes_it_has_seen() -> None:
    tpl = _fresh(template("qwen3"), cache=True)
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert tpl.render_from_skeleton(chat) is None  # nothing rendered yet: no work done
    first = tpl.render_recorded(chat)[0]
    other = [{"role": "system", "content": "S2"}, {"role": "user", "content": "U2 \ue000SHPRB0"}]
    filled = tpl.render_from_skeleton(other)
    assert filled == _fresh(template("qwen3"), cache=False).render_recorded(other)[0] != first
    assert tpl.render_from_skeleton(chat, tools=[{"type": "function"}]) is None  # not a plain shape
    assert tpl.render_from_skeleton([{"content": "U", "role": "user"}]) is None  # key order differs
    assert tpl.render_from_skeleton([{"role": "user", "content": "U", "name": "x"}]) is None
    assert tpl.render_from_skeleton(chat, template_kwargs={"enable_thinking": False}) is None  # other key
    # a guard answering differently on the new content: no fill
    assert tpl.render_from_skeleton([chat[0], {"role": "user", "content": "<tool_response>x"}]) is None


def test_kwargs_of_equal_value_but_other_type_are_other_shapes() -> None:
    t = ChatTemplate("{{ messages[0].content }}|{{ flag }}")
    chat = [{"role": "user", "content": "x"}]
    assert t.render_recorded(chat, template_kwargs={"flag": True})[0] == "x|True"
    assert t.render_recorded(chat, template_kwargs={"flag": 1})[0] == "x|1"
    assert t.render_recorded([{"role": "user", "content": "y"}], template_kwargs={"flag": 1})[0] == "y|1"


@pytest.mark.parametrize("family", _PLAIN_FAMILIES)
def test_a_skeleton_survives_the_trip_from_a_pool_worker(family: str) -> None:
    """What a worker sends back (JSON: tuples become arrays) fills like the skeleton it came from."""
    worker, parent = _fresh(template(family), cache=True), _fresh(template(family), cache=True)
    first = [{"role": "user", "content": " first? "}, {"role": "assistant", "content": "yes"}]
    first.append({"role": "user", "content": "then"})
    payload = worker.serialize(first, None, True, False, None)
    assert payload is not None
    text, _, skeleton = worker.render_serialized_for_parent(payload)
    assert skeleton is not None and text == worker.render_uncached(first)
    assert parent.adopt_skeleton(first, True, None, orjson.loads(orjson.dumps(skeleton)))
    assert not parent.adopt_skeleton(first, True, None, skeleton)  # one is held already
    other = [{**m, "content": m["content"] + " \\n more"} for m in first]
    assert parent.render_from_skeleton(other) == _fresh(template(family), cache=False).render_uncached(other)
    assert not parent.adopt_skeleton(first, False, None, ["not", "a skeleton"])
