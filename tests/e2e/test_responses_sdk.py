"""End to end: the Responses API as strict clients see it — every streamed event and every Response
validated against openai-python's own models (``model_validate``: required fields enforced, which the
SDK's lenient parsing would not), the SDK's ``responses.stream`` / ``responses.parse`` helpers, and the
review's bugs: duplicate item ids (a 500), resent history items (twice in the prompt), an unanswered
``function_call_output``, the chain depth bound, output-text logprobs and reasoning token counts.

One mock engine and ONE node (qwen3's template and parsers over a byte-level tokenizer, as
tests/e2e/test_node_responses.py), its ``history_chain_max_depth`` small so the bound is reachable.
"""

from __future__ import annotations

import json
import typing
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel

from tests.e2e import node_fixtures, responses_fixtures
from tests.e2e.node_procs import NodeProc
from tests.e2e.procs import MockEngineProc
from tests.e2e.responses_fixtures import MODEL, TOOLS, qwen3_node, script

# the shared module-scoped fixtures, by their names (this module's own: node, _clean_mock)
tokenizer_dir, http = node_fixtures.tokenizer_dir, node_fixtures.http
engine, client = responses_fixtures.engine, responses_fixtures.client

CHAIN_DEPTH = 3
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _event_models() -> dict[str, type[BaseModel]]:
    out: dict[str, type[BaseModel]] = {}
    union = typing.get_args(ResponseStreamEvent)
    members = typing.get_args(union[0]) or union  # Annotated[Union[...], PropertyInfo]
    for cls in members:
        for lit in typing.get_args(cls.model_fields["type"].annotation):
            out[lit] = cls
    return out


EVENTS = _event_models()


@pytest.fixture(scope="module")
def node(engine: MockEngineProc, tokenizer_dir: Path) -> Iterator[NodeProc]:
    with qwen3_node(engine, tokenizer_dir, history_chain_max_depth=CHAIN_DEPTH) as n:
        yield n
        log = n.log()
        assert "Traceback" not in log, log[-4000:]


@pytest.fixture(autouse=True)
def _clean_mock(engine: MockEngineProc, http: httpx.Client) -> Iterator[None]:
    yield
    http.delete(f"http://127.0.0.1:{engine.http_port}/mock/responses")


