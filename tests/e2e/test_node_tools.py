"""End to end: reasoning and tool calls through a real node, driven by the official openai SDK.

One mock engine and ONE node process serve a model per parser family (a ``models:`` list, each entry
with its real chat template, ``reasoning_parser`` and ``tool_call_parser``). The mock is told per
request what to answer (``/mock/responses``, matched on a marker in the user message), so each
family's real output format goes engine → node → client, streamed and not. Node and mock share a
byte-level tokenizer (see ``byte_tokenizer``); the real qwen3 tokenizer's splits of the same turns
are covered, at every split point, by tests/unit/test_chat_tools_pipeline.py.
"""

from __future__ import annotations

import functools
import json
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.node_procs import NodeProc, node_of_models
from tests.e2e.procs import MockEngineProc, start_mock_engine
from tests.unit.test_chat_tools_cases import (
    BY_MODEL,
    CASES,
    FAMILIES,
    TEMPLATES,
    TOOLS,
    Family,
    Turn,
    case_id,
    user_messages,
)


def byte_tokenizer(directory: Path) -> Path:
    """A byte-level BPE without merges (one token per byte, markers like ``<think>`` and
    ``<tool_call>`` as single added tokens, ``<|im_end|>`` the EOS): it carries every family's text
    through encode/decode unchanged, and loads in milliseconds where a real vocabulary takes seconds
    per served model (the node loads one tokenizer per model)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    markers = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in markers])
    specials = ["<|im_end|>", "<|endoftext|>", "<|im_start|>"]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "model_max_length": 65536}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def tokenizer_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        yield byte_tokenizer(Path(tmp) / "bytes")


@functools.cache
def _http() -> httpx.Client:
    """One client for the mock's control calls (a new httpx client costs tens of ms: TLS setup)."""
    return httpx.Client(timeout=5)


@pytest.fixture(scope="module")
def engine(tokenizer_dir: Path) -> Iterator[MockEngineProc]:
    with start_mock_engine(
        "--zero-latency", "--output-len", "16", "--tokenizer", str(tokenizer_dir), "--context-length", "65536"
    ) as e:
        try:
            yield e
        finally:
            _http().close()
            _http.cache_clear()


