"""End to end: the Anthropic Messages API as a demanding user of the official ``anthropic`` SDK drives it,
over a real mock engine and node (qwen3's template, the qwen3 reasoning parser and the hermes tool-call
parser over the byte-level tokenizer, as tests/e2e/test_node_messages.py), the mock's output scripted per
request (``responses_fixtures.script``). Ports are picked in 43000-43999.

What the sweep of the SDK found and these tests keep fixed: Anthropic's ``request-id`` header (the SDK's
``Message._request_id`` and ``APIStatusError.request_id``), the SDK's ``output_config.effort`` levels
``xhigh`` and ``max``, ``thinking`` of type ``between_tools`` and its ``display: omitted``, empty message
content (a 400 in Anthropic's words, an empty final assistant turn no prefill), ``tool_choice`` any / tool
without tools in Anthropic's words; of Claude Code's shapes, ``role: system`` messages in the
conversation, its billing-header system block (dropped: it defeated the prefix cache) and a thinking
budget above ``max_tokens`` under the interleaved-thinking beta; and, as coverage, tool_result shapes, the
stream's events, a client gone mid-stream aborting the engine call, and a 529 the SDK retries.
"""

from __future__ import annotations

import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
import yaml

from tests.e2e import node_fixtures
from tests.e2e.node_fixtures import QWEN3_TEMPLATE
from tests.e2e.node_procs import NodeProc, reserved_port, running_node
from tests.e2e.procs import MockEngineProc, start_mock_engine
from tests.e2e.responses_fixtures import MODEL, script

tokenizer_dir, http = node_fixtures.tokenizer_dir, node_fixtures.http