def raw_events(node: NodeProc, http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The SSE events of a streamed create, each validated against openai-python's model of its type."""
    with http.stream("POST", node.url + "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        text = r.read().decode()
    events: list[dict[str, Any]] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        head, data = block.split("\n", 1)
        ev = json.loads(data.removeprefix("data: "))
        assert head == f"event: {ev['type']}"
        EVENTS[ev["type"]].model_validate(ev)  # raises on a missing / mistyped required field
        events.append(ev)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


# ---- shapes ---------------------------------------------------------------------------------------------


def test_streamed_events_and_final_response_validate_strictly(
    node: NodeProc, engine: MockEngineProc, http: httpx.Client
) -> None:
    marker = script(engine, http, f"<think>hmm</think>\n\nLet me check.{CALL}")
    events = raw_events(node, http, {"model": MODEL, "input": f"w {marker}", "tools": TOOLS})
    kinds = [e["type"].removeprefix("response.") for e in events]
    assert kinds == [
        "created",
        "in_progress",
        "output_item.added",
        "content_part.added",
        "reasoning_text.delta",
        "reasoning_text.done",
        "content_part.done",
        "output_item.done",
        "output_item.added",
        "content_part.added",
        "output_text.delta",
        "output_text.done",
        "content_part.done",
        "output_item.done",
        "output_item.added",
        "function_call_arguments.delta",
        "function_call_arguments.done",
        "output_item.done",
        "completed",
    ]
    final = Response.model_validate(events[-1]["response"])
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Let me check." and final.usage is not None
    assert final.usage.input_tokens_details.cache_write_tokens == 0
    assert final.usage.output_tokens_details.reasoning_tokens > 0
    args_done = events[16]
    assert args_done["arguments"] == '{"city": "Paris"}' and args_done["item_id"] == final.output[2].id
    incomplete = raw_events(node, http, {"model": MODEL, "input": "story", "max_output_tokens": 3})
    assert incomplete[-1]["type"] == "response.incomplete"
    r = Response.model_validate(incomplete[-1]["response"])
    assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"


def test_non_streamed_and_stored_responses_validate_strictly(
    node: NodeProc, engine: MockEngineProc, http: httpx.Client
) -> None:
    marker = script(engine, http, "<think>a b c</think>Plain.")
    body = http.post(node.url + "/v1/responses", json={"model": MODEL, "input": f"hi {marker}"}).json()
    r = Response.model_validate(body)
    assert r.output_text == "Plain." and r.usage is not None
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens
    Response.model_validate(http.get(f"{node.url}/v1/responses/{r.id}").json())


def test_sdk_stream_and_parse_helpers(
    client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client
) -> None:
    class Weather(BaseModel):
        city: str
        temp: int

    marker = script(engine, http, f"<think>x</think>{CALL}")
    with client.responses.stream(model=MODEL, input=f"w {marker}", tools=TOOLS) as s:
        for _ in s:
            pass
        final = s.get_final_response()
    assert [o.type for o in final.output] == ["reasoning", "function_call"]
    marker = script(engine, http, '{"city": "Paris", "temp": 20}')
    parsed = client.responses.parse(model=MODEL, input=f"json {marker}", text_format=Weather)
    assert parsed.output_parsed == Weather(city="Paris", temp=20)
    marker = script(engine, http, '{"city": "Oslo", "temp": 3}')
    with client.responses.stream(model=MODEL, input=f"json {marker}", text_format=Weather) as ps:
        for _ in ps:
            pass
        assert ps.get_final_response().output_parsed == Weather(city="Oslo", temp=3)


def test_output_text_logprobs_when_included(
    node: NodeProc, client: openai.OpenAI, http: httpx.Client
) -> None:
    r = client.responses.create(
        model=MODEL, input="hi", include=["message.output_text.logprobs"], top_logprobs=2, max_output_tokens=4
    )
    lps = r.output[0].content[0].logprobs  # type: ignore[union-attr,index]
    assert lps is not None and len(lps) == 4 and all(len(x.top_logprobs) == 2 for x in lps)
    events = raw_events(
        node,
        http,
        {"model": MODEL, "input": "hi", "include": ["message.output_text.logprobs"], "max_output_tokens": 4},
    )
    streamed = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    [done] = [e for e in events if e["type"] == "response.output_text.done"]
    assert len(streamed) == 4 and done["logprobs"] == streamed
    plain = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    assert plain.output[0].content[0].logprobs == []  # type: ignore[union-attr,index]


# ---- input items -----------------------------------------------------------------------------------------


def test_duplicate_item_ids_are_a_400_not_a_500(node: NodeProc, http: httpx.Client) -> None:
    item = {"type": "message", "id": "msg_dup_review", "role": "user", "content": "x"}
    r = http.post(node.url + "/v1/responses", json={"model": MODEL, "input": [item, dict(item, content="y")]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "input[1].id"


def test_resent_history_items_are_not_doubled_in_the_prompt(
    client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client
) -> None:
    thought = f"plan-{uuid.uuid4().hex[:10]}"
    marker = script(engine, http, f"<think>{thought}</think>{CALL}")
    r1 = client.responses.create(model=MODEL, input=f"w {marker}", tools=TOOLS)
    [call] = [o for o in r1.output if o.type == "function_call"]
    answer: Any = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    # the follow-up's prompt renders the reasoning of the call it answers (qwen3: after the last query)
    script(engine, http, "It is sunny.", match=f"<think>\n{thought}\n</think>")
    lean = client.responses.create(model=MODEL, previous_response_id=r1.id, tools=TOOLS, input=[answer])
    assert lean.output_text == "It is sunny."
    resent: Any = [*(o.model_dump(exclude_none=True) for o in r1.output), answer]
    again = client.responses.create(model=MODEL, previous_response_id=r1.id, tools=TOOLS, input=resent)
    assert lean.usage is not None and again.usage is not None
    assert again.usage.input_tokens == lean.usage.input_tokens
    items = client.responses.input_items.list(again.id)  # the chain's items, then its own: each once
    assert [i.type for i in items.data] == [
        "function_call_output",
        *[o.type for o in r1.output][::-1],
        "message",
    ]
    # stateless: the same items as the whole input work (the reasoning item feeds the template)
    stateless_input: Any = [{"role": "user", "content": "w"}, *resent]
    stateless = client.responses.create(model=MODEL, store=False, tools=TOOLS, input=stateless_input)
    assert stateless.status == "completed"


def test_function_call_output_without_its_call_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model=MODEL, input=[{"type": "function_call_output", "call_id": "call_nowhere", "output": "x"}]
        )
    assert "call_nowhere" in e.value.message


# ---- chains ----------------------------------------------------------------------------------------------


def test_chain_deeper_than_the_bound_is_a_400(client: openai.OpenAI) -> None:
    prev = None
    for i in range(CHAIN_DEPTH + 1):  # the last one continues a chain of exactly CHAIN_DEPTH
        prev = client.responses.create(
            model=MODEL, input=f"turn {i}", previous_response_id=prev.id if prev else openai.omit
        )
    assert prev is not None
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="one too many", previous_response_id=prev.id)
    assert e.value.status_code == 400 and "previous_response_id" in str(e.value.body)


def test_a_reused_client_item_id_keeps_what_each_request_sent(client: openai.OpenAI) -> None:
    """A client id such as ``msg_1`` reused with other content (or another tenant's): each response's
    input items show its own content, never the item stored first under that id."""
    iid = f"msg_client_{uuid.uuid4().hex[:8]}"

    def item(text: str) -> Any:
        return [{"id": iid, "role": "user", "content": text}]

    first = client.responses.create(model=MODEL, input=item("first text"))
    second = client.responses.create(model=MODEL, input=item("second text"), max_output_tokens=2)
    same = client.responses.create(model=MODEL, input=item("first text"), max_output_tokens=2)

    def sent(rid: str) -> list[tuple[str, str]]:
        return [(i.id, i.content[0].text) for i in client.responses.input_items.list(rid).data]  # type: ignore[union-attr,index]

    assert sent(first.id) == [(iid, "first text")]
    [(other_id, text)] = sent(second.id)
    assert text == "second text" and other_id != iid and other_id.startswith("msg_")
    assert sent(same.id) == [(iid, "first text")]  # the same item: referred to, not stored twice


def test_schemas_are_checked_after_the_model_lookup_and_bounded(node: NodeProc, http: httpx.Client) -> None:
    """An invalid schema is a 400 naming its field; an unknown model is a 404 before any schema work; a
    schema past the byte bound is refused by its size."""
    url = node.url + "/v1/responses"
    bad_schema = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": bad_schema}}
    r = http.post(url, json={"model": MODEL, "input": "hi", "text": fmt})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format.schema", r.text
    tool = {"type": "function", "name": "f", "parameters": bad_schema}
    r = http.post(url, json={"model": MODEL, "input": "hi", "tools": [tool]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].parameters", r.text
    r = http.post(url, json={"model": "no-such-model", "input": "hi", "text": fmt})
    assert r.status_code == 404, r.text
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(40_000)}}
    big = {"format": {"type": "json_schema", "name": "x", "schema": huge}}
    r = http.post(url, json={"model": MODEL, "input": "hi", "text": big})
    assert r.status_code == 400 and r.json()["error"]["code"] == "schema_too_large", r.text


def test_a_slow_first_token_opens_with_response_created(
    engine: MockEngineProc, tokenizer_dir: Path, http: httpx.Client
) -> None:
    """An engine silent before its first token (queued, prefilling): the headers go out a keep-alive
    interval after dispatch with ``response.created`` and ``response.in_progress`` (OpenAI and vLLM send
    them before any token), not comments only; they are not sent again when the tokens come."""
    faults = f"http://127.0.0.1:{engine.http_port}/mock/faults"
    with qwen3_node(engine, tokenizer_dir, sse_keepalive_secs=0.2) as n:
        http.post(faults, json={"hang_before_first_token": True}).raise_for_status()
        text = ""
        try:
            marker = script(engine, http, "Late.")
            body = {"model": MODEL, "input": f"late {marker}", "stream": True}
            with http.stream("POST", n.url + "/v1/responses", json=body) as r:
                assert r.status_code == 200
                for piece in r.iter_text():  # bounded: a comment every 0.2 s, the stream's end
                    text += piece
                    if text.count(": keep-alive") == 2:  # (the fault cleared: the engine answers now)
                        http.post(faults, json={"hang_before_first_token": False}).raise_for_status()
                    if text.count(": keep-alive") >= 6 and "event: " not in text:  # comments only: wrong
                        break
        finally:
            http.post(faults, json={"hang_before_first_token": False}).raise_for_status()
    assert text.startswith("event: response.created\n"), text[:200]
    kinds = [line.removeprefix("event: ") for line in text.split("\n") if line.startswith("event: ")]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds.count("response.created") == 1 and kinds[-1] == "response.completed", kinds
    seqs = [json.loads(line[6:])["sequence_number"] for line in text.split("\n") if line.startswith("data: ")]
    assert seqs == list(range(len(kinds))), seqs


# ---- agent clients: Codex CLI, the OpenAI Agents SDK ---------------------------------------------------

SHELL: Any = [  # Codex CLI's shell tool: a function tool, not strict
    {
        "type": "function",
        "name": "shell",
        "description": "Runs a shell command and returns its output.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "array", "items": {"type": "string"}},
                "workdir": {"type": "string"},
            },
            "required": ["command"],
            "additionalProperties": False,
        },
    }
]
SHELL_CALL = '<tool_call>\n{"name": "shell", "arguments": {"command": ["ls"]}}\n</tool_call>'


