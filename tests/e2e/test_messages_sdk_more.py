"""End to end, the official ``anthropic`` SDK against a real mock engine and node (qwen3's template, the
qwen3 reasoning parser and the hermes tool-call parser over the byte-level tokenizer), the mock's output
scripted per request. Ports are picked in 49000-49999.

What a second sweep with the SDK found and these tests keep fixed:

- a tool call cut off by ``max_tokens`` is a ``tool_use`` block (its input as far as it goes) with
  ``stop_reason: max_tokens``, as Anthropic answers, streamed or not (it was the raw ``<tool_call>`` text);
  chat completions keep vLLM's answer, the text;
- ``tool_choice: {"type": "none"}`` keeps the tools in the prompt (Anthropic's tool-use system prompt
  stays; vLLM's default for chat completions too) and parses no call;
- ``GET /v1/models`` and ``/v1/models/{id}`` in Anthropic's shape when the request carries
  ``anthropic-version`` (the SDK's ``models.list`` / ``retrieve``, its pagination), an API key's model list
  still holding;
- Anthropic's ``anthropic-ratelimit-*`` headers on the Messages API's answers and 429s.
- the SDK's tool runner (it sends the message-threads beta's ``thread``: refused with the
  ``thread_unsupported_request`` detail the SDK recovers from, it goes on with the whole conversation).
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
import yaml

from tests.e2e import node_fixtures
from tests.e2e import test_messages_sdk_sweep as sweep
from tests.e2e.node_fixtures import QWEN3_TEMPLATE
from tests.e2e.node_procs import NodeProc, reserved_port, running_node
from tests.e2e.procs import MockEngineProc
from tests.e2e.responses_fixtures import MODEL

tokenizer_dir, http = node_fixtures.tokenizer_dir, node_fixtures.http

OTHER = "qwen3-listed"  # a second model the node lists (no worker serves it: listing only)
KEY_ALL, KEY_ONE, KEY_LIMITED = "sk-e2e-all", "sk-e2e-one", "sk-e2e-limited"
LIMITED_RPM = 3
TOOLS: Any = [
    {
        "name": "get_weather",
        "description": "Current weather of a city",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    }
]
CUT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, '
    '"unit": "ce'
)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _port() -> int:
    """A loopback port free now (below the ephemeral range: ``node_procs.reserved_port``)."""
    return reserved_port()


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


engine = sweep.engine  # the same mock engine (its own per module)


@pytest.fixture(scope="module")
def node(engine: MockEngineProc, tokenizer_dir: Path) -> Iterator[NodeProc]:
    def model(name: str) -> dict[str, Any]:
        return {
            "name": name,
            "model_path": str(tokenizer_dir),
            "worker_urls": [f"grpc://127.0.0.1:{engine.grpc_port}"],
            "chat_template": str(QWEN3_TEMPLATE),
            "reasoning_parser": "qwen3",
            "tool_call_parser": "hermes",
        }

    keys = [
        {"name": "all", "role": "user", "sha256": _sha(KEY_ALL)},
        {"name": "one", "role": "user", "sha256": _sha(KEY_ONE), "models": [MODEL]},
        {"name": "limited", "role": "user", "tenant": "limited", "sha256": _sha(KEY_LIMITED)},
    ]
    settings = {
        "models": [model(MODEL), model(OTHER)],
        "tokenizer_workers": 0,
        "auth": {"data_plane": "api_key", "keys": keys},
        "rate_limits": [{"tenant": "limited", "rpm": LIMITED_RPM, "tpm": 1_000_000}],
    }
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "node.yaml"
        cfg.write_text(yaml.safe_dump(settings))
        with running_node("--config", str(cfg), port=_port()) as n:  # stopped on exit
            yield n
            log = n.log()
            assert "Traceback" not in log, log[-4000:]


def _client(node: NodeProc, key: str = KEY_ALL) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=node.url, api_key=key, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def client(node: NodeProc) -> Iterator[anthropic.Anthropic]:
    with _client(node) as c:
        yield c


@pytest.fixture(autouse=True)
def _clean_mock(engine: MockEngineProc, http: httpx.Client) -> Iterator[None]:
    yield
    http.delete(f"http://127.0.0.1:{engine.http_port}/mock/responses")


def _script(engine: MockEngineProc, http: httpx.Client, text: str, **more: Any) -> str:
    """Queue ``text`` as the answer to the next request whose prompt holds the returned marker (or
    ``match``); ``finish_reason: length`` ends it as ``max_tokens`` would."""
    import uuid

    marker = more.pop("match", None) or f"case-{uuid.uuid4().hex[:12]}"
    r = http.post(
        f"http://127.0.0.1:{engine.http_port}/mock/responses", json={"text": text, "match": marker, **more}
    )
    r.raise_for_status()
    return marker


def _user(text: str) -> Any:
    return [{"role": "user", "content": text}]


# ---- a tool call cut off by max_tokens ----


def test_a_call_cut_by_max_tokens_is_a_tool_use_block(
    client: anthropic.Anthropic, engine: MockEngineProc, http: httpx.Client
) -> None:
    """Anthropic: "the truncated response contains an incomplete tool use block" (stop_reason max_tokens,
    the last block a tool_use); its input is the call's JSON as far as it went (the SDK reads a streamed
    input so: the unfinished string is dropped)."""
    want = {"city": "Paris", "days": 3}
    msg = client.messages.create(
        model=MODEL,
        max_tokens=1000,
        tools=TOOLS,
        messages=_user(_script(engine, http, CUT, finish_reason="length")),
    )
    assert msg.stop_reason == "max_tokens"
    assert [b.type for b in msg.content] == ["text", "tool_use"]
    text, block = msg.content
    assert text.type == "text" and text.text == "Let me check.\n"
    assert block.type == "tool_use" and block.name == "get_weather" and block.input == want
    assert block.id.startswith("toolu_")
    with client.messages.stream(
        model=MODEL,
        max_tokens=1000,
        tools=TOOLS,
        messages=_user(_script(engine, http, CUT, finish_reason="length")),
    ) as stream:
        kinds = [(e.type, getattr(getattr(e, "content_block", None), "type", None)) for e in stream]
        final = stream.get_final_message()
    assert ("content_block_start", "tool_use") in kinds
    assert final.stop_reason == "max_tokens" and [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].type == "tool_use" and final.content[1].input == want


def test_a_malformed_call_the_model_ended_on_is_text_under_end_turn(
    client: anthropic.Anthropic, engine: MockEngineProc, http: httpx.Client
) -> None:
    """The output ends on its own (EOS) inside a call whose JSON never closes: the call is text, as chat
    completions answer it, streamed or not; the conversation goes on (a ``tool_use`` block under
    ``end_turn`` would leave a call the next turn must answer)."""
    bad = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>'
    msg = client.messages.create(
        model=MODEL, max_tokens=1000, tools=TOOLS, messages=_user(_script(engine, http, bad))
    )
    assert msg.stop_reason == "end_turn"
    assert [(b.type, getattr(b, "text", None)) for b in msg.content] == [("text", bad)]
    with client.messages.stream(
        model=MODEL, max_tokens=1000, tools=TOOLS, messages=_user(_script(engine, http, bad))
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn"
    assert [(b.type, getattr(b, "text", None)) for b in final.content] == [("text", bad)]
    turns: Any = [
        *_user("weather?"),
        {"role": "assistant", "content": [b.model_dump() for b in final.content]},
        *_user("and tomorrow?"),
    ]
    follow = client.messages.create(model=MODEL, max_tokens=20, tools=TOOLS, messages=turns)
    assert follow.type == "message"


def test_a_cut_before_the_name_drops_the_call(
    client: anthropic.Anthropic, engine: MockEngineProc, http: httpx.Client
) -> None:
    cut = 'Let me check.\n<tool_call>\n{"na'
    msg = client.messages.create(
        model=MODEL,
        max_tokens=1000,
        tools=TOOLS,
        messages=_user(_script(engine, http, cut, finish_reason="length")),
    )
    assert msg.stop_reason == "max_tokens"
    assert [(b.type, getattr(b, "text", None)) for b in msg.content] == [("text", "Let me check.\n")]


def test_chat_completions_keep_the_cut_call_as_text(
    node: NodeProc, engine: MockEngineProc, http: httpx.Client
) -> None:
    """vLLM's hermes parser answers a call whose JSON does not parse as content (SGLang's drops it):
    chat completions keep vLLM's answer."""
    marker = _script(engine, http, CUT, finish_reason="length")
    body = {
        "model": MODEL,
        "max_tokens": 1000,
        "messages": _user(marker),
        "tools": [
            {"type": "function", "function": {"name": "get_weather", "parameters": TOOLS[0]["input_schema"]}}
        ],
    }
    r = http.post(f"{node.url}/v1/chat/completions", json=body, headers={"x-api-key": KEY_ALL})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and not choice["message"].get("tool_calls")
    assert choice["message"]["content"] == CUT