TOOLS: Any = [
    {
        "name": "get_weather",
        "description": "Current weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _port() -> int:
    """A loopback port free now (below the ephemeral range: ``node_procs.reserved_port``)."""
    return reserved_port()


@contextmanager
def _node(tokenizer_dir: Path, worker_port: int, wait_ready: bool = True) -> Iterator[NodeProc]:
    model = {
        "name": MODEL,
        "model_path": str(tokenizer_dir),
        "worker_urls": [f"grpc://127.0.0.1:{worker_port}"],
        "chat_template": str(QWEN3_TEMPLATE),
        "reasoning_parser": "qwen3",
        "tool_call_parser": "hermes",
    }
    settings = {"models": [model], "tokenizer_workers": 0, "sse_keepalive_secs": 0.5}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "node.yaml"
        cfg.write_text(yaml.safe_dump(settings))
        with running_node("--config", str(cfg), port=_port(), wait_ready=wait_ready) as n:  # stopped on exit
            yield n


@pytest.fixture(scope="module")
def engine(tokenizer_dir: Path) -> Iterator[MockEngineProc]:
    ports = ("--grpc-port", str(_port()), "--http-port", str(_port()))
    with start_mock_engine(
        "--zero-latency",
        "--output-len",
        "16",
        "--tokenizer",
        str(tokenizer_dir),
        "--context-length",
        "65536",
        *ports,
    ) as e:
        yield e


@pytest.fixture(scope="module")
def node(engine: MockEngineProc, tokenizer_dir: Path) -> Iterator[NodeProc]:
    with _node(tokenizer_dir, engine.grpc_port) as n:
        yield n
        log = n.log()
        assert "Traceback" not in log, log[-4000:]


@pytest.fixture(scope="module")
def client(node: NodeProc) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=node.url, api_key="unused", max_retries=0, timeout=30) as c:
        yield c


@pytest.fixture(autouse=True)
def _clean_mock(engine: MockEngineProc, http: httpx.Client) -> Iterator[None]:
    yield
    http.delete(f"http://127.0.0.1:{engine.http_port}/mock/responses")
    http.post(
        f"http://127.0.0.1:{engine.http_port}/mock/faults",
        json={"stall_after_tokens": None, "stall_seconds": 0.0},
    ).raise_for_status()


def _user(text: str) -> Any:
    return [{"role": "user", "content": text}]


# ---- fixed by the sweep ----


def test_request_id_header(client: anthropic.Anthropic, engine: MockEngineProc, http: httpx.Client) -> None:
    """Every answer carries Anthropic's ``request-id`` (the SDK reads nothing else)."""
    msg = client.messages.create(model=MODEL, max_tokens=16, messages=_user(script(engine, http, "Hi.")))
    assert msg._request_id == msg.id
    with client.messages.stream(
        model=MODEL, max_tokens=16, messages=_user(script(engine, http, "Hi."))
    ) as stream:
        final = stream.get_final_message()
        assert stream.response.headers.get("request-id") == final.id
    counted = client.messages.with_raw_response.count_tokens(model=MODEL, messages=_user("x"))
    rid = counted.headers.get("request-id")
    assert rid and rid == counted.headers.get("x-request-id")
    with pytest.raises(anthropic.NotFoundError) as nf:
        client.messages.create(model="no-such-model", max_tokens=8, messages=_user("x"))
    assert nf.value.request_id and nf.value.request_id == nf.value.response.headers["x-request-id"]
    with pytest.raises(anthropic.BadRequestError) as br:
        client.messages.create(model=MODEL, max_tokens=8, messages=[])
    assert br.value.request_id
    # an answer no handler made (no such route; a body the server refused): request-id all the same
    base = str(client.base_url).rstrip("/")
    r = http.post(base + "/v1/messages/no-such-route", json={})
    assert r.status_code == 404 and r.headers.get("request-id") == r.headers.get("x-request-id")
    r = http.post(base + "/v1/messages", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.headers.get("request-id")


def test_effort_levels_of_the_sdk(
    client: anthropic.Anthropic, engine: MockEngineProc, http: httpx.Client
) -> None:
    for effort in ("xhigh", "max"):
        marker = script(engine, http, "ok")
        msg = client.messages.create(
            model=MODEL, max_tokens=8, messages=_user(marker), output_config={"effort": effort}
        )
        assert msg.content[0].type == "text" and msg.content[0].text == "ok"
    unknown: Any = {"effort": "extreme"}
    with pytest.raises(anthropic.BadRequestError, match="effort"):
        client.messages.create(model=MODEL, max_tokens=8, messages=_user("x"), output_config=unknown)


def test_thinking_between_tools_and_display_omitted(
    client: anthropic.Anthropic, engine: MockEngineProc, http: httpx.Client
) -> None:
    out = "<think>\nA secret chain.\n</think>\n\nThe answer."
    msg = client.messages.create(
        model=MODEL,
        max_tokens=2048,
        messages=_user(script(engine, http, out)),
        thinking={"type": "between_tools"},
    )
    assert [b.type for b in msg.content] == ["thinking", "text"]
    shown = msg.content[0]
    assert shown.type == "thinking" and "secret" in shown.thinking and shown.signature
    # display omitted: the block is there with its signature, its text is not (whole and streamed)
    thinking: Any = {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}
    msg = client.messages.create(
        model=MODEL, max_tokens=2048, messages=_user(script(engine, http, out)), thinking=thinking
    )
    assert [b.type for b in msg.content] == ["thinking", "text"]
    hidden = msg.content[0]
    assert hidden.type == "thinking" and hidden.thinking == "" and hidden.signature == shown.signature
    assert msg.content[1].type == "text" and msg.content[1].text == "The answer."
    with client.messages.stream(
        model=MODEL, max_tokens=2048, messages=_user(script(engine, http, out)), thinking=thinking
    ) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "thinking_delta" not in deltas and "signature_delta" in deltas
    block = final.content[0]
    assert block.type == "thinking" and block.thinking == "" and block.signature == shown.signature
    unknown: Any = {"type": "adaptive", "display": "all"}
    with pytest.raises(anthropic.BadRequestError, match="display"):
        client.messages.create(model=MODEL, max_tokens=2048, messages=_user("x"), thinking=unknown)


def test_empty_content(client: anthropic.Anthropic, engine: MockEngineProc, http: httpx.Client) -> None:
    """Anthropic refuses a message with empty content but the final assistant one; an empty final
    assistant turn is no prefill (the answer is a fresh turn: with thinking on, it thinks)."""
    for messages in (
        [{"role": "user", "content": []}],
        [{"role": "user", "content": ""}],
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": []},
            {"role": "user", "content": "b"},
        ],
    ):
        with pytest.raises(anthropic.BadRequestError, match="non-empty content") as e:
            client.messages.create(model=MODEL, max_tokens=8, messages=messages)  # type: ignore[arg-type]
        assert e.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    marker = script(engine, http, "<think>\nHm.\n</think>\n\nFresh.")
    msg = client.messages.create(
        model=MODEL,
        max_tokens=2048,
        messages=[{"role": "user", "content": marker}, {"role": "assistant", "content": ""}],
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[1].type == "text" and msg.content[1].text == "Fresh."
    # a non-empty final assistant turn still is a prefill
    marker = script(engine, http, " world!")
    msg = client.messages.create(
        model=MODEL,
        max_tokens=16,
        messages=[{"role": "user", "content": marker}, {"role": "assistant", "content": "Hello"}],
    )
    assert msg.content[0].type == "text" and msg.content[0].text == " world!"


def test_tool_choice_without_tools_in_anthropic_words(client: anthropic.Anthropic) -> None:
    choices: Any = ({"type": "any"}, {"type": "tool", "name": "get_weather"})
    for choice in choices:
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model=MODEL, max_tokens=8, messages=_user("x"), tool_choice=choice)
        message = e.value.body["error"]["message"]  # type: ignore[index]
        assert f"'{choice['type']}'" in message and "required" not in message


def test_a_route_not_served_answers_the_anthropic_sdk_in_its_envelope(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as e:
        client.beta.files.list()
    body: Any = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"


# ---- fixed by the sweep of Claude Code's shapes ----


def test_system_messages_in_the_conversation(
    client: anthropic.Anthropic, engine: MockEngineProc, http: httpx.Client
) -> None:
    """``role: system`` messages (the SDK's ``SystemMessageParam``, what Claude Code sends since 2.1.154)
    are system messages at their place in the prompt (they were a 400); the beta's ``clear_at:
    next_user_message`` drops one once a user message follows it."""
    rule = f"Answer in French {uuid.uuid4().hex[:8]}."
    # the answer is scripted for a prompt holding the system message right after the first user turn
    at_its_place = f"<|im_start|>user\nBonjour<|im_end|>\n<|im_start|>system\n{rule}<|im_end|>"
    script(engine, http, "Oui.", match=at_its_place)
    history: Any = [
        {"role": "user", "content": "Bonjour"},
        {
            "role": "system",
            "content": [{"type": "text", "text": rule, "cache_control": {"type": "ephemeral"}}],
        },
    ]
    msg = client.messages.create(model=MODEL, max_tokens=16, messages=history, system="Be brief.")
    assert msg.content[0].type == "text" and msg.content[0].text == "Oui."
    with client.messages.stream(
        model=MODEL,
        max_tokens=16,
        messages=[*history, {"role": "user", "content": script(engine, http, "Non.")}],
    ) as stream:
        assert stream.get_final_message().content[0].text == "Non."  # type: ignore[union-attr]
    counted = client.messages.count_tokens(model=MODEL, messages=history)
    assert counted.input_tokens > client.messages.count_tokens(model=MODEL, messages=history[:1]).input_tokens
    # cleared at the next user message: no longer in the prompt once one follows
    later: Any = [
        {"role": "user", "content": "Bonjour"},
        {"role": "system", "content": rule, "clear_at": "next_user_message"},
        {"role": "user", "content": "Encore"},
    ]
    without: Any = [{"role": "user", "content": "Bonjour\nEncore"}]
    cleared = client.beta.messages.count_tokens(model=MODEL, messages=later)
    assert cleared.input_tokens == client.messages.count_tokens(model=MODEL, messages=without).input_tokens
    image: Any = [history[0], {"role": "system", "content": [{"type": "image", "source": {}}]}]
    with pytest.raises(anthropic.BadRequestError, match="text blocks only"):
        client.messages.create(model=MODEL, max_tokens=8, messages=image)


def test_claude_codes_billing_header_is_not_in_the_prompt(
    client: anthropic.Anthropic, engine: MockEngineProc, http: httpx.Client
) -> None:
    """Claude Code's first system block, ``x-anthropic-billing-header: ...; cch=<hash>;``, changes with every
    request: dropped (as vLLM does), the prompt's prefix is the same from one request to the next and the
    engine's prefix cache holds it (it was a cache miss from the first tokens on)."""
    instructions = "You are an agent for software engineering. " * 24  # ~1 KB, ~1000 byte tokens

    def system(cch: str) -> Any:
        header = f"x-anthropic-billing-header: cc_version=2.1.177.01c; cc_entrypoint=cli; cch={cch};"
        return [
            {"type": "text", "text": header},
            {"type": "text", "text": instructions, "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        ]

    counted = client.messages.count_tokens(model=MODEL, system=system("36ee5"), messages=_user("x"))
    plain = client.messages.count_tokens(model=MODEL, system=instructions, messages=_user("x"))
    assert counted.input_tokens == plain.input_tokens
    for cch in ("0aaa9", "b71fe"):
        msg = client.messages.create(
            model=MODEL, max_tokens=8, system=system(cch), messages=_user(script(engine, http, "ok"))
        )
        assert msg.content[0].type == "text" and msg.content[0].text == "ok"
    # the second request read the system prompt from the engine's prefix cache
    assert (msg.usage.cache_read_input_tokens or 0) >= len(instructions) // 2, msg.usage


def test_an_interleaved_thinking_budget_may_exceed_max_tokens(
    client: anthropic.Anthropic, engine: MockEngineProc, http: httpx.Client
) -> None:
    """Under the interleaved-thinking beta (Claude Code sends it) the budget spans the turn's thinking
    blocks and may exceed ``max_tokens``, as Anthropic allows (it was a 400); without it, still a 400."""
    thinking: Any = {"type": "enabled", "budget_tokens": 4096}
    out = "<think>\nHm.\n</think>\n\nYes."
    msg = client.beta.messages.create(
        model=MODEL,
        max_tokens=2048,
        messages=_user(script(engine, http, out)),
        thinking=thinking,
        betas=["interleaved-thinking-2025-05-14", "fine-grained-tool-streaming-2025-05-14"],
    )
    assert [b.type for b in msg.content] == ["thinking", "text"]
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        client.messages.create(model=MODEL, max_tokens=2048, messages=_user("x"), thinking=thinking)


# ---- coverage ----


def test_tool_result_shapes(client: anthropic.Anthropic, engine: MockEngineProc, http: httpx.Client) -> None:
    """A tool loop with the SDK's own blocks sent back (model_dump: citations / caller None), tool_result
    content as a string, as text blocks with cache_control, empty, and is_error; a system of blocks."""
    marker = script(engine, http, "Let me look. " + CALL)
    first = client.messages.create(
        model=MODEL, max_tokens=256, messages=_user(f"weather? {marker}"), tools=TOOLS
    )
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["text", "tool_use"]
    use = first.content[1]
    assert use.type == "tool_use"
    results: list[Any] = [
        "21C",
        [
            {"type": "text", "text": "21C", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "sun"},
        ],
        None,
    ]
    system: Any = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    for content in results:
        for is_error in (False, True):
            answer = script(engine, http, "Noted.", match=f"after-{hash((str(content), is_error))}")
            block: Any = {"type": "tool_result", "tool_use_id": use.id, "is_error": is_error}
            if content is not None:
                block["content"] = content
            history: Any = [
                {"role": "user", "content": f"weather? {marker}"},
                {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {"role": "user", "content": [block, {"type": "text", "text": answer}]},
            ]
            counted = client.messages.count_tokens(model=MODEL, messages=history, tools=TOOLS, system=system)
            msg = client.messages.create(
                model=MODEL, max_tokens=64, messages=history, tools=TOOLS, system=system
            )
            assert msg.content[0].type == "text" and msg.content[0].text == "Noted."
            assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == counted.input_tokens


def test_stream_events_with_the_sdk(
    client: anthropic.Anthropic, engine: MockEngineProc, http: httpx.Client
) -> None:
    """stream=True: message_start first, blocks in order (start, deltas, stop), message_delta with the stop
    reason and usage, message_stop last; two parallel calls accumulate to valid inputs."""
    two = CALL + "\n" + CALL.replace("Paris", "Rome")
    events = list(
        client.messages.create(
            model=MODEL,
            max_tokens=512,
            messages=_user(script(engine, http, "Both. " + two)),
            tools=TOOLS,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e for e in events if e.type == "content_block_start"]
    assert [e.content_block.type for e in starts] == ["text", "tool_use", "tool_use"]
    for i in range(3):
        mine = [e.type for e in events if getattr(e, "index", None) == i]
        assert mine[0] == "content_block_start" and mine[-1] == "content_block_stop"
    delta = events[-2]
    assert (
        delta.type == "message_delta"
        and delta.delta.stop_reason == "tool_use"
        and delta.usage.output_tokens > 0
    )
    with client.messages.stream(
        model=MODEL, max_tokens=512, messages=_user(script(engine, http, two)), tools=TOOLS
    ) as stream:
        final = stream.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [{"city": "Paris"}, {"city": "Rome"}]
    # stop sequence and max_tokens, streamed
    with client.messages.stream(
        model=MODEL,
        max_tokens=64,
        messages=_user(script(engine, http, "one STOP two")),
        stop_sequences=["STOP"],
    ) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "STOP")
    with client.messages.stream(
        model=MODEL, max_tokens=3, messages=_user(script(engine, http, "a long answer"))
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 3


def test_client_gone_mid_stream_aborts_the_engine_call(
    client: anthropic.Anthropic, engine: MockEngineProc, http: httpx.Client
) -> None:
    mock = f"http://127.0.0.1:{engine.http_port}"
    http.post(f"{mock}/mock/faults", json={"stall_after_tokens": 2, "stall_seconds": 3.0}).raise_for_status()
    with client.messages.stream(model=MODEL, max_tokens=200, messages=_user("leave early")) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                break  # leaving the block closes the connection
    stats: Any = {}
    for _ in range(200):  # bounded: the abort reaches the engine well within
        stats = http.get(f"{mock}/mock/stats").json()
        if stats["active"] == 0:
            break
        time.sleep(0.05)
    assert stats["active"] == 0
    assert any(rid.partition(".")[2].startswith("msg_") for rid in stats["aborted"]), stats["aborted"]


def test_overloaded_is_529_and_retried(tokenizer_dir: Path) -> None:
    """No healthy worker: 529 overloaded_error, which the SDK retries (its retry count header says so)."""
    with (
        _node(tokenizer_dir, _port(), wait_ready=False) as node,  # a worker port nothing listens on
        anthropic.Anthropic(base_url=node.url, api_key="unused", max_retries=1, timeout=30) as c,
        pytest.raises(anthropic.OverloadedError) as e,
    ):
        c.messages.create(model=MODEL, max_tokens=8, messages=_user("x"))
    assert e.value.status_code == 529
    assert e.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    assert e.value.response.request.headers.get("x-stainless-retry-count") == "1"
    assert e.value.request_id  # (an error the error middleware made: its request-id too)
    assert e.value.response.headers["retry-after"] == "1"
    assert e.value.response.reason_phrase == "Overloaded"  # (no IANA phrase for 529: not "Unknown")