def codex_turn(client: openai.OpenAI, items: list[Any]) -> list[Any]:
    """One turn as Codex CLI sends it (codex-rs ``ResponsesApiRequest``: store false, streamed, the
    reasoning blob asked for, its thread id as the cache key, its client metadata), and the items of its
    ``response.output_item.done`` events: what Codex keeps of a turn."""
    stream = client.responses.create(
        model=MODEL,
        instructions="You are Codex, a coding agent.",
        input=items,
        tools=SHELL,
        tool_choice="auto",
        parallel_tool_calls=False,
        reasoning={"effort": "medium", "summary": "auto"},
        store=False,
        stream=True,
        include=["reasoning.encrypted_content"],
        prompt_cache_key=str(uuid.uuid4()),
        text={"verbosity": "medium"},
        extra_headers={"originator": "codex_cli_rs"},
        extra_body={"client_metadata": {"x-codex-installation-id": "test"}},
    )
    with stream:
        events = list(stream)
    assert events[-1].type == "response.completed", events[-1]
    return [e.item for e in events if e.type == "response.output_item.done"]


def codex_item(item: Any, keep_text: bool = True) -> dict[str, Any]:
    """An output item as Codex sends it back (codex-rs ``ResponseItem``: no ids; a reasoning item's
    ``content`` only when it holds reasoning text, else null, and its ``encrypted_content`` as given)."""
    if item.type == "reasoning":
        content = [c.model_dump() for c in item.content or ()] if keep_text else None
        return {
            "type": "reasoning",
            "summary": [],
            "content": content,
            "encrypted_content": item.encrypted_content,
        }
    if item.type == "function_call":
        return {
            "type": "function_call",
            "name": item.name,
            "arguments": item.arguments,
            "call_id": item.call_id,
        }
    return {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": c.text} for c in item.content],
    }