# ---- tool_choice none ----


def test_tool_choice_none_keeps_the_tools_in_the_prompt(
    client: anthropic.Anthropic, node: NodeProc, engine: MockEngineProc, http: httpx.Client
) -> None:
    """The mock answers only when the rendered prompt holds the marker, which only the tool's description
    carries: with ``none`` the tools are rendered (the model sees them) and no call is parsed."""
    import uuid

    marker = f"tool-{uuid.uuid4().hex[:12]}"
    tools: Any = [{**TOOLS[0], "description": f"Current weather of a city ({marker})"}]
    _script(engine, http, "No tools needed. " + CALL, match=marker)
    msg = client.messages.create(
        model=MODEL, max_tokens=1000, tools=tools, tool_choice={"type": "none"}, messages=_user("Weather?")
    )
    assert msg.stop_reason == "end_turn"
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].type == "text" and msg.content[0].text == "No tools needed. " + CALL
    counts = [
        client.messages.count_tokens(model=MODEL, messages=_user("Weather?"), **kw).input_tokens
        for kw in ({"tools": tools, "tool_choice": {"type": "none"}}, {"tools": tools}, {})
    ]
    assert counts[0] == counts[1] > counts[2]
    # chat completions: vLLM's default (no --exclude-tools-when-tool-choice-none) renders them too
    _script(engine, http, "Plain.", match=marker)
    chat_tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": tools[0]["description"],
                "parameters": TOOLS[0]["input_schema"],
            },
        }
    ]
    r = http.post(
        f"{node.url}/v1/chat/completions",
        json={
            "model": MODEL,
            "max_tokens": 100,
            "messages": _user("Weather?"),
            "tools": chat_tools,
            "tool_choice": "none",
        },
        headers={"x-api-key": KEY_ALL},
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "Plain."


# ---- the SDK's tool runner (message threads refused as Anthropic words it) ----


@pytest.mark.parametrize("stream", [False, True])
def test_the_sdks_tool_runner_runs_the_tool_loop(
    client: anthropic.Anthropic, engine: MockEngineProc, http: httpx.Client, stream: bool
) -> None:
    """The runner sends ``thread: {type: create}``, then only the tool results with ``thread: {type:
    continue, previous_message_id}`` (the message-threads beta: the server keeps the conversation). A
    ``thread`` is refused with ``details.error_code`` ``thread_unsupported_request``, on which the SDK goes
    on without one, sending the whole conversation (the ``thread`` was ignored and the second turn, tool
    results answering no tool_use, was a 400 that ended the loop)."""
    results: list[str] = []

    @anthropic.beta_tool
    def get_weather(city: str) -> str:
        """Current weather of a city.

        Args:
            city: the city
        """
        results.append(city)
        return f"sunny-in-{city}-{len(results)}"

    marker = _script(engine, http, CALL)
    _script(engine, http, "It is sunny.", match="sunny-in-Paris-1")
    replies: list[Any] = []
    if stream:
        run = client.beta.messages.tool_runner(
            model=MODEL, max_tokens=1000, tools=[get_weather], messages=_user(marker), stream=True
        )
        replies.extend(s.get_final_message() for s in run)
    else:
        replies.extend(
            client.beta.messages.tool_runner(
                model=MODEL, max_tokens=1000, tools=[get_weather], messages=_user(marker)
            )
        )
    assert [[b.type for b in m.content] for m in replies] == [["tool_use"], ["text"]]
    assert [m.stop_reason for m in replies] == ["tool_use", "end_turn"]
    assert results == ["Paris"]
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(
            model=MODEL,
            max_tokens=8,
            messages=_user("hi"),
            extra_body={"thread": {"type": "create"}},
        )
    assert isinstance(refused.value.body, dict)
    assert refused.value.body["error"]["details"] == {"error_code": "thread_unsupported_request"}


# ---- /v1/models ----


def test_models_in_anthropics_shape(client: anthropic.Anthropic, node: NodeProc, http: httpx.Client) -> None:
    page = client.models.list()
    assert [m.id for m in page.data] == [MODEL, OTHER]
    assert page.has_more is False and page.first_id == MODEL and page.last_id == OTHER
    info = page.data[0]
    assert info.type == "model" and info.display_name == MODEL and info.created_at.year >= 2024
    assert info.lifecycle == "active" and info.max_input_tokens == 65536
    assert [[m.id for m in p.data] for p in client.models.list(limit=1).iter_pages()] == [[MODEL], [OTHER]]
    assert [m.id for m in client.models.list(limit=1, after_id=MODEL).data] == [OTHER]
    assert [m.id for m in client.models.list(limit=1, before_id=OTHER).data] == [MODEL]
    assert client.models.retrieve(OTHER).id == OTHER
    with pytest.raises(anthropic.NotFoundError) as nf:
        client.models.retrieve("no-such-model")
    assert isinstance(nf.value.body, dict) and nf.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.models.list(limit=0)
    # without anthropic-version: OpenAI's (vLLM's) list, as before
    r = http.get(f"{node.url}/v1/models", headers={"x-api-key": KEY_ALL})
    assert r.json()["object"] == "list" and r.json()["data"][0]["object"] == "model"


def test_an_api_keys_model_list_holds(node: NodeProc) -> None:
    with _client(node, KEY_ONE) as one:
        assert [m.id for m in one.models.list().data] == [MODEL]
        assert one.models.retrieve(MODEL).id == MODEL
        with pytest.raises(anthropic.NotFoundError):
            one.models.retrieve(OTHER)


# ---- rate limits ----


def test_anthropic_rate_limit_headers(node: NodeProc) -> None:
    with _client(node, KEY_LIMITED) as lim:
        raw = lim.messages.with_raw_response.create(model=MODEL, max_tokens=8, messages=_user("hi"))
        h = raw.headers
        assert h["anthropic-ratelimit-requests-limit"] == str(LIMITED_RPM)
        assert h["anthropic-ratelimit-requests-remaining"] == str(LIMITED_RPM - 1)
        assert h["anthropic-ratelimit-requests-reset"].endswith("Z")
        assert h["anthropic-ratelimit-tokens-limit"] == "1000000"
        assert int(h["anthropic-ratelimit-tokens-remaining"]) < 1_000_000
        assert h["x-ratelimit-remaining-requests"] == str(LIMITED_RPM - 1)  # (kept)
        with lim.messages.with_streaming_response.create(
            model=MODEL, max_tokens=8, messages=_user("hi"), stream=True
        ) as streamed:
            assert streamed.headers["anthropic-ratelimit-requests-remaining"] == str(LIMITED_RPM - 2)
            streamed.read()
        for _ in range(LIMITED_RPM - 2):
            lim.messages.create(model=MODEL, max_tokens=8, messages=_user("hi"))
        with pytest.raises(anthropic.RateLimitError) as limited:
            lim.messages.create(model=MODEL, max_tokens=8, messages=_user("hi"))
    h = limited.value.response.headers
    assert int(h["retry-after"]) >= 1
    assert h["anthropic-ratelimit-requests-remaining"] == "0"
    assert h["anthropic-ratelimit-requests-limit"] == str(LIMITED_RPM)
    assert h["x-ratelimit-remaining-requests"] == "0"
    assert isinstance(limited.value.body, dict) and limited.value.body["error"]["type"] == "rate_limit_error"
