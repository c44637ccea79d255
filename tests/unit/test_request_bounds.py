"""Per-request bounds and byte-bounded caches: what one hostile request may leave in the node.

- every field that caches or per-token work scale with is bounded (400 naming the parameter);
- caches keyed by request content are bounded in bytes (hypothesis: whatever the sequence of puts);
- JSON-schema meta-validation is deferred by ``parse_chat_deferred`` and runs off the event loop with
  a deadline (``check_chat_schemas``);
- the stop matcher's hold-back is exact on repetitive text with long stop strings.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.node.openai import requests as rq
from shepherd.node.openai import structured
from shepherd.node.openai.requests import (
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPLATE_KWARGS_BYTES,
    MAX_TOOLS,
    SAMPLING_MEMO_BYTES,
    check_chat_schemas,
    parse_chat,
    parse_chat_deferred,
    parse_completion,
    sampling_memo_bytes,
)
from shepherd.node.openai.structured import SCHEMA_MAX_BYTES, SCHEMA_MAX_NODES, check_schemas
from shepherd.node.output.stop import StopMatcher
from shepherd.policies.base import RouteRequest
from shepherd.policies.manual import MAX_KEY_CHARS, Manual
from shepherd.proto.openai_errors import ApiError
from shepherd.tokens.cache import ByteLRU
from shepherd.tokens.chat_skeleton import SkeletonCache

MSGS = [{"role": "user", "content": "hi"}]


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": MSGS, **kw}


def refused(d: dict[str, Any], param: str, *, deferred: bool = True) -> ApiError:
    with pytest.raises(ApiError) as e:
        (parse_chat_deferred if deferred else parse_chat)(d)
    assert e.value.status == 400, e.value
    assert e.value.param == param, (e.value.param, str(e.value))
    return e.value


def tool(name: str, params: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": params}}


def wide_schema(n: int) -> dict[str, Any]:
    """An object schema of ``n`` string properties: ~3n + 3 JSON values."""
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


# ---- field bounds ---------------------------------------------------------------------------------------


def test_stop_strings_are_bounded_in_length() -> None:
    ok = parse_chat_deferred(chat(stop=["x" * MAX_STOP_CHARS, "y"]))
    assert ok.sampling.stop == ("x" * MAX_STOP_CHARS, "y")
    refused(chat(stop="x" * (MAX_STOP_CHARS + 1)), "stop")
    refused(chat(stop=["a", "x" * (MAX_STOP_CHARS + 1)]), "stop")
    with pytest.raises(ApiError) as e:
        parse_completion({"model": "m", "prompt": "p", "stop": "z" * (4 << 20)})
    assert e.value.param == "stop"


def test_an_empty_stop_string_is_refused_as_vllm_refuses_it() -> None:
    """An empty stop string matches anywhere: vLLM's SamplingParams refuses it ("stop cannot contain an
    empty string."); it was dropped silently."""
    refused(chat(stop=""), "stop")
    refused(chat(stop=["done", ""]), "stop")
    with pytest.raises(ApiError) as e:
        parse_completion({"model": "m", "prompt": "p", "stop": [""]})
    assert e.value.param == "stop" and "empty string" in e.value.message
    assert parse_chat_deferred(chat(stop="done")).sampling.stop == ("done",)


def test_an_empty_prompt_string_is_refused_as_vllm_refuses_it() -> None:
    """vLLM's CompletionRequest: ``prompt: ""`` is a 400 whatever the model (a BOS model took it and
    generated from BOS alone; another answered 'prompt 0 is empty')."""
    with pytest.raises(ApiError) as e:
        parse_completion({"model": "m", "prompt": ""})
    assert e.value.param == "prompt" and "non-empty" in e.value.message
    assert parse_completion({"model": "m", "prompt": "x"}).prompts == ["x"]


