"""End to end: the request fields vLLM and SGLang users send, through a real node over the mock engine,
with the clients that send them (the official openai SDK, vLLM's fields in ``extra_body``; plain
httpx for SGLang's fields and scripts).

What is checked, each against what reached the engine (the mock records every request's constraint,
``/mock/stats`` ``constraints``, and answers scripted text only to a prompt holding a marker, so a
rendered prompt is asserted by the answer it gets):

- constrained decoding: ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``,
  ``structured_outputs`` (vLLM: vllm/entrypoints/openai/protocol.py, vllm/sampling_params.py
  StructuredOutputsParams), SGLang's ``regex`` / ``ebnf`` / ``json_schema``
  (sglang/srt/entrypoints/openai/protocol.py) reach a vLLM and an SGLang worker as the constraint of
  their protocol (smg-grpc-proto ``SamplingParams.constraint``), or are a 400 naming the field;
- ``developer`` messages, ``reasoning_effort``, ``reasoning`` / ``reasoning_content`` (answers and
  history), ``model`` omitted, ``stream_options.continuous_usage_stats``, legacy ``functions``;
- strict schemas: a violation is the engine's answer with the violation reported, one generation per
  ``parse()`` (the SDK retries 5xx), or a 422 with ``--reject-schema-violations``.
"""

from __future__ import annotations

import json
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pydantic
import pytest
import yaml

from tests.e2e import node_fixtures
from tests.e2e.node_fixtures import QWEN3_TEMPLATE, TEMPLATES
from tests.e2e.node_procs import NodeProc, running_node
from tests.e2e.procs import MockEngineProc, start_mock_engine

tokenizer_dir, http = node_fixtures.tokenizer_dir, node_fixtures.http

SG, VL, LLAMA, OSS, RELAY = "qwen3-sglang", "qwen3-vllm", "llama", "gpt-oss", "relay"
COHERE = "cohere"  # a RAG template: it renders `documents`
BOS = "bos"  # a tokenizer that puts a BOS before a text it encodes with special tokens (as Llama's)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
        },
    }
]


@pytest.fixture(scope="module")
def engine(tokenizer_dir: Path) -> Iterator[MockEngineProc]:
    with start_mock_engine(
        "--zero-latency", "--output-len", "8", "--tokenizer", str(tokenizer_dir), "--context-length", "65536"
    ) as e:
        yield e