def codex_first_turn(
    client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client
) -> tuple[str, list[Any]]:
    """(the reasoning text, Codex's next input: the turn's question, its answer's items and the call's
    output) of a turn whose answer reasons, then calls the shell tool."""
    thought = f"plan-{uuid.uuid4().hex[:10]}"
    marker = script(engine, http, f"<think>{thought}</think>{SHELL_CALL}")
    question = [
        {
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": "<permissions/>"}],
        },
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": f"list files {marker}"}],
        },
    ]
    reasoning, call = codex_turn(client, question)
    assert (reasoning.type, call.type) == ("reasoning", "function_call")
    blob = reasoning.encrypted_content
    assert isinstance(blob, str) and thought not in blob  # opaque
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "a.txt\nb.txt"}
    return thought, [*question, reasoning, call, output]


def test_codex_turns_keep_their_reasoning_through_encrypted_content(
    client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client
) -> None:
    """``include: ["reasoning.encrypted_content"]`` with ``store: false``: the reasoning item carries an
    opaque blob, and the next turn's prompt renders the reasoning it seals as the model's own (qwen3: the
    think block of the call its output answers), whether the item comes back whole (Codex) or as the blob
    alone (the Vercel AI SDK, pydantic-ai keep no text)."""
    thought, turn = codex_first_turn(client, engine, http)
    for keep_text in (True, False):
        answer = f"files-{uuid.uuid4().hex[:8]}"
        script(engine, http, answer, match=f"<think>\n{thought}\n</think>")
        sent = [codex_item(it, keep_text) if isinstance(it, BaseModel) else it for it in turn]
        [message] = codex_turn(client, sent)
        assert message.type == "message" and message.content[0].text == answer