def test_stop_token_ids_and_logit_bias_are_bounded_in_count() -> None:
    parse_chat_deferred(chat(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS))))
    refused(chat(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids")
    parse_chat_deferred(chat(logit_bias={str(i): 1 for i in range(MAX_LOGIT_BIAS)}))
    refused(chat(logit_bias={str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}), "logit_bias")
    refused(chat(logit_bias={"1" * 5000: 1}), "logit_bias")  # no int() of a huge digit string


def test_template_kwargs_and_tools_are_bounded_in_bytes() -> None:
    parse_chat_deferred(chat(chat_template_kwargs={"enable_thinking": False, "note": "x" * 1000}))
    refused(chat(chat_template_kwargs={"note": "x" * MAX_TEMPLATE_KWARGS_BYTES}), "chat_template_kwargs")
    many = [tool(f"f{i}", {"type": "object"}) for i in range(MAX_TOOLS + 1)]
    refused(chat(tools=many), "tools")
    wordy = [{"type": "function", "function": {"name": "f", "description": "d" * (2 << 20)}}]
    refused(chat(tools=wordy), "tools")


def test_schemas_are_bounded_in_bytes_and_nodes_before_any_validation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def boom(text: bytes) -> str | None:
        raise AssertionError("meta-validation ran")

    monkeypatch.setattr(structured, "_meta_error", boom)
    big = {"type": "object", "description": "d" * SCHEMA_MAX_BYTES}
    e = refused(
        chat(response_format={"type": "json_schema", "json_schema": {"schema": big}}),
        "response_format.json_schema.schema",
    )
    assert e.code == "schema_too_large"
    # nodes: many small values in few bytes
    dense = {"enum": [0] * (SCHEMA_MAX_NODES + 10)}
    refused(chat(tools=[tool("f", dense)]), "tools.0.function.parameters")
    # the bound is over all the request's schemas together
    half = wide_schema(SCHEMA_MAX_NODES // 5)
    refused(chat(tools=[tool("f", half), tool("g", half), tool("h", half)]), "tools.2.function.parameters")
    # within bounds: deferred, nothing validated yet
    req = parse_chat_deferred(chat(tools=[tool("f", wide_schema(50))]))
    assert len(req.schemas) == 1 and req.schemas[0].param == "tools.0.function.parameters"


def test_deferred_parse_leaves_validation_to_check_chat_schemas() -> None:
    bad_schema = {"type": "not-a-type"}
    d = chat(tools=[tool("f", {"type": "object"}), tool("g", bad_schema)])
    req = parse_chat_deferred(d)  # no error yet
    assert [p.param for p in req.schemas] == ["tools.0.function.parameters", "tools.1.function.parameters"]
    with pytest.raises(ApiError) as e:
        asyncio.run(check_chat_schemas(req))
    assert e.value.status == 400 and e.value.param == "tools.1.function.parameters"
    refused(d, "tools.1.function.parameters", deferred=False)  # parse_chat: inline, as before
    good = parse_chat_deferred(chat(tools=[tool("f", wide_schema(3))]))
    asyncio.run(check_chat_schemas(good))
    assert good.schemas == ()
    assert parse_chat(chat(tools=[tool("f", wide_schema(3))])).schemas == ()


def test_meta_validation_past_its_deadline_is_a_400_and_the_queue_is_not_pinned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = threading.Event()
    started = threading.Event()
    real = structured._meta_error

    def slow(text: bytes) -> str | None:
        started.set()
        release.wait(30)  # bounded
        return real(text)

    monkeypatch.setattr(structured, "_meta_error", slow)
    req = parse_chat_deferred(chat(tools=[tool("slow", wide_schema(7))]))
    other = parse_chat_deferred(chat(tools=[tool("queued", wide_schema(8))]))

    async def both() -> tuple[BaseException | None, BaseException | None]:
        got = await asyncio.gather(
            check_schemas(req.schemas, deadline=0.2),
            check_schemas(other.schemas, deadline=0.2),
            return_exceptions=True,
        )
        return got[0], got[1]

    try:
        first, second = asyncio.run(both())
    finally:
        release.set()
    assert started.is_set()
    for err in (first, second):
        assert isinstance(err, ApiError) and err.status == 400 and err.code == "schema_too_complex", err
    monkeypatch.setattr(structured, "_meta_error", real)
    asyncio.run(check_schemas(other.schemas))  # the thread is free again: the queued job was cancelled


# ---- byte-bounded caches ---------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    max_bytes=st.integers(0, 5000),
    max_entries=st.integers(0, 50),
    ops=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 3000), st.booleans()), max_size=200),
)
def test_byte_lru_never_holds_more_than_its_bounds(
    max_bytes: int, max_entries: int, ops: list[tuple[int, int, bool]]
) -> None:
    c: ByteLRU[int, int] = ByteLRU(max_bytes, max_entries)
    for key, cost, pop in ops:
        if pop:
            c.pop(key)
        else:
            stored = c.put(key, cost, cost)
            assert stored == (cost <= c.max_item_bytes and max_entries > 0)
            if stored:
                assert c.get(key) == cost  # the newest entry is never the one evicted
        assert c.total <= max_bytes and len(c) <= max_entries
        assert c.total == sum(v for v in (c.get(k) for k in list(c._d)) if v is not None)


def _render(prefix: str, chat: list[dict[str, Any]]) -> str:
    return prefix + str(chat[0]["content"])


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 40_000), min_size=1, max_size=60))
def test_skeleton_cache_is_bounded_in_bytes(sizes: list[int]) -> None:
    cache = SkeletonCache(size=1000, max_bytes=100_000)
    for i, n in enumerate(sizes):
        shape = (True, b"k" * n + str(i).encode(), ("user",))  # a key holding big template kwargs
        cache.render(shape, [{"role": "user", "content": "x"}], [0], functools.partial(_render, "T" * n))
        assert cache.bytes <= cache.max_bytes
        assert cache.bytes == sum(cache._costs.values()) and len(cache._costs) == len(cache)