def worker_urls(port: int, n: int) -> list[str]:
    """``n`` distinct worker URLs for the one mock engine (a worker serves one model; workers are
    told apart by URL): SGLang, vLLM and auto-detected gRPC in turn, trailing slashes making the rest
    distinct (the client strips them)."""
    schemes = ("grpc", "sglang", "vllm")
    return [f"{schemes[i % 3]}://127.0.0.1:{port}" + "/" * (i // 3) for i in range(n)]


@pytest.fixture(scope="module")
def node(engine: MockEngineProc, tokenizer_dir: Path) -> Iterator[NodeProc]:
    urls = worker_urls(engine.grpc_port, len(FAMILIES))
    models = [
        {
            "name": f.model,
            "model_path": str(tokenizer_dir),
            "worker_urls": [url],
            "chat_template": str(TEMPLATES / f.template),
            "reasoning_parser": f.reasoning or "none",
            "tool_call_parser": f.tool or "none",
        }
        for f, url in zip(FAMILIES, urls, strict=True)
    ]
    with node_of_models(models) as n:
        yield n


@pytest.fixture(scope="module")
def client(node: NodeProc) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def script(engine: MockEngineProc, text: str, finish_reason: str | None = None) -> str:
    """Queue ``text`` as the answer to the next request whose prompt holds the returned marker."""
    marker = f"case-{uuid.uuid4().hex[:12]}"
    body: dict[str, Any] = {"text": text, "match": marker}
    if finish_reason:
        body["finish_reason"] = finish_reason
    r = _http().post(f"http://127.0.0.1:{engine.http_port}/mock/responses", json=body)
    assert r.status_code < 300, r.text
    return marker


def mock_constraints(engine: MockEngineProc) -> list[dict[str, Any]]:
    r = _http().get(f"http://127.0.0.1:{engine.http_port}/mock/stats")
    out: list[dict[str, Any]] = r.json()["constraints"]
    return out


def structured_message(msg: Any) -> tuple[str | None, str | None, list[tuple[str, Any]]]:
    extra = msg.model_extra or {}
    calls = [(tc.function.name, json.loads(tc.function.arguments)) for tc in msg.tool_calls or []]
    return extra.get("reasoning_content"), msg.content, calls


def stream_message(
    chunks: list[Any],
) -> tuple[tuple[str | None, str | None, list[tuple[str, Any]]], str | None]:
    content, reasoning = "", ""
    calls: dict[int, list[str]] = {}
    finish = None
    for ch in chunks:
        for c in ch.choices:
            d = c.delta
            content += d.content or ""
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            for tc in d.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.type == "function" and tc.function.name
                    calls[tc.index] = [tc.function.name, tc.function.arguments or ""]
                else:
                    assert tc.id is None and tc.function.name is None
                    calls[tc.index][1] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    parsed = [(name, json.loads(args)) for name, args in (calls[i] for i in sorted(calls))]
    return (reasoning or None, content or None, parsed), finish


def expected(turn: Turn) -> tuple[str | None, str | None, list[tuple[str, Any]]]:
    return turn.reasoning, turn.content, [(n, a) for n, a in turn.calls]


def ask(client: openai.OpenAI, family: Family, marker: str, **kw: Any) -> Any:
    kw.setdefault("tools", TOOLS)
    extra = kw.pop("extra_body", {})
    if family.kwargs:
        extra = {"chat_template_kwargs": family.kwargs, **extra}
    messages: Any = user_messages(marker)
    return client.chat.completions.create(
        model=family.model, messages=messages, extra_body=extra or None, **kw
    )


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_family_turn_round_trips(
    case: tuple[Family, Turn], client: openai.OpenAI, engine: MockEngineProc
) -> None:
    family, turn = case
    r = ask(client, family, script(engine, turn.output))
    c = r.choices[0]
    assert structured_message(c.message) == expected(turn)
    assert c.finish_reason == turn.finish_reason
    for tc in c.message.tool_calls or []:
        assert tc.type == "function" and tc.id
    chunks = list(ask(client, family, script(engine, turn.output), stream=True))
    got, finish = stream_message(chunks)
    assert got == expected(turn) and finish == turn.finish_reason


def test_sdk_stream_helper_assembles_the_calls(client: openai.OpenAI, engine: MockEngineProc) -> None:
    family = BY_MODEL["qwen3"]
    turn = next(t for t in family.turns if t.label == "several calls")
    with client.chat.completions.stream(
        model=family.model,
        messages=user_messages(script(engine, turn.output)),  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
    ) as s:
        done = s.get_final_completion()
    msg = done.choices[0].message
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in msg.tool_calls or []] == [
        (n, a) for n, a in turn.calls
    ]
    assert done.choices[0].finish_reason == "tool_calls"


def test_thinking_switched_off_by_the_template_kwargs(client: openai.OpenAI, engine: MockEngineProc) -> None:
    qwen = BY_MODEL["qwen3"]
    text = "<think>\nstays\n</think>\n\nHi"
    r = ask(
        client, qwen, script(engine, text), extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert structured_message(r.choices[0].message) == (None, text, [])
    ds = BY_MODEL["deepseek-v3.1"]  # thinks only with thinking: true
    r = ask(client, ds, script(engine, "Plain."), extra_body={"chat_template_kwargs": {"thinking": False}})
    assert structured_message(r.choices[0].message) == (None, "Plain.", [])


def test_tool_choice_none_parallel_false_and_unknown_tools(
    client: openai.OpenAI, engine: MockEngineProc
) -> None:
    qwen = BY_MODEL["qwen3"]
    turn = next(t for t in qwen.turns if t.label == "several calls")
    r = ask(client, qwen, script(engine, turn.output), tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == turn.output
    r = ask(client, qwen, script(engine, turn.output), parallel_tool_calls=False)
    assert [tc.function.name for tc in r.choices[0].message.tool_calls or []] == ["get_weather"]
    rogue = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    r = ask(client, qwen, script(engine, rogue))
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == rogue
    assert r.choices[0].finish_reason == "stop"


def test_required_tool_choice_reaches_the_engine_as_a_schema(
    client: openai.OpenAI, engine: MockEngineProc
) -> None:
    family = BY_MODEL["llama-3.1"]
    answer = '[{"name": "get_time", "parameters": {"tz": "CET"}}]'
    rid = f"req-{uuid.uuid4().hex[:8]}"
    r = ask(
        client,
        family,
        script(engine, answer),
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        extra_headers={"x-request-id": rid},
    )
    assert [(tc.function.name, tc.function.arguments) for tc in r.choices[0].message.tool_calls or []] == [
        ("get_time", '{"tz": "CET"}')
    ]
    # a call the request named finishes with "stop" (OpenAI's, vLLM's): it was asked for, not chosen
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content is None
    sent = [c for c in mock_constraints(engine) if c["request_id"].partition(".")[2] == rid]
    assert len(sent) == 1 and sent[0]["kind"] == "json_schema"
    schema = json.loads(sent[0]["value"])
    assert schema["items"]["properties"]["name"]["enum"] == ["get_time"]
    named: Any = {"type": "function", "function": {"name": "get_time"}}
    chunks = list(ask(client, family, script(engine, answer), tool_choice=named, stream=True))
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    required = ask(client, family, script(engine, answer), tool_choice="required")
    assert required.choices[0].finish_reason == "tool_calls" and required.choices[0].message.tool_calls


def test_allowed_tools_restricts_what_the_model_sees_and_may_call(
    client: openai.OpenAI, engine: MockEngineProc
) -> None:
    """OpenAI's ``tool_choice: {"type": "allowed_tools", ...}`` (the SDK's own type): ``required`` over the
    listed tools constrains the call array to them; ``auto`` leaves the model free among them; either
    way the prompt shows the model only those (the same prompt as a request given only them); a tool
    not in ``tools`` and a bad mode are 400s naming ``tool_choice``."""
    family = BY_MODEL["llama-3.1"]
    answer = '[{"name": "get_time", "parameters": {"tz": "CET"}}]'
    only_time: Any = {
        "type": "allowed_tools",
        "allowed_tools": {
            "mode": "required",
            "tools": [{"type": "function", "function": {"name": "get_time"}}],
        },
    }
    rid = f"req-{uuid.uuid4().hex[:8]}"
    r = ask(
        client, family, script(engine, answer), tool_choice=only_time, extra_headers={"x-request-id": rid}
    )
    assert r.choices[0].finish_reason == "tool_calls"
    assert [tc.function.name for tc in r.choices[0].message.tool_calls or []] == ["get_time"]
    sent = [c for c in mock_constraints(engine) if c["request_id"].partition(".")[2] == rid]
    assert len(sent) == 1 and sent[0]["kind"] == "json_schema"
    assert json.loads(sent[0]["value"])["items"]["properties"]["name"]["enum"] == ["get_time"]
    # auto: no constraint, and the prompt of a request that was given get_time alone
    only_time["allowed_tools"]["mode"] = "auto"
    time_tool = [t for t in TOOLS if t["function"]["name"] == "get_time"]
    allowed = ask(client, family, script(engine, "It is noon."), tool_choice=only_time)
    alone = ask(client, family, script(engine, "It is noon."), tools=time_tool)
    both = ask(client, family, script(engine, "It is noon."))
    assert allowed.choices[0].message.content == "It is noon."
    assert allowed.usage.prompt_tokens == alone.usage.prompt_tokens < both.usage.prompt_tokens
    for bad_choice in (
        {
            "type": "allowed_tools",
            "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {"name": "nope"}}]},
        },
        {"type": "allowed_tools", "allowed_tools": {"mode": "sometimes", "tools": time_tool}},
        {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}},
    ):
        with pytest.raises(openai.BadRequestError) as e:
            ask(client, family, script(engine, "x"), tool_choice=bad_choice)
        assert e.value.body["param"] == "tool_choice", e.value.body  # type: ignore[index]


def test_response_format_reaches_the_engine_and_is_checked(
    client: openai.OpenAI, engine: MockEngineProc, node: NodeProc
) -> None:
    family = BY_MODEL["qwen3"]
    schema = {"type": "object", "properties": {"t": {"type": "integer"}}, "required": ["t"]}
    rf: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    rid = f"req-{uuid.uuid4().hex[:8]}"
    raw = client.chat.completions.with_raw_response.create(
        model=family.model,
        messages=user_messages(script(engine, '{"t": 5}')),  # type: ignore[arg-type]
        response_format=rf,
        extra_headers={"x-request-id": rid},
    )
    assert raw.headers.get("x-smg-schema-violation") is None
    assert raw.parse().choices[0].message.content == '{"t": 5}'
    sent = [c for c in mock_constraints(engine) if c["request_id"].partition(".")[2] == rid]
    assert sent and sent[0]["kind"] == "json_schema" and json.loads(sent[0]["value"]) == schema
    # a violating answer, not strict: returned as generated, flagged in a header and on the choice
    raw = client.chat.completions.with_raw_response.create(
        model=family.model,
        messages=user_messages(script(engine, '{"t": "five"}')),  # type: ignore[arg-type]
        response_format=rf,
    )
    assert "'five' is not of type 'integer'" in (raw.headers.get("x-smg-schema-violation") or "")
    choice = raw.parse().choices[0]
    assert choice.message.content == '{"t": "five"}' and (choice.model_extra or {}).get("schema_violation")
    # strict: still the engine's answer with the violation reported, never a retryable 5xx (the opt-in
    # rejection, a 422, is tests/e2e/test_node_vllm_fields.py's)
    rf["json_schema"]["strict"] = True
    raw = client.chat.completions.with_raw_response.create(
        model=family.model,
        messages=user_messages(script(engine, "not json")),  # type: ignore[arg-type]
        response_format=rf,
    )
    assert raw.status_code == 200 and "not valid JSON" in (raw.headers.get("x-smg-schema-violation") or "")
    assert raw.parse().choices[0].message.content == "not json"
    bad = _http().post(
        node.url + "/v1/chat/completions",
        json={"model": family.model, "messages": user_messages(), "tool_choice": "required"},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"


def test_concurrent_requests_keep_their_own_parser_state(
    client: openai.OpenAI, engine: MockEngineProc
) -> None:
    picks = [CASES[i] for i in (2, 3, 1, 2)] + [c for c in CASES if c[0].model == "gpt-oss"][:2]
    markers = [script(engine, turn.output) for _, turn in picks]
    results: list[Any] = [None] * len(picks)

    def run(i: int) -> None:
        family, _ = picks[i]
        results[i] = stream_message(list(ask(client, family, markers[i], stream=True)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(picks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for (_, turn), got in zip(picks, results, strict=True):
        assert got == (expected(turn), turn.finish_reason)


def test_responses_reasoning_effort_turns_thinking_and_its_parser_on(
    client: openai.OpenAI, engine: MockEngineProc
) -> None:
    """The Responses API's ``reasoning.effort`` is the template's thinking switch (as chat's
    ``reasoning_effort``), so the parser splits what the model thought (DeepSeek V3.1 thinks only when
    asked); a model whose template has no switch takes it as a hint, not a 400."""
    ds = BY_MODEL["deepseek-v3.1"]
    r = client.responses.create(
        model=ds.model, input=script(engine, "Say hi.</think>Hello!"), reasoning={"effort": "high"}
    )
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text == "Hello!", r.output
    plain = client.responses.create(model=ds.model, input=script(engine, "Plain."))
    assert [o.type for o in plain.output] == ["message"] and plain.output_text == "Plain."
    llama = next(f for f in FAMILIES if f.reasoning is None)
    r = client.responses.create(model=llama.model, input=script(engine, "Hi."), reasoning={"effort": "low"})
    assert r.output_text == "Hi."


def test_messages_without_thinking_on_gpt_oss_show_the_final_channel(
    node: NodeProc, engine: MockEngineProc
) -> None:
    """gpt-oss's channels are parsed on the Messages API without ``thinking`` too: the final channel is
    the text, the analysis dropped (the raw harmony markup came back)."""
    text = "<|channel|>analysis<|message|>Say hi.<|end|><|start|>assistant<|channel|>final<|message|>Hello!"
    body = {
        "model": BY_MODEL["gpt-oss"].model,
        "max_tokens": 1024,  # (a byte-level tokenizer: a token a byte)
        "messages": [{"role": "user", "content": script(engine, text)}],
    }
    r = httpx.post(node.url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["content"] == [{"type": "text", "text": "Hello!"}], r.text


def test_gpt_oss_takes_a_function_without_description_or_parameters(
    client: openai.OpenAI, engine: MockEngineProc
) -> None:
    """OpenAI, vLLM (openai-harmony) and SMG take a function tool that has only a name; gpt-oss's
    template failed on the missing description (a 400)."""
    family = BY_MODEL["gpt-oss"]
    turn = next(t for t in family.turns if t.label == "several calls")
    bare: Any = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "get_time")]
    r = ask(client, family, script(engine, turn.output), tools=bare)
    assert structured_message(r.choices[0].message) == expected(turn)
    assert r.choices[0].finish_reason == "tool_calls"


def test_kimi_call_ids_are_unique_and_count_on_from_the_history(
    client: openai.OpenAI, engine: MockEngineProc
) -> None:
    """Kimi K2's ids are ``functions.NAME:N``, N counting the conversation's calls (its templates number
    them so): two calls the model wrote under one id (as a strict tool's structural tag has it write
    ``:0`` each time) are answered under two, after the history's, streamed and not, as SGLang and SMG
    answer them; a forced call gets one too."""
    family = BY_MODEL["kimi-k2"]
    weather = '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "%s"}'
    calls = (weather + "<|tool_call_end|>") * 2 % ("Paris", "Lyon")
    output = f"<|tool_calls_section_begin|>{calls}<|tool_calls_section_end|>"
    earlier = {
        "id": "functions.get_time:0",
        "type": "function",
        "function": {"name": "get_time", "arguments": "{}"},
    }

    def ask_after_a_call(answer: str, **kw: Any) -> Any:
        messages: Any = [
            *user_messages(),
            {"role": "assistant", "content": None, "tool_calls": [earlier]},
            {"role": "tool", "tool_call_id": earlier["id"], "content": "12:00"},
            {"role": "user", "content": f"And the weather? {script(engine, answer)}"},
        ]
        tools: Any = TOOLS
        return client.chat.completions.create(model=family.model, messages=messages, tools=tools, **kw)

    want = ["functions.get_weather:1", "functions.get_weather:2"]
    made = ask_after_a_call(output).choices[0].message.tool_calls or []
    assert [(tc.id, json.loads(tc.function.arguments)) for tc in made] == [
        (want[0], {"city": "Paris"}),
        (want[1], {"city": "Lyon"}),
    ]
    chunks = ask_after_a_call(output, stream=True)
    assert [tc.id for ch in chunks for c in ch.choices for tc in c.delta.tool_calls or [] if tc.id] == want
    forced = {"type": "function", "function": {"name": "get_time"}}
    made = ask_after_a_call('[{"name": "get_time", "parameters": {}}]', tool_choice=forced)
    assert [tc.id for tc in made.choices[0].message.tool_calls or []] == ["functions.get_time:1"]
