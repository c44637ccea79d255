"""End to end: the stateful Responses API through a real mock engine and a real node on loopback, driven
by the official openai SDK unchanged.

One mock engine and ONE node serve ``qwen3`` (its real chat template, the qwen3 reasoning parser and
the hermes tool-call parser) over a byte-level tokenizer (tests/e2e/test_node_tools.py). The mock is
told per request what to answer (``/mock/responses``, matched on a marker in the rendered prompt): a
script matching text that only an earlier turn holds shows that the node rebuilt the history.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e import node_fixtures, responses_fixtures
from tests.e2e.node_procs import NodeProc
from tests.e2e.procs import MockEngineProc
from tests.e2e.responses_fixtures import MODEL, TOOLS, qwen3_node, script

# the shared module-scoped fixtures, by their names (this module's own: node, _clean_mock)
tokenizer_dir, http = node_fixtures.tokenizer_dir, node_fixtures.http
engine, client = responses_fixtures.engine, responses_fixtures.client


@pytest.fixture(scope="module")
def node(engine: MockEngineProc, tokenizer_dir: Path) -> Iterator[NodeProc]:
    with qwen3_node(engine, tokenizer_dir) as n:
        yield n


@pytest.fixture(autouse=True)
def _clean_mock(engine: MockEngineProc, http: httpx.Client) -> Iterator[None]:
    yield
    base = f"http://127.0.0.1:{engine.http_port}"
    http.delete(f"{base}/mock/responses")
    http.post(
        f"{base}/mock/faults",
        json={"stall_after_tokens": None, "stall_seconds": 0.0, "hang_before_first_token": False},
    )


def faults(engine: MockEngineProc, http: httpx.Client, **kw: Any) -> None:
    r = http.post(f"http://127.0.0.1:{engine.http_port}/mock/faults", json=kw)
    assert r.status_code < 300, r.text


# ---- create / retrieve ----------------------------------------------------------------------------------


def test_non_stream_text_then_retrieve(
    client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client
) -> None:
    marker = script(engine, http, "Hello there.")
    r = client.responses.create(
        model=MODEL, input=f"Hi {marker}", instructions="Be brief.", metadata={"k": "v"}
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.output_text == "Hello there."
    [msg] = r.output
    assert msg.type == "message" and msg.id.startswith("msg_") and msg.role == "assistant"
    assert msg.content[0].type == "output_text" and msg.content[0].annotations == []
    assert r.instructions == "Be brief." and r.metadata == {"k": "v"} and r.model_extra is not None
    assert r.model_extra["store"] is True
    assert r.usage is not None and r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == "Hello there." and got.status == "completed"


def test_max_output_tokens_is_incomplete(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=4)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 4


def test_stream_events(client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client) -> None:
    marker = script(engine, http, "Streaming works fine.")
    events = list(client.responses.create(model=MODEL, input=f"go {marker}", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == "Streaming works fine."
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == deltas and final.status == "completed"
    assert final.usage is not None and final.usage.output_tokens > 0
    assert client.responses.retrieve(final.id).output_text == deltas


def test_stream_helper(client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client) -> None:
    marker = script(engine, http, "Helper text.")
    with client.responses.stream(model=MODEL, input=f"go {marker}") as s:
        for _ in s:
            pass
        final = s.get_final_response()
    assert final.output_text == "Helper text."


def test_stream_has_no_done_line(node: NodeProc, http: httpx.Client) -> None:
    with http.stream(
        "POST", node.url + "/v1/responses", json={"model": MODEL, "input": "x", "stream": True}
    ) as r:
        body = r.read().decode()
    assert r.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in body and body.startswith("event: response.created\ndata: ")


# ---- history -------------------------------------------------------------------------------------------


def test_chain_rebuilds_the_prompt_without_old_instructions(
    client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client
) -> None:
    tag = uuid.uuid4().hex[:10]
    m1 = script(engine, http, f"answer-one-{tag}")
    r1 = client.responses.create(model=MODEL, input=f"first {m1}", instructions=f"instr-{tag}")
    assert r1.output_text == f"answer-one-{tag}"
    # turn 2's prompt holds turn 1's answer (the script matches it) but not turn 1's instructions
    script(engine, http, "LEAKED", match=f"instr-{tag}")
    script(engine, http, f"answer-two-{tag}", match=f"answer-one-{tag}")
    r2 = client.responses.create(model=MODEL, input="second", previous_response_id=r1.id)
    assert r2.output_text == f"answer-two-{tag}" and r2.previous_response_id == r1.id
    http.delete(f"http://127.0.0.1:{engine.http_port}/mock/responses")
    script(engine, http, f"answer-three-{tag}", match=f"first {m1}")
    r3 = client.responses.create(model=MODEL, input="third", previous_response_id=r2.id, stream=False)
    assert r3.output_text == f"answer-three-{tag}"
    assert r1.usage and r2.usage and r3.usage
    assert r1.usage.input_tokens < r2.usage.input_tokens < r3.usage.input_tokens


def test_input_items_list_the_context_the_response_continued(client: openai.OpenAI) -> None:
    """As OpenAI's: the chain's (or the conversation's earlier) items, then the response's own input;
    a conversation's later turns are not a response's input."""

    def said(rid: str) -> list[tuple[str, str]]:
        items = client.responses.input_items.list(rid, order="asc").data
        return [(i.role, i.content[0].text) for i in items]  # type: ignore[union-attr,index]

    r1 = client.responses.create(model=MODEL, input="first", max_output_tokens=4)
    r2 = client.responses.create(model=MODEL, input="second", previous_response_id=r1.id, max_output_tokens=4)
    assert said(r1.id) == [("user", "first")]
    assert said(r2.id) == [("user", "first"), ("assistant", r1.output_text), ("user", "second")]
    conv = client.conversations.create(items=[{"role": "user", "content": "hello"}])
    c1 = client.responses.create(model=MODEL, input="q1", conversation=conv.id, max_output_tokens=4)
    c2 = client.responses.create(model=MODEL, input="q2", conversation=conv.id, max_output_tokens=4)
    assert said(c1.id) == [("user", "hello"), ("user", "q1")]
    assert said(c2.id) == [("user", "hello"), ("user", "q1"), ("assistant", c1.output_text), ("user", "q2")]
    page = client.responses.input_items.list(c2.id, limit=2)  # newest first, paged
    assert [i.content[0].text for i in page.data] == ["q2", c1.output_text]  # type: ignore[union-attr,index]
    assert page.has_more


def test_input_items_once_listed_follow_an_item_deleted_from_the_conversation(client: openai.OpenAI) -> None:
    """The node keeps a listed response's context ids (paging walks it once): an item unlinked from the
    conversation since is gone from its pages as it is from a node that walks the context now (full
    pages, the same ``has_more``), not a short page or a page of nothing that says there is more."""
    conv = client.conversations.create(items=[{"role": "user", "content": f"m{i}"} for i in range(3)])
    r = client.responses.create(model=MODEL, input="q", conversation=conv.id, max_output_tokens=2)
    before = client.responses.input_items.list(r.id, order="asc").data  # (the context, kept)
    assert [i.content[0].text for i in before] == ["m0", "m1", "m2", "q"]  # type: ignore[union-attr,index]
    client.conversations.items.delete(str(before[0].id), conversation_id=conv.id)
    page = client.responses.input_items.list(r.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == ["m1", "m2"] and page.has_more  # type: ignore[union-attr,index]
    last = client.responses.input_items.list(r.id, order="desc", limit=3)
    assert [i.content[0].text for i in last.data] == ["q", "m2", "m1"] and not last.has_more  # type: ignore[union-attr,index]
    every = list(client.responses.input_items.list(r.id, order="asc", limit=1))
    assert [i.content[0].text for i in every] == ["m1", "m2", "q"]  # type: ignore[union-attr,index]


def test_request_fields_the_response_echoes(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=MODEL, input="x", max_tool_calls=3, prompt_cache_key="k-1", max_output_tokens=2
    )
    assert (r.max_tool_calls, r.prompt_cache_key) == (3, "k-1")
    assert client.responses.retrieve(r.id).prompt_cache_key == "k-1"
    plain = client.responses.create(model=MODEL, input="x", max_output_tokens=2)
    assert (plain.max_tool_calls, plain.prompt_cache_key) == (None, None)


def test_unknown_previous_response_is_openais_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_" + "0" * 48)
    assert "not found" in str(ei.value) and ei.value.code == "previous_response_not_found"
    assert ei.value.param == "previous_response_id"


def test_store_false_is_not_retrievable(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="x", store=False)
    assert (r.model_extra or {})["store"] is False and r.status == "completed"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="y", previous_response_id=r.id)


def test_delete_then_retrieve_is_404(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="x")
    client.responses.delete(r.id)  # the SDK returns None for this call; the body is checked below
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    r2 = client.responses.create(model=MODEL, input="x")
    raw = httpx.delete(str(client.base_url) + f"responses/{r2.id}", timeout=10)
    assert raw.json() == {"id": r2.id, "object": "response.deleted", "deleted": True}


def test_input_items_pagination(client: openai.OpenAI) -> None:
    inp: Any = [{"role": "user", "content": f"message {i}"} for i in range(5)]
    r = client.responses.create(model=MODEL, input=inp)
    page = client.responses.input_items.list(r.id, limit=2, order="asc")
    assert page.has_more and len(page.data) == 2
    every: list[Any] = list(client.responses.input_items.list(r.id, limit=2, order="asc"))
    texts = [it.content[0].text for it in every]
    assert texts == [f"message {i}" for i in range(5)]
    desc: Any = client.responses.input_items.list(r.id)
    assert [it.content[0].text for it in desc.data] == [f"message {i}" for i in reversed(range(5))]
    assert not desc.has_more and desc.first_id == desc.data[0].id and desc.last_id == desc.data[-1].id


def test_previous_and_conversation_together_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(
            model=MODEL, input="x", previous_response_id="resp_" + "0" * 48, conversation="conv_" + "0" * 48
        )
    assert "previous_response_id" in str(ei.value)


def test_conversation_turns(client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client) -> None:
    conv = client.conversations.create()
    tag = uuid.uuid4().hex[:10]
    m1 = script(engine, http, f"conv-answer-{tag}")
    r1 = client.responses.create(model=MODEL, input=f"hello {m1}", conversation=conv.id)
    assert r1.conversation is not None and r1.conversation.id == conv.id
    script(engine, http, f"conv-second-{tag}", match=f"conv-answer-{tag}")
    r2 = client.responses.create(model=MODEL, input="and then?", conversation={"id": conv.id})
    assert r2.output_text == f"conv-second-{tag}"
    items = list(client.conversations.items.list(conv.id, order="asc"))
    assert [it.type for it in items] == ["message"] * 4
    assert [getattr(it, "role", None) for it in items] == ["user", "assistant", "user", "assistant"]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", conversation="conv_" + "0" * 48)


def test_reused_items_join_the_conversation(
    client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client
) -> None:
    """Items a conversation turn reuses (an ``item_reference``, an earlier response's output sent back,
    untyped references as the SDK's ItemReference allows) are added to the conversation with the turn
    (OpenAI: "input items and output items from this response are automatically added"): the next turn's
    model sees them."""
    fact = f"fact-{uuid.uuid4().hex[:10]}"
    r0 = client.responses.create(model=MODEL, input=f"remember {fact}")
    ref = client.responses.input_items.list(r0.id).data[0].id
    for typed in (True, False):
        conv = client.conversations.create()
        item: dict[str, Any] = {"type": "item_reference", "id": ref} if typed else {"id": ref}
        sent_back = r0.output[0].model_dump(exclude_none=True)
        turn: Any = [item, sent_back, {"role": "user", "content": "q"}]
        client.responses.create(model=MODEL, conversation=conv.id, input=turn)
        items = list(client.conversations.items.list(conv.id, order="asc"))
        texts = [json.dumps(it.model_dump()) for it in items]
        assert len(items) == 4 and fact in texts[0] and ref not in {it.id for it in items}, texts
        seen = f"seen-{uuid.uuid4().hex[:8]}"
        script(engine, http, seen, match=fact)
        assert client.responses.create(model=MODEL, conversation=conv.id, input="next").output_text == seen


def test_a_chain_from_a_conversation_turn_keeps_the_conversation(
    client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client
) -> None:
    """``previous_response_id`` naming a response made in a conversation continues its whole context:
    the conversation's items from before it too (they are in its input items); once the conversation is
    deleted, the response's input items are its own, not a 404."""
    name = f"name-{uuid.uuid4().hex[:10]}"
    conv = client.conversations.create(
        items=[{"role": "user", "content": f"my name is {name}"}, {"role": "assistant", "content": "noted"}]
    )
    r1 = client.responses.create(model=MODEL, conversation=conv.id, input="q1")
    seen = f"seen-{uuid.uuid4().hex[:8]}"
    script(engine, http, seen, match=name)
    r2 = client.responses.create(model=MODEL, previous_response_id=r1.id, input="what is my name?")
    assert r2.output_text == seen
    listed = [json.dumps(it.model_dump()) for it in client.responses.input_items.list(r2.id, order="asc")]
    assert name in listed[0] and len(listed) == 5, listed
    r3 = client.responses.create(model=MODEL, conversation=conv.id, input="q3")
    client.conversations.delete(conv.id)
    own = list(client.responses.input_items.list(r3.id))
    assert [json.dumps(it.model_dump()).count("q3") for it in own] == [1]


def _locked(client: openai.OpenAI, conv: str) -> None:
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model=MODEL, input="meanwhile?", conversation=conv)
    err: Any = ei.value.body
    assert (err["code"], err["param"]) == ("conversation_locked", "conversation"), err


@pytest.mark.parametrize("mode", ["stream", "whole", "background"])
def test_one_turn_at_a_time_on_a_conversation(
    client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client, mode: str
) -> None:
    """A second turn while one is in progress on the conversation is OpenAI's 400 conversation_locked
    (both would answer the same history); once the turn ends, the next is taken, and sees it."""
    conv = client.conversations.create().id
    faults(engine, http, stall_after_tokens=1, stall_seconds=2.0)
    box: list[Any] = []

    def first() -> None:
        if mode == "stream":
            with client.responses.stream(model=MODEL, input="a slow one", conversation=conv) as st:
                box.append(st.get_final_response())
        else:
            box.append(client.responses.create(model=MODEL, input="a slow one", conversation=conv))

    if mode == "background":
        r = client.responses.create(model=MODEL, input="a slow one", conversation=conv, background=True)
        assert r.status in ("queued", "in_progress")
        _locked(client, conv)
        for _ in range(200):  # bounded: the stall is 2 s
            if client.responses.retrieve(r.id).status == "completed":
                break
            time.sleep(0.05)
    else:
        t = threading.Thread(target=first)
        t.start()
        for _ in range(300):  # bounded: it holds the conversation once the engine runs it (then stalls)
            if http.get(f"{engine.http_url}/mock/stats").json()["active"] >= 1:
                break
            time.sleep(0.01)
        _locked(client, conv)
        t.join(timeout=30)
        assert box and box[0].status == "completed"
    faults(engine, http, stall_after_tokens=None, stall_seconds=0.0)
    nxt = client.responses.create(model=MODEL, input="and now?", conversation=conv)
    assert nxt.status == "completed"
    roles = [getattr(it, "role", None) for it in client.conversations.items.list(conv, order="asc")]
    assert roles == ["user", "assistant", "user", "assistant"]  # the refused turn left nothing


# ---- tools and reasoning ---------------------------------------------------------------------------------


def _hermes(name: str, args: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def test_function_tool_round_trip(client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client) -> None:
    marker = script(engine, http, _hermes("get_weather", {"city": "Paris"}))
    r1 = client.responses.create(model=MODEL, input=f"Weather in Paris? {marker}", tools=TOOLS)
    calls = [o for o in r1.output if o.type == "function_call"]
    assert len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.id and call.id.startswith("fc_") and call.call_id
    assert r1.tools[0].type == "function" and r1.tools[0].name == "get_weather"
    tag = uuid.uuid4().hex[:8]
    script(engine, http, "It is sunny in Paris.", match=f"sunny-{tag}")
    r2 = client.responses.create(
        model=MODEL,
        previous_response_id=r1.id,
        tools=TOOLS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": f"sunny-{tag}"}],
    )
    assert r2.output_text == "It is sunny in Paris."
    items = client.responses.input_items.list(r2.id).data
    assert items[0].type == "function_call_output" and items[0].id.startswith("fco_")
    # a call left without its output is OpenAI's 400, from the history or from the input
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, previous_response_id=r1.id, tools=TOOLS, input="and now?")
    assert e.value.param == "input"
    assert f"No tool output found for function call {call.call_id}" in str(e.value)
    dangling: Any = [
        {"type": "function_call", "call_id": "call_x1", "name": "get_weather", "arguments": "{}"},
        {"role": "user", "content": "and now?"},
    ]
    with pytest.raises(openai.BadRequestError, match="call_x1"):
        client.responses.create(model=MODEL, tools=TOOLS, input=dangling)


def test_function_call_streamed(client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client) -> None:
    marker = script(engine, http, _hermes("get_weather", {"city": "Oslo"}))
    events = list(client.responses.create(model=MODEL, input=f"Oslo? {marker}", tools=TOOLS, stream=True))
    kinds = [e.type for e in events]
    assert (
        "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    )
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"city": "Oslo"}
    final = events[-1].response  # type: ignore[union-attr]
    assert [o.type for o in final.output] == ["function_call"]


def test_reasoning_items(client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client) -> None:
    text = "<think>\nPondering.\n</think>\n\nDone."
    marker = script(engine, http, text)
    r = client.responses.create(model=MODEL, input=f"think {marker}")
    assert [o.type for o in r.output] == ["reasoning", "message"]
    rs = r.output[0]
    assert rs.id.startswith("rs_") and rs.content and rs.content[0].text == "Pondering.\n"  # type: ignore[union-attr]
    assert r.output_text == "Done."
    marker = script(engine, http, text)
    events = list(client.responses.create(model=MODEL, input=f"think {marker}", stream=True))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == "Pondering.\n"
    final = events[-1].response  # type: ignore[union-attr]
    assert [o.type for o in final.output] == ["reasoning", "message"] and final.output_text == "Done."
    # the follow-up renders the stored reasoning as the template expects (not as answer text)
    tag = uuid.uuid4().hex[:8]
    script(engine, http, f"follow-{tag}", match="Done.")
    r2 = client.responses.create(model=MODEL, input="more", previous_response_id=r.id)
    assert r2.output_text == f"follow-{tag}"


def test_text_format_json_schema(client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client) -> None:
    schema = {"type": "object", "properties": {"t": {"type": "integer"}}, "required": ["t"]}
    marker = script(engine, http, '{"t": 5}')
    fmt: Any = {"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}}
    r = client.responses.create(
        model=MODEL,
        input=f"json {marker}",
        text=fmt,
    )
    assert json.loads(r.output_text) == {"t": 5}
    assert r.text is not None and r.text.format is not None and r.text.format.type == "json_schema"
    sent = http.get(f"http://127.0.0.1:{engine.http_port}/mock/stats").json()["constraints"]
    mine = [c for c in sent if c["request_id"].partition(".")[2] == r.id]
    assert mine and mine[0]["kind"] == "json_schema" and json.loads(mine[0]["value"]) == schema


# ---- background, cancel, disconnect ---------------------------------------------------------------------


def test_background_completes(client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client) -> None:
    marker = script(engine, http, "Background answer.")
    r = client.responses.create(model=MODEL, input=f"bg {marker}", background=True)
    assert r.status in ("queued", "in_progress") and r.background is True
    for _ in range(500):  # bounded poll: the mock answers at once
        got = client.responses.retrieve(r.id)
        if got.status not in ("queued", "in_progress"):
            break
    assert got.status == "completed" and got.output_text == "Background answer."
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="x", background=True, store=False)


def _first_tokens(node: NodeProc, http: httpx.Client) -> float:
    """How many answers' first tokens the node has had (its TTFT histogram's count)."""
    for line in http.get(node.url + "/metrics").text.splitlines():
        if line.startswith("smg_time_to_first_token_seconds_count{") and f'model="{MODEL}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_background_cancel(
    client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client, node: NodeProc
) -> None:
    faults(engine, http, stall_after_tokens=1, stall_seconds=60.0)
    before = _first_tokens(node, http)
    r = client.responses.create(model=MODEL, input="slow one", background=True)
    # a follow-up of a response still generating would not see its answer: a 400, not a shorter history
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="and then?", previous_response_id=r.id)
    assert e.value.code == "previous_response_in_progress"
    for _ in range(400):  # bounded: its first token is in the node (the engine sends it, then stalls)
        if _first_tokens(node, http) > before:
            break
        time.sleep(0.05)
    c = client.responses.cancel(r.id)
    assert c.status == "cancelled"
    got = client.responses.retrieve(r.id)
    # what it had made is kept, as a streamed one keeps it: its message, incomplete
    assert got.status == "cancelled" and got.output_text, got
    assert getattr(got.output[-1], "status", None) == "incomplete"
    faults(engine, http, stall_after_tokens=None, stall_seconds=0.0)
    fg = client.responses.create(model=MODEL, input="x", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(fg.id)


def _seqs_and_text(events: list[Any]) -> tuple[list[int], str]:
    return [e.sequence_number for e in events], "".join(
        e.delta for e in events if e.type == "response.output_text.delta"
    )


def test_background_stream_resumes_from_any_sequence_number(
    client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client, node: NodeProc
) -> None:
    """``background`` with ``stream``: the creating stream may go away (the response goes on), and
    ``retrieve(stream=True, starting_after=N)`` gives the events after N, live then replayed once
    ended, numbered as the first stream numbered them (the official SDK on both calls)."""
    answer = "One two three four five six seven eight."
    marker = script(engine, http, answer)
    faults(engine, http, stall_after_tokens=3, stall_seconds=1.5)
    first: list[Any] = []
    with client.responses.create(model=MODEL, input=f"bg {marker}", background=True, stream=True) as s:
        for ev in s:
            first.append(ev)
            if ev.type == "response.output_text.delta":
                break  # the client goes away mid-answer: the response goes on without it
    rid = first[0].response.id
    assert first[0].type == "response.created" and first[0].response.background is True
    assert [e.type for e in first[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert [e.response.status for e in first[:3]] == ["queued", "queued", "in_progress"]
    seqs, head = _seqs_and_text(first)
    assert seqs == list(range(len(first))) and head
    k = seqs[-1]
    rest = list(client.responses.retrieve(rid, stream=True, starting_after=k))
    rseqs, tail = _seqs_and_text(rest)
    assert rseqs == list(range(k + 1, k + 1 + len(rest)))  # (the events after k, none twice or missed)
    assert rest[-1].type == "response.completed" and head + tail == answer
    assert rest[-1].response.output_text == answer
    # ended: the whole stream again, from its record, the same events
    again = list(client.responses.retrieve(rid, stream=True))
    assert [e.sequence_number for e in again] == list(range(len(first) + len(rest)))
    assert [e.model_dump() for e in again[k + 1 :]] == [e.model_dump() for e in rest]
    assert [e.type for e in again[: k + 1]] == [e.type for e in first]
    assert list(client.responses.retrieve(rid, stream=True, starting_after=len(again) + 5)) == []
    got = http.get(f"{node.url}/v1/responses/{rid}").json()  # the kept events are never answered
    assert got["status"] == "completed" and not [key for key in got if key.startswith("_")]


def test_background_stream_refusals(client: openai.OpenAI, node: NodeProc, http: httpx.Client) -> None:
    fg = client.responses.create(model=MODEL, input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:  # not created streaming in the background
        list(client.responses.retrieve(fg.id, stream=True))
    assert e.value.param == "stream"
    bg = client.responses.create(model=MODEL, input="y", max_output_tokens=2, background=True, stream=True)
    opening: Any = next(iter(bg))  # response.created
    rid = opening.response.id
    bg.close()
    for bad_value in ("-1", "x", "1.5"):
        r = http.get(f"{node.url}/v1/responses/{rid}", params={"stream": "true", "starting_after": bad_value})
        assert r.status_code == 400 and r.json()["error"]["param"] == "starting_after", r.text
    r = http.get(f"{node.url}/v1/responses/{rid}", params={"stream": "maybe"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


def test_background_stream_refuses_what_the_model_cannot_take(client: openai.OpenAI) -> None:
    """A prompt or ``max_output_tokens`` beyond the context is the request's 400, as without
    ``background`` (not a 200 stream of a response stored failed)."""
    for stream in (True, False):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(
                model=MODEL, input="x", max_output_tokens=10**9, background=True, stream=stream
            )
        assert e.value.code == "context_length_exceeded"


@pytest.mark.parametrize("hang", ["before_first_token", "after_two_tokens"])
def test_background_stream_cancelled_ends_its_readers(
    client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client, hang: str
) -> None:
    """The creator has the response (its id) at once, before the engine's first token; a cancel ends
    every reader's stream, the creator's too."""
    if hang == "before_first_token":
        faults(engine, http, hang_before_first_token=True)
    else:
        faults(engine, http, stall_after_tokens=2, stall_seconds=60.0)
    s = client.responses.create(model=MODEL, input="slow and streamed", background=True, stream=True)
    events = iter(s)
    opening: Any = next(events)  # response.created
    rid = opening.response.id
    if hang == "before_first_token":  # the creator stays on: its stream ends with the cancel
        mine: list[Any] = []
        creator = threading.Thread(target=lambda: mine.extend(events), daemon=True)
        creator.start()
    else:
        s.close()
    got: list[Any] = []

    def follow() -> None:
        got.extend(client.responses.retrieve(rid, stream=True))

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    time.sleep(0.3)
    assert client.responses.cancel(rid).status == "cancelled"
    reader.join(timeout=30)
    assert not reader.is_alive()  # the cancel ended its stream, with the cancelled Response
    assert got and got[0].type == "response.created" and got[-1].type == "response.cancelled"
    end: Any = got[-1]  # (not one of the SDK's event types: its fields as sent)
    assert end.response["status"] == "cancelled" and end.sequence_number == len(got) - 1
    assert client.responses.retrieve(rid).status == "cancelled"
    if hang == "before_first_token":
        creator.join(timeout=30)
        assert not creator.is_alive() and [e.type for e in mine] == [
            "response.queued",
            "response.in_progress",
            "response.cancelled",
        ]
    # read again from the record: the same end
    again = list(client.responses.retrieve(rid, stream=True))
    assert [e.type for e in again] == [e.type for e in got]
    faults(engine, http, hang_before_first_token=False)


def test_client_disconnect_stores_incomplete(
    client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client, node: NodeProc
) -> None:
    faults(engine, http, stall_after_tokens=3, stall_seconds=60.0)
    rid = ""
    with http.stream(
        "POST", node.url + "/v1/responses", json={"model": MODEL, "input": "tell me", "stream": True}
    ) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and not rid:
                rid = json.loads(line[6:])["response"]["id"]
            if "response.output_text.delta" in line:
                break
    assert rid
    got = None
    for _ in range(2000):  # bounded poll: the node notices the disconnect, then stores (404 until then)
        try:
            got = client.responses.retrieve(rid)
        except openai.NotFoundError:
            continue
        break
    assert got is not None and got.status == "incomplete"
    assert got.output and got.output[0].type == "message"


def test_retrieve_unknown_is_openai_404(node: NodeProc, http: httpx.Client) -> None:
    r = http.get(node.url + "/v1/responses/resp_nope")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "resp_nope" in err["message"]