def test_sampling_memo_is_bounded_in_bytes() -> None:
    for i in range(300):
        parse_chat_deferred(
            chat(stop=[f"{i}-{j}" + "s" * (MAX_STOP_CHARS - 10) for j in range(16)], logit_bias={str(i): 1})
        )
        assert sampling_memo_bytes() <= SAMPLING_MEMO_BYTES
    assert len(rq._SAMPLING_MEMO) * 16 * MAX_STOP_CHARS <= SAMPLING_MEMO_BYTES


def test_validator_cache_is_bounded_in_bytes() -> None:
    lru = structured._VALIDATORS
    for i in range(60):
        schema = {"type": "object", "description": f"{i}" + "d" * 200_000}
        assert structured._violation(structured._dumps(schema), {}) is None
        assert lru.total <= lru.max_bytes
    assert len(structured._META) <= structured._META_CACHE_ENTRIES


def test_answer_checks_fetch_no_ref_outside_the_schema(tmp_path: Any) -> None:
    """A ``$ref`` to a URL or a file is not fetched when an answer is checked (jsonschema's default
    registry would, on the event loop): no connection reaches a listener it names, and no file's content
    reaches the violation message; refs within the schema still apply."""
    import socket

    secret = tmp_path / "secret.json"
    secret.write_text('{"enum": ["SECRET-VALUE-123"]}')
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        based = {"$id": f"http://127.0.0.1:{port}/x.json", "properties": {"a": {"$ref": "other.json"}}}
        refs = [{"type": "object", "properties": {"a": {"$ref": f"http://127.0.0.1:{port}/s.json"}}}]
        refs += [{"type": "object", "properties": {"a": {"$ref": f"file://{secret}"}}}, based]
        found: list[str | None] = []

        def check() -> None:  # in a thread: a fetch would wait on the listener, which never answers
            found.extend(structured._violation(structured._dumps(schema), {"a": "x"}) for schema in refs)

        t = threading.Thread(target=check, daemon=True)
        t.start()
        t.join(10)
        assert found == [None, None, None], found  # (a fetch: still waiting, or SECRET in a message)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody came
    local = {"$defs": {"s": {"enum": ["y"]}}, "properties": {"a": {"$ref": "#/$defs/s"}}}
    assert "'x' is not one of ['y']" in (structured._violation(structured._dumps(local), {"a": "x"}) or "")
    embedded = {"$defs": {"s": {"$id": "urn:s", "enum": ["y"]}}, "properties": {"a": {"$ref": "urn:s"}}}
    assert structured._violation(structured._dumps(embedded), {"a": "x"})


def test_manual_policy_holds_long_keys_as_digests() -> None:
    class W:
        def __init__(self, wid: str) -> None:
            self.id = wid

    policy = Manual(seed=1)
    workers: Any = [W("a"), W("b")]
    long_key = "k" * 70_000
    first = policy.pick(workers, RouteRequest("m", [1], long_key))
    assert first is not None
    assert all(len(k) <= MAX_KEY_CHARS for k in policy._keys)
    for _ in range(5):  # still sticky
        assert policy.pick(workers, RouteRequest("m", [1], long_key)) is first
    assert policy.candidates(long_key) == [first.id]


# ---- stop matching on repetitive text --------------------------------------------------------------------


def _reference(text: str, stops: list[str]) -> str:
    best: tuple[int, int] | None = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < (best[0] + best[1], best[0])):
            best = (i, len(s))
    return text if best is None else text[: best[0]]


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_long_stops_on_repetitive_text_are_exact(chunk: int) -> None:
    stops = ["a" * (MAX_STOP_CHARS - 1 - i) + "b" for i in range(16)]
    text = "a" * 3000 + "b" + "tail"
    m = StopMatcher(stops)
    out = []
    for i in range(0, len(text), chunk):
        r = m.feed(text[i : i + chunk])
        out.append(r.visible)
        if r.finished:
            break
    else:
        out.append(m.flush())
    assert "".join(out) == _reference(text, stops)
    no_b = "a" * 2500
    m = StopMatcher(stops)
    got = "".join(m.feed(no_b[i : i + chunk]).visible for i in range(0, len(no_b), chunk))
    assert m.held == "a" * (MAX_STOP_CHARS - 1) and got + m.flush() == no_b


def test_seed_reads_as_vllm_reads_it_and_says_what_is_wrong() -> None:
    base: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert rq.parse_chat({**base, "seed": 5.0}).sampling.seed == 5  # (pydantic's lax int)
    for seed, says in ((2.0**70, "64-bit"), (2**63, "64-bit"), (5.5, "an integer"), ("5", "an integer")):
        with pytest.raises(ApiError, match=says):
            rq.parse_chat({**base, "seed": seed})


def test_null_legacy_fields_count_as_absent() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    base: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": tools}
    assert rq.parse_chat({**base, "functions": None, "function_call": None}).tools
    with pytest.raises(ApiError, match="cannot be combined"):
        rq.parse_chat({**base, "functions": [{"name": "g"}]})