def test_a_blob_that_is_not_this_nodes_is_ignored(
    client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client
) -> None:
    """A damaged blob, or another server's (OpenAI's), is not refused (an agent that comes from another
    server keeps its session) and renders nothing; the item's own text still does."""
    thought, turn = codex_first_turn(client, engine, http)
    answer = f"seen-{uuid.uuid4().hex[:8]}"
    script(
        engine, http, answer, match=f"<think>\n{thought}\n</think>"
    )  # (consumed by the turn that renders it)
    blob = turn[2].encrypted_content
    damaged = blob[:-8] + ("A" * 8 if not blob.endswith("A" * 8) else "B" * 8)
    openai_blob = "gAAAAABo-an-openai-blob"
    for foreign in (damaged, openai_blob):
        item: Any = {"type": "reasoning", "summary": [], "content": None, "encrypted_content": foreign}
        [message] = codex_turn(client, [*turn[:2], item, codex_item(turn[3]), turn[4]])
        assert message.content[0].text != answer
    text = [{"type": "reasoning_text", "text": thought}]
    item = {"type": "reasoning", "summary": [], "content": text, "encrypted_content": openai_blob}
    [message] = codex_turn(client, [*turn[:2], item, codex_item(turn[3]), turn[4]])
    assert message.content[0].text == answer


def test_agents_sdk_turns_with_its_settings_and_replayed_items(
    client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client
) -> None:
    """A run as openai-agents' ``OpenAIResponsesModel`` makes it: every request field its ``ModelSettings``
    map to, a first turn answered whole (``get_response``), the next streamed (``responses.stream``) with
    the first one's output items sent back as the SDK dumps them (``model_dump(exclude_unset=True)``:
    ids, statuses, the reasoning's text and blob) and the tool's output paired by ``call_id``."""
    settings: dict[str, Any] = {
        "model": MODEL,
        "instructions": "You are a weather agent.",
        "tools": TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "truncation": "auto",
        "store": False,
        "include": ["reasoning.encrypted_content", "message.output_text.logprobs"],
        "top_logprobs": 1,
        "reasoning": {"effort": "low", "summary": "auto"},
        "text": {"format": {"type": "text"}, "verbosity": "low"},
        "metadata": {"agent": "weather"},
        "prompt_cache_key": "run-1",
        "prompt_cache_retention": "24h",
        "service_tier": "auto",
        "user": "user-1",
        "safety_identifier": "safety-1",
        "extra_headers": {"User-Agent": "Agents/Python 0.6.0"},
    }
    thought = f"plan-{uuid.uuid4().hex[:10]}"
    marker = script(engine, http, f"<think>{thought}</think>Let me check.{CALL}")
    question: Any = [{"role": "user", "content": f"weather in Paris? {marker}"}]
    first = client.responses.create(input=question, **settings)
    Response.model_validate(first.model_dump())
    assert [o.type for o in first.output] == ["reasoning", "message", "function_call"]
    reasoning, _, call = first.output
    assert reasoning.type == "reasoning" and isinstance(reasoning.encrypted_content, str)
    assert call.type == "function_call"
    answer = f"sunny-{uuid.uuid4().hex[:8]}"
    script(engine, http, answer, match=f"<think>\n{thought}\n</think>")
    replay = [o.model_dump(exclude_unset=True) for o in first.output]
    assert replay[0]["id"].startswith("rs_") and replay[2]["status"] == "completed"
    follow_up: Any = [
        *question,
        *replay,
        {"call_id": call.call_id, "output": "22C", "type": "function_call_output"},
    ]
    with client.responses.stream(input=follow_up, **settings) as s:
        for _ in s:
            pass
        second = s.get_final_response()
    assert second.status == "completed" and second.output_text == answer
    assert second.prompt_cache_key == "run-1" and second.metadata == {"agent": "weather"}


def test_allowed_tools_choice_limits_the_calls_and_is_echoed(
    client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client
) -> None:
    """``tool_choice: {"type": "allowed_tools", "mode": "required", "tools": [...]}`` (the SDK's
    ``ToolChoiceAllowedParam``): the call comes from the listed tools only; the response object echoes the
    choice as sent and every tool the request gave."""
    get_time: Any = {
        "type": "function",
        "name": "get_time",
        "description": "Current time of a timezone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
        "strict": False,
    }
    choice: Any = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "get_weather"}],
    }
    marker = script(engine, http, '[{"name": "get_weather", "parameters": {"city": "Paris"}}]')
    r = client.responses.create(
        model=MODEL, input=f"weather {marker}", tools=[*TOOLS, get_time], tool_choice=choice
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert r.tool_choice.type == "allowed_tools" and r.tool_choice.mode == "required"  # type: ignore[union-attr]
    assert [t.name for t in r.tools] == ["get_weather", "get_time"]  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model=MODEL,
            input="x",
            tools=TOOLS,
            tool_choice={
                "type": "allowed_tools",
                "mode": "auto",
                "tools": [{"type": "function", "name": "get_time"}],
            },
        )
    assert e.value.body["param"] == "tool_choice" and "get_time" in e.value.body["message"]  # type: ignore[index]