def bos_tokenizer(tokenizer_dir: Path, directory: Path) -> Path:
    """``tokenizer_dir``'s byte-level tokenizer (the engine's), its ``<|im_start|>`` a BOS that encoding
    with special tokens puts first (a post-processor, as Llama 3's tokenizer has)."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    bos = "<|im_start|>"
    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)]
    )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": bos}))
    return directory


@pytest.fixture(scope="module")
def node(engine: MockEngineProc, tokenizer_dir: Path) -> Iterator[NodeProc]:
    """One node, seven models over the one mock: Qwen3 on an SGLang and on a vLLM worker, Llama 3.1 (no
    developer role, no thinking switch), gpt-oss (both), Cohere's RAG template, a model whose tokenizer
    adds a BOS, and a model relayed to the mock's OpenAI HTTP server."""
    g = f"127.0.0.1:{engine.grpc_port}"

    def model(name: str, url: str, template: Path, reasoning: str, tool: str) -> dict[str, Any]:
        return {
            "name": name,
            "model_path": str(tokenizer_dir),
            "worker_urls": [url],
            "chat_template": str(template),
            "reasoning_parser": reasoning,
            "tool_call_parser": tool,
        }

    models = [
        model(SG, f"sglang://{g}", QWEN3_TEMPLATE, "qwen3", "hermes"),
        model(VL, f"vllm://{g}", QWEN3_TEMPLATE, "qwen3", "hermes"),
        model(LLAMA, f"grpc://{g}/", TEMPLATES / "meta-llama-Llama-3.1-8B-Instruct.jinja", "none", "none"),
        model(OSS, f"sglang://{g}/", TEMPLATES / "openai-gpt-oss-120b.jinja", "none", "none"),
        model(COHERE, f"vllm://{g}/", TEMPLATES / "Cohere2MoE.jinja", "none", "none"),
        model(RELAY, f"http://127.0.0.1:{engine.http_port}", QWEN3_TEMPLATE, "none", "none"),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        bos = model(BOS, f"grpc://{g}//", QWEN3_TEMPLATE, "none", "none")
        models.append({**bos, "model_path": str(bos_tokenizer(tokenizer_dir, Path(tmp) / "bos"))})
        cfg = Path(tmp) / "node.yaml"
        cfg.write_text(yaml.safe_dump({"models": models, "tokenizer_workers": 0}))
        with running_node("--config", str(cfg)) as n:
            yield n


@pytest.fixture(scope="module")
def strict_node(engine: MockEngineProc, tokenizer_dir: Path) -> Iterator[NodeProc]:
    """One model (so ``model`` may be left out), strict violations rejected, reasoning as vLLM names it."""
    with running_node(
        *node_fixtures.qwen3_flags(engine, tokenizer_dir),
        *("--reasoning-parser", "qwen3", "--reasoning-field", "reasoning", "--reject-schema-violations"),
    ) as n:
        yield n


@pytest.fixture(scope="module")
def client(node: NodeProc) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def script(engine: MockEngineProc, http: httpx.Client, text: str, match: str) -> None:
    """Queue ``text`` as the answer to the next request whose decoded prompt holds ``match``."""
    r = http.post(f"http://127.0.0.1:{engine.http_port}/mock/responses", json={"text": text, "match": match})
    assert r.status_code < 300, r.text


def sent(engine: MockEngineProc, http: httpx.Client, rid: str) -> list[dict[str, Any]]:
    """The constraints the engine got for the requests of client request id ``rid``."""
    got = http.get(f"http://127.0.0.1:{engine.http_port}/mock/stats").json()["constraints"]
    return [c for c in got if c["request_id"].partition(".")[2] == rid]  # (a unique token, then rid)


def rid() -> str:
    return f"req-{uuid.uuid4().hex[:12]}"


def user(text: str = "Hello") -> Any:  # the SDK types messages as TypedDicts
    return [{"role": "user", "content": text}]


# ---- constrained decoding ----------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"t": {"type": "integer"}}, "required": ["t"]}
GRAMMAR = 'root ::= "yes" | "no"'

# (extra_body, vLLM's constraint, SGLang's constraint) as the engines' protos name them
GUIDED_CASES: list[tuple[dict[str, Any], tuple[str, Any], tuple[str, Any]]] = [
    ({"guided_json": SCHEMA}, ("json_schema", SCHEMA), ("json_schema", SCHEMA)),
    ({"guided_json": json.dumps(SCHEMA)}, ("json_schema", SCHEMA), ("json_schema", SCHEMA)),
    ({"guided_regex": r"\d{3}"}, ("regex", r"\d{3}"), ("regex", r"\d{3}")),
    ({"guided_grammar": GRAMMAR}, ("grammar", GRAMMAR), ("ebnf_grammar", GRAMMAR)),
    (
        {"guided_choice": ["yes", 'say "no"']},
        ("choice", ["yes", 'say "no"']),
        ("ebnf_grammar", 'root ::= "yes" | "say \\"no\\""'),
    ),
    ({"structured_outputs": {"json": SCHEMA}}, ("json_schema", SCHEMA), ("json_schema", SCHEMA)),
    ({"structured_outputs": {"regex": "a+"}}, ("regex", "a+"), ("regex", "a+")),
    (
        {"structured_outputs": {"choice": ["x", "y"]}},
        ("choice", ["x", "y"]),
        ("ebnf_grammar", 'root ::= "x" | "y"'),
    ),
    ({"structured_outputs": {"grammar": GRAMMAR}}, ("grammar", GRAMMAR), ("ebnf_grammar", GRAMMAR)),
    (
        {"structured_outputs": {"json_object": True}},
        ("json_object", True),
        ("json_schema", {"type": "object"}),
    ),
    (
        {"structured_outputs": {"structural_tag": '{"type": "structural_tag"}'}},
        ("structural_tag", '{"type": "structural_tag"}'),
        ("structural_tag", '{"type": "structural_tag"}'),
    ),
    ({"regex": "b+"}, ("regex", "b+"), ("regex", "b+")),
    ({"ebnf": GRAMMAR}, ("grammar", GRAMMAR), ("ebnf_grammar", GRAMMAR)),
    ({"json_schema": json.dumps(SCHEMA)}, ("json_schema", SCHEMA), ("json_schema", SCHEMA)),
]


def _value(kind: str, value: Any) -> Any:
    return json.loads(value) if kind == "json_schema" else value


@pytest.mark.parametrize(("fields", "vllm", "sglang"), GUIDED_CASES, ids=lambda v: str(v)[:40])
def test_guided_fields_reach_the_engine_as_its_constraint(
    client: openai.OpenAI,
    node: NodeProc,
    engine: MockEngineProc,
    http: httpx.Client,
    fields: dict[str, Any],
    vllm: tuple[str, Any],
    sglang: tuple[str, Any],
) -> None:
    # vLLM users: the openai SDK with the fields in extra_body
    r1 = rid()
    r = client.chat.completions.create(
        model=VL, messages=user(), extra_body=fields, extra_headers={"x-request-id": r1}, max_tokens=4
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    got = sent(engine, http, r1)
    assert [(c["kind"], _value(c["kind"], c["value"])) for c in got] == [vllm]
    # SGLang users: a script posting JSON
    r2 = rid()
    resp = http.post(
        node.url + "/v1/chat/completions",
        json={"model": SG, "messages": user(), "max_tokens": 4, **fields},
        headers={"x-request-id": r2},
    )
    assert resp.status_code == 200, resp.text
    got = sent(engine, http, r2)
    assert [(c["kind"], _value(c["kind"], c["value"])) for c in got] == [sglang]


def test_guided_fields_on_completions(node: NodeProc, engine: MockEngineProc, http: httpx.Client) -> None:
    r1 = rid()
    resp = http.post(
        node.url + "/v1/completions",
        json={"model": VL, "prompt": "Say", "max_tokens": 4, "guided_choice": ["a", "b"]},
        headers={"x-request-id": r1},
    )
    assert resp.status_code == 200, resp.text
    assert [(c["kind"], c["value"]) for c in sent(engine, http, r1)] == [("choice", ["a", "b"])]


@pytest.mark.parametrize(
    ("model", "fields", "param"),
    [
        (VL, {"guided_regex": "a", "regex": "b"}, "regex"),
        (VL, {"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, "guided_json"),
        (VL, {"structured_outputs": {"regex": "a", "choice": ["x"]}}, "structured_outputs.choice"),
        (
            VL,
            {"structured_outputs": {"disable_any_whitespace": True, "regex": "a"}},
            "structured_outputs.disable_any_whitespace",
        ),
        (VL, {"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn"),
        (VL, {"guided_choice": "yes"}, "guided_choice"),
        (VL, {"guided_json": "{not json"}, "guided_json"),
        (VL, {"guided_json": {"type": 12}}, "guided_json"),  # not a schema (meta-validated)
        (VL, {"guided_regex": "a", "tools": TOOLS, "tool_choice": "required"}, "guided_regex"),
        (RELAY, {"guided_json": SCHEMA}, "guided_json"),  # an HTTP worker: unknown whether it reads it
        (RELAY, {"ebnf": GRAMMAR}, "ebnf"),
    ],
)
def test_constraints_an_engine_cannot_honour_are_a_400_naming_the_field(
    client: openai.OpenAI,
    engine: MockEngineProc,
    http: httpx.Client,
    model: str,
    fields: dict[str, Any],
    param: str,
) -> None:
    r1 = rid()
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(
            model=model, messages=user(), extra_body=fields, extra_headers={"x-request-id": r1}
        )
    assert ei.value.body["param"] == param, ei.value.body  # type: ignore[index]
    assert sent(engine, http, r1) == []


# ---- roles, reasoning, model --------------------------------------------------------------------------


def test_developer_becomes_system_when_the_template_has_no_developer_role(
    client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client
) -> None:
    # Qwen3's template renders no developer role at all: the message would vanish from the prompt
    marker = uuid.uuid4().hex[:10]
    script(engine, http, "as system", f"<|im_start|>system\nBe terse {marker}<|im_end|>")
    r = client.chat.completions.create(
        model=SG, messages=[{"role": "developer", "content": f"Be terse {marker}"}, *user()]
    )
    assert r.choices[0].message.content == "as system"


def test_developer_kept_and_reasoning_effort_passed_when_the_template_has_them(
    client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client
) -> None:
    # gpt-oss's template names the developer role and reads reasoning_effort
    marker = uuid.uuid4().hex[:10]
    script(
        engine,
        http,
        "as developer",
        "Reasoning: low\n\n# Valid channels: analysis, commentary, final. Channel must be included for "
        f"every message.<|end|><|start|>developer<|message|># Instructions\n\nBe terse {marker}",
    )
    r = client.chat.completions.create(
        model=OSS,
        messages=[{"role": "developer", "content": f"Be terse {marker}"}, *user()],
        reasoning_effort="low",
    )
    assert r.choices[0].message.content == "as developer"


def test_reasoning_effort_maps_to_qwen3_enable_thinking(
    client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client
) -> None:
    marker = uuid.uuid4().hex[:10]
    # "none": enable_thinking false, so the template closes the think block itself, and no reasoning
    # parser runs on the answer
    script(
        engine,
        http,
        "<think>kept</think>plain",
        f"{marker}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>",
    )
    r = client.chat.completions.create(model=SG, messages=user(marker), reasoning_effort="none")
    assert r.choices[0].message.content == "<think>kept</think>plain"
    marker = uuid.uuid4().hex[:10]
    script(engine, http, "<think>thought</think>answer", f"{marker}<|im_end|>\n<|im_start|>assistant\n")
    r = client.chat.completions.create(model=SG, messages=user(marker), reasoning_effort="high")
    assert r.choices[0].message.content == "answer"
    assert (r.choices[0].message.model_extra or {}).get("reasoning") == "thought"


def test_reasoning_effort_without_a_thinking_switch_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=LLAMA, messages=user(), reasoning_effort="high")
    assert ei.value.body["param"] == "reasoning_effort"  # type: ignore[index]


def test_reasoning_answered_under_both_names_and_accepted_in_history(
    client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client
) -> None:
    marker = uuid.uuid4().hex[:10]
    script(engine, http, "<think>pondering</think>Done.", marker)
    r = client.chat.completions.create(model=SG, messages=user(marker))
    extra = r.choices[0].message.model_extra or {}
    assert (extra.get("reasoning"), extra.get("reasoning_content")) == ("pondering", "pondering")
    assert r.choices[0].message.content == "Done."
    marker = uuid.uuid4().hex[:10]
    script(engine, http, "<think>again</think>Streamed.", marker)
    chunks = list(client.chat.completions.create(model=SG, messages=user(marker), stream=True))
    deltas = [c.choices[0].delta.model_extra or {} for c in chunks if c.choices]
    assert "".join(d.get("reasoning") or "" for d in deltas) == "again"
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "again"
    # history: an assistant turn sent back with vLLM's "reasoning" is rendered as the template's
    # reasoning (Qwen3 renders it for the turn after the last user message: a tool round trip)
    marker = uuid.uuid4().hex[:10]
    script(engine, http, "It is noon.", f"<think>\nthought {marker}\n</think>")
    history: list[Any] = [
        *user("What time is it?"),
        {
            "role": "assistant",
            "content": "",
            "reasoning": f"thought {marker}",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"tz": "CET"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]
    r = client.chat.completions.create(model=SG, messages=history, tools=TOOLS)  # type: ignore[arg-type]
    assert r.choices[0].message.content == "It is noon."


def test_reasoning_field_flag_and_model_optional_with_one_model(
    strict_node: NodeProc, engine: MockEngineProc, http: httpx.Client, node: NodeProc
) -> None:
    marker = uuid.uuid4().hex[:10]
    script(engine, http, "<think>hmm</think>Yes.", marker)
    r = http.post(strict_node.url + "/v1/chat/completions", json={"messages": user(marker)})  # no model
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "qwen3"
    msg = body["choices"][0]["message"]
    assert msg["reasoning"] == "hmm" and "reasoning_content" not in msg and msg["content"] == "Yes."
    r = http.post(strict_node.url + "/v1/completions", json={"prompt": "Say", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "qwen3", r.text
    # several models served: a 400 naming the field
    r = http.post(node.url + "/v1/chat/completions", json={"messages": user()})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


# ---- usage, legacy functions -----------------------------------------------------------------------------


CONTINUOUS: Any = {"include_usage": True, "continuous_usage_stats": True}  # vLLM's key: not in the SDK's type


def test_continuous_usage_stats_put_usage_on_every_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=VL,
            messages=user(),
            stream=True,
            max_tokens=6,
            stream_options=CONTINUOUS,
        )
    )
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    counts = [c.usage.completion_tokens for c in with_choices if c.usage is not None]
    assert counts == sorted(counts) and counts[0] == 0
    last = chunks[-1]
    assert not last.choices and last.usage is not None and last.usage.completion_tokens == 6
    assert counts[-1] == 6 and all(
        c.usage and c.usage.prompt_tokens == last.usage.prompt_tokens for c in with_choices
    )
    # without the option: usage only at the end
    plain = list(
        client.chat.completions.create(
            model=VL, messages=user(), stream=True, max_tokens=6, stream_options={"include_usage": True}
        )
    )
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


def test_legacy_functions_are_answered_as_function_call(
    client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client
) -> None:
    functions: Any = [TOOLS[0]["function"]]
    call = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    marker = uuid.uuid4().hex[:10]
    script(engine, http, call, marker)
    r = client.chat.completions.create(model=SG, messages=user(marker), functions=functions)
    choice = r.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    assert choice.message.function_call is not None
    assert (choice.message.function_call.name, json.loads(choice.message.function_call.arguments)) == (
        "get_time",
        {"tz": "CET"},
    )
    marker = uuid.uuid4().hex[:10]
    script(engine, http, call, marker)
    chunks = list(
        client.chat.completions.create(
            model=SG, messages=user(marker), functions=functions, function_call="auto", stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    fc = [d.function_call for d in deltas if d.function_call is not None]
    assert fc and fc[0].name == "get_time" and all(d.tool_calls is None for d in deltas)
    assert json.loads("".join(f.arguments or "" for f in fc)) == {"tz": "CET"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "function_call"
    # a legacy history: the assistant's function_call and the function's answer reach the template as a
    # tool call and its tool answer
    marker = uuid.uuid4().hex[:10]
    script(
        engine,
        http,
        "It is noon.",
        '"arguments": {"tz": "CET"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n'
        f"12:00 {marker}\n</tool_response>",
    )
    history: Any = [
        *user("What time is it?"),
        {
            "role": "assistant",
            "content": None,
            "function_call": {"name": "get_time", "arguments": '{"tz": "CET"}'},
        },
        {"role": "function", "name": "get_time", "content": f"12:00 {marker}"},
    ]
    r = client.chat.completions.create(model=SG, messages=history, functions=functions)
    assert r.choices[0].message.content == "It is noon." and r.choices[0].finish_reason == "stop"
    # function_call "none": no call is parsed
    marker = uuid.uuid4().hex[:10]
    script(engine, http, "No call.", marker)
    r = client.chat.completions.create(
        model=SG, messages=user(marker), functions=functions, function_call="none"
    )
    assert r.choices[0].message.content == "No call." and r.choices[0].message.function_call is None
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=SG, messages=user(), functions=functions, tools=TOOLS)  # type: ignore[arg-type]
    assert ei.value.body["param"] == "functions"  # type: ignore[index]


# ---- strict schemas ----------------------------------------------------------------------------------------


class Reading(pydantic.BaseModel):
    t: int


def test_a_strict_schema_violation_is_the_answer_reported_one_generation(
    node: NodeProc, engine: MockEngineProc, http: httpx.Client
) -> None:
    # the SDK's default retries on: a retryable status would run the generation again
    with openai.OpenAI(base_url=node.url + "/v1", api_key="unused", timeout=30) as sdk:
        marker = uuid.uuid4().hex[:10]
        script(engine, http, '{"t": "five"}', marker)
        r1 = rid()
        raw = sdk.chat.completions.with_raw_response.parse(
            model=VL, messages=user(marker), response_format=Reading, extra_headers={"x-request-id": r1}
        )
        assert raw.status_code == 200
        assert "'five' is not of type 'integer'" in (raw.headers.get("x-smg-schema-violation") or "")
        body = json.loads(raw.content)
        assert (
            body["choices"][0]["schema_violation"]
            and body["choices"][0]["message"]["content"] == '{"t": "five"}'
        )
        with pytest.raises(pydantic.ValidationError):  # the SDK's own parse of the content
            raw.parse()
        assert len(sent(engine, http, r1)) == 1


def test_rejecting_strict_violations_is_a_422_never_retried(
    strict_node: NodeProc, engine: MockEngineProc, http: httpx.Client
) -> None:
    with openai.OpenAI(base_url=strict_node.url + "/v1", api_key="unused", timeout=30) as sdk:
        marker = uuid.uuid4().hex[:10]
        script(engine, http, "not json", marker)
        r1 = rid()
        with pytest.raises(openai.UnprocessableEntityError) as ei:
            sdk.chat.completions.parse(
                model="qwen3",
                messages=user(marker),
                response_format=Reading,
                extra_headers={"x-request-id": r1},
            )
        assert ei.value.body["code"] == "schema_violation"  # type: ignore[index]
        assert len(sent(engine, http, r1)) == 1  # one generation, though the SDK retries 5xx twice
        # a conforming answer parses
        marker = uuid.uuid4().hex[:10]
        script(engine, http, '{"t": 5}', marker)
        ok = sdk.chat.completions.parse(model="qwen3", messages=user(marker), response_format=Reading)
        assert ok.choices[0].message.parsed == Reading(t=5)


# ---- vLLM's and SGLang's other request fields ----------------------------------------------------------


def test_request_ids_token_ids_stop_trim_and_documents_are_honoured(
    client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client
) -> None:
    # vLLM's request_id names the answer after its prefix, SGLang's rid as it is
    r = client.chat.completions.create(
        model=VL, messages=user(), max_tokens=2, extra_body={"request_id": "abc"}
    )
    assert r.id == "chatcmpl-abc"
    cr = client.completions.create(model=SG, prompt="Hi", max_tokens=2, extra_body={"rid": "mine-1"})
    assert cr.id == "mine-1"
    # return_tokens_as_token_ids: logprobs' tokens as "token_id:<id>"
    r = client.chat.completions.create(
        model=VL,
        messages=user(),
        max_tokens=3,
        logprobs=True,
        extra_body={"return_tokens_as_token_ids": True},
    )
    assert r.choices[0].logprobs is not None and r.choices[0].logprobs.content
    assert all(e.token.startswith("token_id:") for e in r.choices[0].logprobs.content)
    # SGLang's no_stop_trim keeps the stop string, as include_stop_str_in_output does
    script(engine, http, "Hello world. More", "trim-me")
    r = client.chat.completions.create(
        model=SG, messages=user("trim-me"), max_tokens=20, stop=["."], extra_body={"no_stop_trim": True}
    )
    assert r.choices[0].message.content == "Hello world."
    # what stopped it: vLLM's stop_reason beside SGLang's matched_stop, streamed or not
    assert (r.choices[0].model_extra or {}).get("stop_reason") == "."
    script(engine, http, "Hello world. More", "trim-me")
    chunks = list(
        client.chat.completions.create(
            model=SG, messages=user("trim-me"), max_tokens=20, stop=["."], stream=True
        )
    )
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    assert (last.choices[0].model_extra or {}).get("stop_reason") == "."
    # documents reach the template (counted in the prompt), as chat_template_kwargs' would
    docs = [{"title": "t", "text": "some document text " * 5}]
    # (this template iterates its tools whatever: give it one)
    tool: Any = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    kw: Any = {"model": COHERE, "messages": user(), "max_tokens": 1, "tools": tool}
    plain = client.chat.completions.create(**kw)
    with_docs = client.chat.completions.create(**kw, extra_body={"documents": docs})
    as_kwargs = client.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"documents": docs}})
    assert plain.usage and with_docs.usage and as_kwargs.usage
    assert with_docs.usage.prompt_tokens == as_kwargs.usage.prompt_tokens > plain.usage.prompt_tokens + 20


def test_add_special_tokens_false_on_completions_encodes_no_bos(
    client: openai.OpenAI, node: NodeProc, http: httpx.Client
) -> None:
    """vLLM's ``add_special_tokens`` on completions (CompletionRequest: default true): false encodes the
    prompt without the BOS (a client that rendered the chat template itself sends it so), as
    ``/tokenize`` does."""

    def tokenize(add: bool) -> list[int]:
        body = {"model": BOS, "prompt": "Hello world", "add_special_tokens": add}
        out: list[int] = http.post(node.url + "/tokenize", json=body).json()["tokens"]
        return out

    with_bos, without = tokenize(True), tokenize(False)
    assert with_bos == [with_bos[0], *without] and len(without) == len("Hello world")
    for add, want in ((None, with_bos), (True, with_bos), (False, without)):
        extra = {} if add is None else {"add_special_tokens": add}
        r = client.completions.create(model=BOS, prompt="Hello world", max_tokens=1, extra_body=extra)
        assert r.usage is not None and r.usage.prompt_tokens == len(want), (add, r.usage)
    # echoed, the prompt is the text sent either way
    r = client.completions.create(
        model=BOS, prompt="Hello world", max_tokens=1, echo=True, extra_body={"add_special_tokens": False}
    )
    assert r.choices[0].text.startswith("Hello world")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=BOS, prompt="Hi", max_tokens=1, extra_body={"add_special_tokens": "no"}
        )
    assert isinstance(e.value.body, dict) and e.value.body.get("param") == "add_special_tokens"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("allowed_token_ids", [1, 2]),
        ("bad_words", ["x"]),
        ("prompt_logprobs", 21),  # (over the cap: up to 20 are answered, test_prompt_logprobs.py)
        ("truncate_prompt_tokens", 5),
        ("priority", 3),
        ("lora_path", "/adapters/a"),
        ("return_hidden_states", True),
        ("use_beam_search", True),
        ("cache_salt", "tenant-a"),
        ("chat_template", "{{ 1/0 }}"),
        ("echo", True),
    ],
)
def test_fields_no_engine_carries_are_a_400_naming_them(
    client: openai.OpenAI, field: str, value: Any
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=VL, messages=user(), max_tokens=2, extra_body={field: value})
    body = e.value.body
    assert isinstance(body, dict) and body.get("param") == field
    # their neutral values pass
    neutral = {
        "priority": 0,
        "use_beam_search": False,
        "echo": False,
        "return_hidden_states": False,
    }
    if field in neutral:
        client.chat.completions.create(
            model=VL, messages=user(), max_tokens=2, extra_body={field: neutral[field]}
        )


def test_a_stopped_stream_counts_and_logs_no_token_past_its_stop(
    client: openai.OpenAI, engine: MockEngineProc, http: httpx.Client
) -> None:
    """The engine sends tokens past the stop in the chunk that completes it (a burst, a stream interval):
    usage ends at the stopping token, streamed or not, and the streamed logprobs are those tokens'."""
    for stream in (False, True):
        script(engine, http, "Hello world. More words after the stop.", "stop-count")
        kw: Any = {
            "model": SG,
            "messages": user("stop-count"),
            "max_tokens": 20,
            "stop": ["."],
            "logprobs": True,
        }
        if stream:
            chunks = list(
                client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
            )
            usage = chunks[-1].usage
            entries = [
                e
                for c in chunks
                if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content or ()
            ]
        else:
            r = client.chat.completions.create(**kw)
            usage = r.usage
            assert r.choices[0].logprobs is not None
            entries = list(r.choices[0].logprobs.content or ())
        # (this module's tokenizer is byte-level: a token a character) up to the "." that stopped it
        assert "".join(e.token for e in entries) == "Hello world.", (stream, entries)
        assert usage is not None and usage.completion_tokens == len(entries), (stream, usage)


def test_generate_output_ids_end_at_the_token_that_completed_a_stop_string(
    node: NodeProc, engine: MockEngineProc, http: httpx.Client
) -> None:
    """/generate stopped by a stop string: ``output_ids`` end at the token that completed it, as SGLang's
    (its scheduler finishes the request there), and match ``completion_tokens``, streamed or not, also
    when the engine's chunk carries tokens past the stop."""
    for stream in (False, True):
        script(engine, http, "Hello world. More words after the stop.", "gen-stop-ids")
        body = {
            "model": SG,
            "text": "say gen-stop-ids",
            "sampling_params": {"max_new_tokens": 30, "stop": ["d."]},  # two tokens: the node's to match
            "stream": stream,
        }
        r = http.post(node.url + "/generate", json=body)
        answer = _sse(r)[-1] if stream else r.json()
        assert answer["text"] == "Hello worl", (stream, answer)
        assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": "d."}, (stream, answer)
        ids = answer["output_ids"]
        assert len(ids) == answer["meta_info"]["completion_tokens"], (stream, answer)
        assert _detok(http, node, ids) == "Hello world.", (stream, answer)


# ---- return_token_ids ------------------------------------------------------------------------------------


def _sse(r: httpx.Response) -> list[dict[str, Any]]:
    assert r.status_code == 200, r.text
    lines = [ln[6:] for ln in r.text.split("\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def _detok(http: httpx.Client, node: NodeProc, ids: list[int]) -> str:
    r = http.post(node.url + "/detokenize", json={"model": SG, "tokens": ids, "skip_special_tokens": True})
    assert r.status_code == 200, r.text
    text: str = r.json()["prompt"]
    return text


def test_tokenize_and_detokenize_in_sglang_and_smg_shapes_too(node: NodeProc, http: httpx.Client) -> None:
    """SGLang's and SMG's tokenize (``char_count``; a list of prompts: lists back) and detokenize (``text``
    beside vLLM's ``prompt``; a list of id lists: a list of texts), on both paths."""
    for path in ("/tokenize", "/v1/tokenize"):
        one = http.post(node.url + path, json={"model": SG, "prompt": "Hello world"}).json()
        assert one["count"] == len(one["tokens"]) and one["char_count"] == 11 and "max_model_len" in one
        r = http.post(node.url + path, json={"model": SG, "prompt": ["Hello world", "Hi", ""]})
        assert r.status_code == 200, r.text
        many = r.json()
        assert many["tokens"][0] == one["tokens"] and many["tokens"][2] == []
        assert many["count"] == [len(t) for t in many["tokens"]] and many["char_count"] == [11, 2, 0]
        r = http.post(node.url + path, json={"model": SG, "prompt": ["a", 5]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    ids = http.post(node.url + "/tokenize", json={"model": SG, "prompt": "Hello world"}).json()["tokens"]
    for path in ("/detokenize", "/v1/detokenize"):
        r = http.post(node.url + path, json={"model": SG, "tokens": ids})
        assert r.json() == {"prompt": "Hello world", "text": "Hello world"}
        r = http.post(node.url + path, json={"model": SG, "tokens": [ids, ids[:1], []]})
        assert r.status_code == 200, r.text
        texts = r.json()["text"]
        assert texts == r.json()["prompt"] and texts[0] == "Hello world" and texts[2] == ""
        for bad in ([ids, [True]], [[1], 2], [[-1]], "x"):
            r = http.post(node.url + path, json={"model": SG, "tokens": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", bad


def test_return_token_ids_as_vllm(node: NodeProc, engine: MockEngineProc, http: httpx.Client) -> None:
    """vLLM's ``return_token_ids``: chat answers carry the prompt's ids beside the choices and each
    choice's output ids (streamed: each chunk the ids its text came from, the role chunk the prompt's);
    completions carry both per choice (streamed: the prompt's on a choice's first chunk). The ids end at
    a stop, as usage does, and are the same streamed or not."""
    chat, comp = node.url + "/v1/chat/completions", node.url + "/v1/completions"
    msgs = user("rti-chat")
    prompt_ids = http.post(node.url + "/tokenize", json={"model": SG, "messages": msgs}).json()["tokens"]
    base: dict[str, Any] = {"model": SG, "messages": msgs, "max_tokens": 20, "return_token_ids": True}
    # whole, stopped by a stop string: the ids end at the token that completed it
    script(engine, http, "Hello world. More after the stop.", "rti-chat")
    body = http.post(chat, json={**base, "stop": ["."]}).json()
    assert body["prompt_token_ids"] == prompt_ids
    ids = body["choices"][0]["token_ids"]
    assert len(ids) == body["usage"]["completion_tokens"] and ids
    assert _detok(http, node, ids).startswith("Hello world") and "More" not in _detok(http, node, ids)
    # streamed: the same ids, chunk by chunk
    script(engine, http, "Hello world. More after the stop.", "rti-chat")
    chunks = _sse(http.post(chat, json={**base, "stop": ["."], "stream": True}))
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == ids
    # n = 2: each choice's ids are its text's
    chunks = _sse(
        http.post(chat, json={**base, "n": 2, "stream": True, "stream_options": {"include_usage": True}})
    )
    for i in (0, 1):
        mine = [ch for c in chunks for ch in c["choices"] if ch["index"] == i]
        got = [t for ch in mine for t in ch.get("token_ids", [])]
        text = "".join(ch["delta"].get("content") or "" for ch in mine)
        assert got and _detok(http, node, got) == text
    assert (
        sum(len(ch.get("token_ids", [])) for c in chunks for ch in c["choices"])
        == (chunks[-1]["usage"]["completion_tokens"])
    )
    # completions: both per choice, streamed or not; echoed, the first chunk (the echo) has no output id
    p_ids = http.post(node.url + "/tokenize", json={"model": SG, "prompt": "rti-comp"}).json()["tokens"]
    cb: dict[str, Any] = {"model": SG, "prompt": "rti-comp", "max_tokens": 6, "return_token_ids": True}
    body = http.post(comp, json=cb).json()
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == p_ids and len(choice["token_ids"]) == 6
    assert _detok(http, node, choice["token_ids"]) == choice["text"]
    for echo in (False, True):
        chunks = _sse(http.post(comp, json={**cb, "stream": True, "echo": echo}))
        assert chunks[0]["choices"][0]["prompt_token_ids"] == p_ids
        assert all("prompt_token_ids" not in ch for c in chunks[1:] for ch in c["choices"])
        got = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
        assert len(got) == 6
    # echo with max_tokens 0: the prompt alone
    body = http.post(comp, json={**cb, "max_tokens": 0, "echo": True}).json()
    assert body["choices"][0]["token_ids"] == [] and body["choices"][0]["prompt_token_ids"] == p_ids
    # off by default; a non-boolean is a 400 naming it
    assert "prompt_token_ids" not in http.post(chat, json={**base, "return_token_ids": False}).json()
    r = http.post(chat, json={**base, "return_token_ids": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_token_ids"
