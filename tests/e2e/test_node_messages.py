"""End to end: the Anthropic Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) with the official
``anthropic`` SDK against a real mock engine and node (qwen3's template, the qwen3 reasoning parser and
the hermes tool-call parser over the byte-level tokenizer, as tests/e2e/test_responses_sdk.py), the
mock's output scripted per request (``responses_fixtures.script``).

The node runs with API keys on: the SDK sends its key as ``x-api-key``; a wrong key is a 401 in
Anthropic's envelope.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from tests.e2e import node_fixtures, responses_fixtures
from tests.e2e.node_procs import NodeProc
from tests.e2e.procs import MockEngineProc
from tests.e2e.responses_fixtures import MODEL, qwen3_node, script

tokenizer_dir, http = node_fixtures.tokenizer_dir, node_fixtures.http
engine = responses_fixtures.engine

KEY = "sk-messages-test-key"
LIMITED_KEY = "sk-messages-limited-key"  # its tenant may send one request a minute
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS: Any = [
    {
        "name": "get_weather",
        "description": "Current weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


@pytest.fixture(scope="module")
def node(engine: MockEngineProc, tokenizer_dir: Path) -> Iterator[NodeProc]:
    auth = {
        "mode": "api_key",
        "keys": [
            {"name": "u", "role": "user", "sha256": hashlib.sha256(KEY.encode()).hexdigest()},
            {
                "name": "limited",
                "role": "user",
                "tenant": "limited",
                "sha256": hashlib.sha256(LIMITED_KEY.encode()).hexdigest(),
            },
        ],
    }
    limits = [{"tenant": "limited", "rpm": 1}]
    with qwen3_node(engine, tokenizer_dir, auth=auth, rate_limits=limits, sse_keepalive_secs=0.2) as n:
        yield n
        log = n.log()
        assert "Traceback" not in log, log[-4000:]


@pytest.fixture(scope="module")
def client(node: NodeProc) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=node.url, api_key=KEY, max_retries=0, timeout=30) as c:
        yield c


@pytest.fixture(autouse=True)
def _clean_mock(engine: MockEngineProc, http: httpx.Client) -> Iterator[None]:
    yield
    http.delete(f"http://127.0.0.1:{engine.http_port}/mock/responses")


def _user(text: str) -> Any:
    return [{"role": "user", "content": text}]


def test_create(client: anthropic.Anthropic, engine: MockEngineProc, http: httpx.Client) -> None:
    marker = script(engine, http, "Hello there, friend.")
    msg = client.messages.create(
        model=MODEL, max_tokens=64, messages=_user(f"say hello {marker}"), metadata={"user_id": "u-1"}
    )
    assert msg.id.startswith("msg_")
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].type == "text" and msg.content[0].text == "Hello there, friend."
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) > 0
    assert msg.usage.output_tokens > 0
    assert msg.usage.cache_creation_input_tokens == 0


def test_max_tokens_zero_fills_the_prompt_cache(client: anthropic.Anthropic) -> None:
    """``max_tokens: 0`` ("populate the prompt cache without generating a response", the SDK's docs): an
    empty Message, ``stop_reason`` max_tokens, no output token, streamed and not; the next request with
    that prompt reads it from the engine's prefix cache."""
    prompt = _user("warm me up, " + " ".join(f"w{i}" for i in range(60)))
    warm = client.messages.create(model=MODEL, max_tokens=0, messages=prompt)
    assert (warm.content, warm.stop_reason, warm.usage.output_tokens) == ([], "max_tokens", 0)
    with client.messages.stream(model=MODEL, max_tokens=0, messages=prompt) as s:
        kinds = [e.type for e in s]
        streamed = s.get_final_message()
    assert kinds == ["message_start", "message_delta", "message_stop"], kinds
    assert (streamed.content, streamed.stop_reason, streamed.usage.output_tokens) == ([], "max_tokens", 0)
    assert (streamed.usage.cache_read_input_tokens or 0) > 0  # (the first request's prefill)


def test_stop_sequence_and_max_tokens(
    client: anthropic.Anthropic, engine: MockEngineProc, http: httpx.Client
) -> None:
    marker = script(engine, http, "one two STOP three")
    msg = client.messages.create(
        model=MODEL, max_tokens=64, messages=_user(marker), stop_sequences=["STOP"], system="Be brief."
    )
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "STOP"
    assert msg.content[0].type == "text" and msg.content[0].text == "one two "
    marker = script(engine, http, "a long answer that goes on and on and on")
    msg = client.messages.create(model=MODEL, max_tokens=3, messages=_user(marker))
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 3


CONTEXT = 65536  # the engine's (responses_fixtures.engine)


def test_max_tokens_past_the_context_window_stops_at_the_window(
    client: anthropic.Anthropic, engine: MockEngineProc, http: httpx.Client
) -> None:
    """Claude Code asks ``max_tokens`` 32,000 of any model: past what the window leaves, the engine is
    asked for the rest of the window and an answer cut there stops with Anthropic's
    ``model_context_window_exceeded`` (it was a 400 in vLLM's words on every turn); one that ends on
    its own is ``end_turn`` as ever; within the window nothing changes."""
    marker = script(engine, http, "short answer")
    msg = client.messages.create(model=MODEL, max_tokens=CONTEXT, messages=_user(marker))
    assert msg.stop_reason == "end_turn", msg
    asked = http.get(f"http://127.0.0.1:{engine.http_port}/mock/stats").json()["last_sampling_params"]
    assert asked["max_new_tokens"] == CONTEXT - msg.usage.input_tokens - (
        msg.usage.cache_read_input_tokens or 0
    )
    for stream in (False, True):
        marker = f"cut-{stream}"
        r = http.post(
            f"http://127.0.0.1:{engine.http_port}/mock/responses",
            json={"text": "cut at the window", "match": marker, "finish_reason": "length"},
        )
        assert r.status_code < 300, r.text
        if stream:
            with client.messages.stream(model=MODEL, max_tokens=CONTEXT, messages=_user(marker)) as s:
                msg = s.get_final_message()
        else:
            msg = client.messages.create(model=MODEL, max_tokens=CONTEXT, messages=_user(marker))
        assert msg.stop_reason == "model_context_window_exceeded", msg
    marker = script(engine, http, "a long answer that goes on and on and on")
    assert (
        client.messages.create(model=MODEL, max_tokens=3, messages=_user(marker)).stop_reason == "max_tokens"
    )


def test_a_prompt_the_window_cannot_hold_is_refused_in_anthropics_words(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=10, messages=_user("a " * (CONTEXT + 10)))
    message = e.value.body["error"]["message"]  # type: ignore[index]
    assert message.startswith("prompt is too long: ") and message.endswith(f" tokens > {CONTEXT - 1} maximum")


def test_message_start_usage_has_the_cache_split(client: anthropic.Anthropic) -> None:
    """A prompt the engine's cache holds: ``message_start`` (sent with the first event, once the engine
    told the split) counts its cached tokens as ``message_delta`` does; it counted the whole prompt as
    input, so a client reading the cache figures from it (as Anthropic fills them) saw no hit."""
    prompt = _user("cache me: " + "a long shared prefix " * 40)
    client.messages.create(model=MODEL, max_tokens=4, messages=prompt)  # (fills the engine's cache)
    with client.messages.stream(model=MODEL, max_tokens=4, messages=prompt) as s:
        starts = [e.message.usage for e in s if e.type == "message_start"]
        final = s.get_final_message()
    assert len(starts) == 1 and (final.usage.cache_read_input_tokens or 0) > 0
    assert starts[0].cache_read_input_tokens == final.usage.cache_read_input_tokens
    assert starts[0].input_tokens == final.usage.input_tokens


def test_stream_and_final_message(
    client: anthropic.Anthropic, engine: MockEngineProc, http: httpx.Client
) -> None:
    marker = script(engine, http, "Streaming words, one by one.")
    with client.messages.stream(model=MODEL, max_tokens=64, messages=_user(marker)) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == "Streaming words, one by one."
    assert final.content[0].type == "text" and final.content[0].text == "Streaming words, one by one."
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens > 0


def test_stream_event_sequence(node: NodeProc, engine: MockEngineProc, http: httpx.Client) -> None:
    marker = script(engine, http, "<think>\nPonder.\n</think>\n\nDone. " + CALL)
    body = {
        "model": MODEL,
        "max_tokens": 2048,
        "stream": True,
        "messages": _user(marker),
        "tools": TOOLS,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    with http.stream("POST", node.url + "/v1/messages", json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        text = r.read().decode()
    events = []
    for block in text.split("\n\n"):
        if not block.strip() or block.startswith(":"):
            continue
        head, data = block.split("\n", 1)
        ev = json.loads(data.removeprefix("data: "))
        assert head == f"event: {ev['type']}"
        events.append(ev)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    # every block: start, deltas, stop, in index order; the thinking block's signature before its stop
    for i in range(3):
        mine = [e for e in events if e.get("index") == i]
        assert mine[0]["type"] == "content_block_start" and mine[-1]["type"] == "content_block_stop"
    thinking = [e for e in events if e.get("index") == 0]
    assert thinking[-2]["delta"]["type"] == "signature_delta" and thinking[-2]["delta"]["signature"]
    args = "".join(
        e["delta"]["partial_json"]
        for e in events
        if e.get("index") == 2 and e["type"] == "content_block_delta"
    )
    assert json.loads(args) == {"city": "Paris"}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_tools_round_trip(client: anthropic.Anthropic, engine: MockEngineProc, http: httpx.Client) -> None:
    marker = script(engine, http, CALL)
    first = client.messages.create(
        model=MODEL, max_tokens=256, messages=_user(f"weather? {marker}"), tools=TOOLS
    )
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) == 1
    use = uses[0]
    assert use.id.startswith("toolu_") and use.name == "get_weather" and use.input == {"city": "Paris"}
    answer = script(engine, http, "It is sunny in Paris.", match="sunny-result-42")
    history: Any = [
        {"role": "user", "content": f"weather? {marker}"},
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": f"{answer}: 21C"}],
        },
    ]
    second = client.messages.create(model=MODEL, max_tokens=256, tools=TOOLS, messages=history)
    assert second.stop_reason == "end_turn"
    assert second.content[0].type == "text" and second.content[0].text == "It is sunny in Paris."
    # the same, streamed: the SDK's accumulated tool_use block carries the parsed input
    marker = script(engine, http, CALL)
    with client.messages.stream(
        model=MODEL,
        max_tokens=256,
        messages=_user(marker),
        tools=TOOLS,
        tool_choice={"type": "auto"},
    ) as stream:
        final = stream.get_final_message()
    blocks = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use"
    assert len(blocks) == 1 and blocks[0].input == {"city": "Paris"} and blocks[0].id.startswith("toolu_")


def test_tool_choice_forced(client: anthropic.Anthropic, engine: MockEngineProc, http: httpx.Client) -> None:
    marker = script(engine, http, '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    msg = client.messages.create(
        model=MODEL,
        max_tokens=256,
        messages=_user(marker),
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(uses) == 1 and uses[0].input == {"city": "Oslo"}


def test_thinking_qwen3(client: anthropic.Anthropic, engine: MockEngineProc, http: httpx.Client) -> None:
    out = "<think>\nTwo and two make four.\n</think>\n\nThe answer is 4."
    marker = script(engine, http, out)
    msg = client.messages.create(
        model=MODEL,
        max_tokens=2048,
        messages=_user(f"2+2? {marker}"),
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert [b.type for b in msg.content] == ["thinking", "text"]
    th, tx = msg.content
    assert th.type == "thinking" and th.thinking.strip() == "Two and two make four." and th.signature
    assert tx.type == "text" and tx.text == "The answer is 4."
    marker = script(engine, http, out)
    with client.messages.stream(
        model=MODEL,
        max_tokens=2048,
        messages=_user(f"2+2? {marker}"),
        thinking={"type": "enabled", "budget_tokens": 1024},
    ) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    sth = final.content[0]
    assert sth.type == "thinking" and sth.thinking == th.thinking and sth.signature == th.signature
    # thinking off (the default): the template closes the think block, no parser, plain text
    marker = script(engine, http, "Plain answer.")
    msg = client.messages.create(model=MODEL, max_tokens=64, messages=_user(marker))
    assert [b.type for b in msg.content] == ["text"]


def test_count_tokens(client: anthropic.Anthropic, engine: MockEngineProc, http: httpx.Client) -> None:
    messages = _user("count these words please")
    counted = client.messages.count_tokens(model=MODEL, messages=messages, system="sys", tools=TOOLS)
    assert counted.input_tokens > 0
    marker = script(engine, http, "ok", match="count these words please")
    msg = client.messages.create(model=MODEL, max_tokens=8, messages=messages, system="sys", tools=TOOLS)
    assert marker
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == counted.input_tokens
    more = client.messages.count_tokens(model=MODEL, messages=_user("count these words please, and more"))
    assert more.input_tokens > client.messages.count_tokens(model=MODEL, messages=messages).input_tokens


def _envelope(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return str(body["error"]["message"])


def test_errors(client: anthropic.Anthropic, node: NodeProc, http: httpx.Client) -> None:
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    url = node.url + "/v1/messages"
    msg = _envelope(
        http.post(url, json={"model": MODEL, "messages": _user("hi")}, headers=headers),
        400,
        "invalid_request_error",
    )
    assert "max_tokens" in msg
    with pytest.raises(anthropic.NotFoundError) as nf:
        client.messages.create(model="no-such-model", max_tokens=8, messages=_user("hi"))
    assert nf.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    bad_result: Any = [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}
    ]
    with pytest.raises(anthropic.BadRequestError) as br:
        client.messages.create(model=MODEL, max_tokens=8, messages=bad_result, tools=TOOLS)
    assert "tool_use_id" in str(br.value)
    image = [
        {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}
    ]
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model=MODEL, max_tokens=8, messages=image)  # type: ignore[arg-type]
    bad_json = {**headers, "content-type": "application/json"}
    _envelope(http.post(url, content=b"{not json", headers=bad_json), 400, "invalid_request_error")
    _envelope(
        http.post(url + "/count_tokens", json={"model": MODEL, "messages": []}, headers=headers),
        400,
        "invalid_request_error",
    )
    # auth: a wrong key, and none, on both routes (the OpenAI routes keep their envelope)
    with (
        anthropic.Anthropic(base_url=node.url, api_key="wrong", max_retries=0, timeout=30) as other,
        pytest.raises(anthropic.AuthenticationError) as ae,
    ):
        other.messages.create(model=MODEL, max_tokens=8, messages=_user("hi"))
    assert ae.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    _envelope(http.post(url + "/count_tokens", json={}), 401, "authentication_error")
    r = http.post(node.url + "/v1/chat/completions", json={})
    assert (
        r.status_code == 401
        and r.json()["error"]["type"] == "authentication_error"
        and "type" not in r.json()
    )
    # Bearer works as well as x-api-key
    r = http.post(
        url + "/count_tokens",
        json={"model": MODEL, "messages": _user("hi")},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 200 and r.json()["input_tokens"] > 0


def test_rate_limited(node: NodeProc, engine: MockEngineProc, http: httpx.Client) -> None:
    with anthropic.Anthropic(base_url=node.url, api_key=LIMITED_KEY, max_retries=0, timeout=30) as c:
        marker = script(engine, http, "once")
        assert c.messages.create(model=MODEL, max_tokens=8, messages=_user(marker)).content
        with pytest.raises(anthropic.RateLimitError) as e:
            c.messages.create(model=MODEL, max_tokens=8, messages=_user(marker))
    assert e.value.status_code == 429
    body: Any = e.value.body
    assert (
        body["type"] == "error" and body["error"]["type"] == "rate_limit_error" and body["error"]["message"]
    )
    assert int(e.value.response.headers["retry-after"]) >= 1


def test_an_idle_stream_gets_ping_events(node: NodeProc, engine: MockEngineProc, http: httpx.Client) -> None:
    """While the engine is silent the keep-alive ticker writes Anthropic's ping events, not SSE comments."""
    faults = f"http://127.0.0.1:{engine.http_port}/mock/faults"
    http.post(faults, json={"stall_after_tokens": 1, "stall_seconds": 1.5}).raise_for_status()
    try:
        body = {"model": MODEL, "max_tokens": 8, "stream": True, "messages": _user("wait for it")}
        headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
        with http.stream("POST", node.url + "/v1/messages", json=body, headers=headers) as r:
            assert r.status_code == 200, r.read()
            text = r.read().decode()
    finally:
        http.post(faults, json={"stall_after_tokens": None, "stall_seconds": 0.0}).raise_for_status()
    assert text.count("event: ping\n") >= 2, text  # the one after message_start, then the ticker's
    assert ": keep-alive" not in text and "event: message_stop" in text


def test_a_slow_first_token_opens_with_message_start(
    node: NodeProc, engine: MockEngineProc, http: httpx.Client
) -> None:
    """An engine silent before its first token (queued, prefilling): the headers go out a keep-alive
    interval after dispatch with message_start, as Anthropic's streams open (raw SSE readers expect it
    first), then pings; message_start is not sent again when the tokens come."""
    faults = f"http://127.0.0.1:{engine.http_port}/mock/faults"
    http.post(faults, json={"hang_before_first_token": True}).raise_for_status()
    text = ""
    try:
        body = {"model": MODEL, "max_tokens": 8, "stream": True, "messages": _user("late first")}
        headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
        with http.stream("POST", node.url + "/v1/messages", json=body, headers=headers) as r:
            assert r.status_code == 200
            for piece in r.iter_text():  # bounded: a ping every 0.2 s, the stream's end
                text += piece
                if text.count("event: ping") == 3:  # (the fault cleared: the engine answers now)
                    http.post(faults, json={"hang_before_first_token": False}).raise_for_status()
                if text.count(": keep-alive") >= 3:  # comments instead of message_start: wrong
                    break
    finally:
        http.post(faults, json={"hang_before_first_token": False}).raise_for_status()
    assert text.startswith("event: message_start\n"), text[:200]
    assert text.count("event: message_start\n") == 1 and ": keep-alive" not in text, text
    before = text[: text.index("event: content_block_start")]
    assert before.count("event: ping\n") >= 2, text  # the one after message_start, then the ticker's
    assert text.rstrip().endswith('"type":"message_stop"}'), text[-200:]
