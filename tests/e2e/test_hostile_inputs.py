"""Hostile and malformed input against a real node: the project rule under test is

    Bad input gets a clear error in the protocol's own envelope and nothing lost: no 500, no crash,
    no stuck stream, no leaked engine request.

One mock engine and one node for the module (real processes on loopback). The node serves five models
over the same engine, so every engine client and template family is attacked: ``qwen3`` (auto-detected
gRPC, Qwen3 template), ``llama`` (SGLang, Llama 3.1 template), ``nemo`` (vLLM, Mistral Nemo template:
strict roles), ``glm`` (SGLang, GLM-4.6 template: strict tool-call arguments) and ``relay`` (an
OpenAI HTTP worker). Node and engine share a byte-level tokenizer (vocabulary 263, loads in
milliseconds); the engine's context is 4096. Auth is on (API keys), the body limit is 1 MiB.

Every table case checks, after its request: the status and the OpenAI envelope
``{"error": {"message", "type", "param", "code"}}``, that the node process is alive and answers a real
generation, and that the engine has no active request left. Stream cases check the SSE error event
followed by ``[DONE]``. Two small nodes of their own take what changes node state: ``aux`` (a 0.8 s
request timeout: engine stalls and hangs; the key store) and ``breaker`` (a circuit breaker that opens
on one failure). Cases that FAIL today are strict xfails whose reason names the defect, so the suite
stays green and the fix flips them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import json
import os
import random
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.e2e import node_fixtures
from tests.e2e.node_fixtures import TEMPLATES, qwen3_flags
from tests.e2e.node_procs import NodeProc, running_node
from tests.e2e.procs import MockEngineProc, start_mock_engine

ADMIN_KEY = "sk-hostile-admin-" + os.urandom(12).hex()
ADMIN = f"Bearer {ADMIN_KEY}"
MSGS: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
VOCAB = 263  # byte_tokenizer: 256 bytes + 4 markers + 3 specials
LIMIT = 1024 * 1024  # --max-payload-size of the module node
ENVELOPE_KEYS = {"message", "type", "param", "code"}


# ---- processes ------------------------------------------------------------------------------------

# the shared module-scoped fixtures (tests/e2e/node_fixtures.py), by their names
tokenizer_dir, http = node_fixtures.tokenizer_dir, node_fixtures.http


@pytest.fixture(scope="module")
def engine(tokenizer_dir: Path) -> Iterator[MockEngineProc]:
    with start_mock_engine(
        *("--decode-ms-per-token", "2", "--output-len", "8", "--context-length", "4096"),
        *("--tokenizer", str(tokenizer_dir)),
    ) as e:
        yield e


@pytest.fixture(scope="module")
def node(engine: MockEngineProc, tokenizer_dir: Path) -> Iterator[NodeProc]:
    g = engine.grpc_port

    def model(name: str, url: str, template: str | None) -> dict[str, Any]:
        m: dict[str, Any] = {"name": name, "model_path": str(tokenizer_dir), "worker_urls": [url]}
        if template:
            m["chat_template"] = str(TEMPLATES / template)
        return m

    models = [
        model("qwen3", f"grpc://127.0.0.1:{g}", "Qwen-Qwen3-0.6B.jinja"),
        model("llama", f"sglang://127.0.0.1:{g}", "meta-llama-Llama-3.1-8B-Instruct.jinja"),
        model("nemo", f"vllm://127.0.0.1:{g}", "mistralai-Mistral-Nemo-Instruct-2407.jinja"),
        model("glm", f"sglang://127.0.0.1:{g}/", "GLM-4.6.jinja"),  # the slash: a distinct worker URL
        model("relay", engine.http_url, None),
    ]
    digest = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "node.yaml"
        cfg.write_text(yaml.safe_dump({"models": models}))
        with running_node(
            *("--config", str(cfg), "--max-payload-size", str(LIMIT)),
            *("--auth-mode", "api_key", "--auth-admin-key-sha256", digest),
        ) as n:
            yield n


@contextlib.contextmanager
def single_node(engine: MockEngineProc, tokenizer_dir: Path, *flags: str) -> Iterator[NodeProc]:
    """A node of its own (one model, no auth) for the cases that change or break node state."""
    with running_node(*qwen3_flags(engine, tokenizer_dir), "--tokenizer-workers", "0", *flags) as n:
        yield n


@pytest.fixture(scope="module")
def aux(engine: MockEngineProc, tokenizer_dir: Path) -> Iterator[NodeProc]:
    """Short request timeout, a circuit breaker that never opens: engine timeouts, and the key store."""
    with single_node(
        engine, tokenizer_dir, "--request-timeout-secs", "0.8", "--cb-failure-threshold", "100000"
    ) as n:
        yield n


@pytest.fixture()
def reset_faults(engine: MockEngineProc, http: httpx.Client) -> Iterator[None]:
    yield
    r = http.post(
        f"{engine.http_url}/mock/faults",
        json={
            "error_rate": 0.0,
            "hang_before_first_token": False,
            "stall_after_tokens": None,
            "stall_seconds": 0.0,
        },
    )
    assert r.status_code < 300, r.text


# ---- invariants ------------------------------------------------------------------------------------


def settle(engine: MockEngineProc, http: httpx.Client) -> dict[str, Any]:
    """The engine's stats once no request is active (bounded wait: aborts travel in the background)."""
    stats: dict[str, Any] = {}
    for _ in range(100):
        stats = http.get(f"{engine.http_url}/mock/stats").json()
        if stats["active"] == 0:
            break
        time.sleep(0.05)
    return stats


def saw_abort(engine: MockEngineProc, http: httpx.Client, rid: str) -> bool:
    """Did the engine end a request of ``rid`` early (an Abort RPC or a cancelled stream)? Bounded wait:
    the node's abort travels in the background."""
    for _ in range(100):
        stats = http.get(f"{engine.http_url}/mock/stats").json()
        # (gRPC engine ids: a unique token, then the client's id; a relayed request: the id as sent)
        if any(str(a).startswith(rid) or str(a).partition(".")[2].startswith(rid) for a in stats["aborted"]):
            return True
        time.sleep(0.05)
    return False


def assert_intact(
    node: NodeProc, engine: MockEngineProc, http: httpx.Client, auth: str | None = ADMIN
) -> None:
    """Nothing lost: the node alive and serving a real generation, no engine request left active."""
    assert node.proc.poll() is None, f"node exited:\n{node.log()[-3000:]}"
    headers = {"authorization": auth} if auth else {}
    r = http.post(
        node.url + "/v1/completions", json={"model": "qwen3", "prompt": [1], "max_tokens": 1}, headers=headers
    )
    assert r.status_code == 200, r.text
    stats = settle(engine, http)
    assert stats["active"] == 0, f"leaked engine requests: {stats['active']}"


def assert_envelope(r: httpx.Response, status: int | frozenset[int], code: str | None = None) -> None:
    ok = {status} if isinstance(status, int) else status
    assert r.status_code in ok, f"{r.status_code}: {r.text[:500]}"
    if r.status_code < 400:
        return
    assert r.headers.get("content-type", "").startswith("application/json"), r.text[:300]
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == ENVELOPE_KEYS, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert r.status_code != 500 and err["type"] != "internal_error", err
    if code is not None:
        assert err["code"] == code, err


def sse_data(raw: bytes) -> list[str]:
    return [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]


def assert_sse_error_then_done(raw: bytes) -> dict[str, Any]:
    events = sse_data(raw)
    assert events and events[-1] == "[DONE]", events[-3:]
    err: dict[str, Any] = json.loads(events[-2])["error"]
    assert set(err) == ENVELOPE_KEYS and err["message"], err
    return err


# ---- the table ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    path: str
    body: Any  # a JSON value, or bytes sent as they are
    status: int | frozenset[int]
    code: str | None = None
    method: str = "POST"
    auth: str | None = ADMIN
    headers: tuple[tuple[str, str], ...] = ()
    defect: str | None = None  # the case fails today: a strict xfail with this reason


def chat(model: Any = "qwen3", **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": MSGS, "max_tokens": 2, **kw}


def msgs(*messages: dict[str, Any], model: str = "qwen3", **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": list(messages), "max_tokens": 2, **kw}


def comp(**kw: Any) -> dict[str, Any]:
    return {"model": "qwen3", "max_tokens": 2, **kw}


def nested_list(depth: int) -> Any:
    x: Any = 1
    for _ in range(depth):
        x = [x]
    return x


def nested_obj(depth: int) -> dict[str, Any]:
    x: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        x = {"type": "object", "properties": {"a": x}}
    return x


def tool_call(args: Any, name: Any = "f", ident: Any = "call00001") -> dict[str, Any]:
    return {"id": ident, "type": "function", "function": {"name": name, "arguments": args}}


def history(*calls: Any, model: str = "qwen3") -> dict[str, Any]:
    return msgs(
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": None, "tool_calls": list(calls)},
        model=model,
    )


CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
VALID = json.dumps(chat()).encode()

CASES: list[Case] = [
    # -- bodies that are not a JSON object
    Case("empty-body", CHAT, b"", 400, "invalid_json"),
    Case("not-json", CHAT, b"{not json", 400, "invalid_json"),
    Case("json-array", CHAT, b"[1, 2]", 400, "invalid_json"),
    Case("json-string", CHAT, b'"hello"', 400, "invalid_json"),
    Case("json-null", CHAT, b"null", 400, "invalid_json"),
    # empty arrays: 56 bytes of Python object for every 3 bytes of body (a 16 MB body: 470 MB, 1.6 s)
    Case("json-empty-arrays", CHAT, b'{"messages":[' + b"[]," * 300_000 + b"[]]}", 400, "invalid_json"),
    Case("json-empty-objects", CHAT, b'{"tools":[' + b"{}," * 300_000 + b"{}]}", 400, "invalid_json"),
    Case("json-number", COMP, b"42", 400, "invalid_json"),
    Case("invalid-utf8", CHAT, b'{"model":"qwen3","messages":[{"role":"user","content":"\xff\xfe"}]}', 400),
    Case("bom", CHAT, b"\xef\xbb\xbf" + VALID, 400, "invalid_json"),
    Case("lone-high-surrogate", CHAT, VALID.replace(b'"hi"', b'"a\\ud800b"'), 400, "invalid_json"),
    Case("lone-low-surrogate", CHAT, VALID.replace(b'"hi"', b'"a\\udc00b"'), 400, "invalid_json"),
    Case("surrogate-pair-ok", CHAT, VALID.replace(b'"hi"', b'"a\\ud83d\\ude00b"'), 200),
    Case("escaped-nul-ok", CHAT, VALID.replace(b'"hi"', b'"a\\u0000b"'), 200),
    Case("raw-nul-byte", CHAT, VALID.replace(b'"hi"', b'"a\x00b"'), 400, "invalid_json"),
    Case("nan-literal", CHAT, VALID.replace(b'"max_tokens": 2', b'"temperature": NaN'), 400, "invalid_json"),
    Case("inf-number", CHAT, VALID.replace(b'"max_tokens": 2', b'"temperature": 1e400'), 400, "invalid_json"),
    Case(
        "nesting-10k",
        CHAT,
        b'{"model":"qwen3","x":' + b"[" * 10000 + b"]" * 10000 + b"}",
        400,
        "invalid_json",
    ),
    Case("nesting-10k-tokenize", "/v1/tokenize", b'{"prompt":' + b"[" * 10000 + b"]" * 10000 + b"}", 400),
    Case(
        "nesting-900-extra-field", CHAT, msgs({"role": "user", "content": "hi", "x": nested_list(900)}), 200
    ),
    # -- model
    Case("model-missing", CHAT, {"messages": MSGS}, 400, "missing_model"),  # several models served
    Case("model-int", CHAT, chat(model=5), 400, "invalid_type"),
    Case("model-list", COMP, comp(model=["qwen3"], prompt="a"), 400, "invalid_type"),
    Case("model-unknown-chat", CHAT, chat(model="nope"), 404, "model_not_found"),
    Case("model-unknown-completions", COMP, comp(model="nope", prompt="a"), 404, "model_not_found"),
    Case("model-unknown-tokenize", "/v1/tokenize", {"model": "nope", "prompt": "a"}, 404, "model_not_found"),
    Case(
        "model-unknown-detokenize", "/v1/detokenize", {"model": "nope", "tokens": [1]}, 404, "model_not_found"
    ),
    Case("model-dict-tokenize", "/v1/tokenize", {"model": {"a": 1}, "prompt": "a"}, 404, "model_not_found"),
    # -- messages
    Case("messages-string", CHAT, chat(messages="hi"), 400, "invalid_type"),
    Case("messages-empty", CHAT, chat(messages=[]), 400, "empty_array"),
    Case("messages-missing", CHAT, {"model": "qwen3", "max_tokens": 4}, 400, "missing_required_parameter"),
    Case("role-list", CHAT, msgs({"role": [], "content": "hi"}), 400, "invalid_value"),
    Case("role-object", CHAT, msgs({"role": {"a": 1}, "content": "hi"}), 400, "invalid_value"),
    Case(
        "role-list-tokenize",
        "/v1/tokenize",
        {"model": "qwen3", "messages": [{"role": [], "content": "a"}]},
        400,
    ),
    Case("reasoning-effort-object", CHAT, chat(reasoning_effort={}), 400),
    Case("reasoning-effort-list", CHAT, chat(reasoning_effort=["high"]), 400),
    Case("messages-object", CHAT, chat(messages={"role": "user", "content": "hi"}), 400, "invalid_type"),
    Case("message-not-object", CHAT, chat(messages=["hi"]), 400, "invalid_type"),
    Case("role-missing", CHAT, msgs({"content": "hi"}), 400),
    Case("role-int", CHAT, msgs({"role": 1, "content": "hi"}), 400),
    Case("role-unknown", CHAT, msgs({"role": "wizard", "content": "hi"}), 400),
    Case("content-number", CHAT, msgs({"role": "user", "content": 5}), 400),
    Case("content-object", CHAT, msgs({"role": "user", "content": {"a": 1}}), 400),
    Case("content-list-of-strings", CHAT, msgs({"role": "user", "content": ["hi"]}), 400),
    Case("content-part-no-type", CHAT, msgs({"role": "user", "content": [{"text": "hi"}]}), 400),
    Case(
        "content-part-type-list",
        CHAT,
        msgs({"role": "user", "content": [{"type": ["text"], "text": "x"}]}),
        400,
    ),
    Case(
        "content-part-text-int", CHAT, msgs({"role": "user", "content": [{"type": "text", "text": 5}]}), 400
    ),
    Case(
        "content-part-image",
        CHAT,
        msgs({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}),
        400,
        "unsupported_content",
    ),
    Case("content-null-user", CHAT, msgs({"role": "user", "content": None}), 400),
    Case("tool-calls-string", CHAT, msgs(MSGS[0], {"role": "assistant", "tool_calls": "x"}), 400),
    Case("tool-calls-items-int", CHAT, history(1, 2), 400, "invalid_type"),
    Case(
        "tool-call-no-function",
        CHAT,
        history({"id": "a", "type": "function"}),
        400,
        "missing_required_parameter",
    ),
    Case(
        "reasoning-content-int",
        CHAT,
        msgs({"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "reasoning_content": 5}),
        400,
        "chat_template_error",
    ),
    # -- templates that reject a conversation: a 400, not a 500
    Case(
        "nemo-roles-not-alternating",
        CHAT,
        msgs({"role": "user", "content": "a"}, {"role": "user", "content": "b"}, model="nemo"),
        400,
        "chat_template_error",
    ),
    Case(
        "nemo-system-after-user",
        CHAT,
        msgs({"role": "user", "content": "a"}, {"role": "system", "content": "b"}, model="nemo"),
        400,
        "chat_template_error",
    ),
    Case(
        "nemo-tool-call-id-int",
        CHAT,
        history(tool_call("{}", ident=5), model="nemo"),
        400,
        "invalid_type",  # (checked before any template: a past call's id is a string)
    ),
    Case(
        "llama-two-tool-calls",
        CHAT,
        history(tool_call("{}"), tool_call("{}", name="g"), model="llama"),
        400,
        "chat_template_error",
    ),
    Case(
        "llama-tools-without-user",
        CHAT,
        msgs(
            {"role": "system", "content": "a"},
            model="llama",
            tools=[TOOL],
            chat_template_kwargs={"tools_in_user_message": True},
        ),
        400,
        "chat_template_error",
    ),
    Case(
        "glm-tool-args-not-json",
        CHAT,
        history(tool_call("{not json"), model="glm"),
        400,
        "chat_template_error",
    ),
    Case(
        "glm-tool-args-json-list", CHAT, history(tool_call("[1, 2]"), model="glm"), 400, "chat_template_error"
    ),
    Case("glm-tool-args-json-ok", CHAT, history(tool_call('{"a": 1}'), model="glm"), 200),
    Case("qwen3-tool-args-not-json", CHAT, history(tool_call("{not json")), 200),
    Case("llama-tool-args-not-json", CHAT, history(tool_call("{not json"), model="llama"), 200),
    Case(
        "llama-tool-args-nested-5k",
        CHAT,
        history(tool_call("[" * 5000 + "]" * 5000), model="llama"),
        400,
    ),
    Case(
        "llama-tool-args-nested-100k",
        CHAT,
        history(tool_call("[" * 100000 + "]" * 100000), model="llama"),
        400,
    ),
    # -- chat_template_kwargs
    Case("template-kwargs-string", CHAT, chat(chat_template_kwargs="x"), 400, "invalid_type"),
    Case(
        "template-kwargs-shadow-global",
        CHAT,
        chat(chat_template_kwargs={"namespace": 1}),
        400,
        "chat_template_error",
    ),
    Case("template-kwargs-bad-type", CHAT, chat(model="llama", chat_template_kwargs={"date_string": 5}), 400),
    Case("template-kwargs-messages", CHAT, chat(chat_template_kwargs={"messages": 5, "tools": 5}), 200),
    Case(
        "continue-final-and-generation-prompt",
        CHAT,
        chat(continue_final_message=True, add_generation_prompt=True),
        400,
    ),
    # -- sampling fields: types and ranges
    Case("max-tokens-0", CHAT, chat(max_tokens=0), 400, "invalid_value"),
    Case("max-tokens-negative", CHAT, chat(max_tokens=-1), 400, "invalid_value"),
    Case("max-tokens-float", CHAT, chat(max_tokens=1.5), 400, "invalid_type"),
    Case("max-tokens-bool", CHAT, chat(max_tokens=True), 400, "invalid_type"),
    Case("max-tokens-string", CHAT, chat(max_tokens="5"), 400, "invalid_type"),
    Case("max-tokens-over-context", CHAT, chat(max_tokens=10**7), 400, "context_length_exceeded"),
    Case("max-tokens-1e300", CHAT, chat(max_tokens=1e300), 400, "invalid_value"),
    Case("max-completion-tokens-0", CHAT, chat(max_completion_tokens=0), 400, "invalid_value"),
    Case("temperature-string", CHAT, chat(temperature="1"), 400, "invalid_type"),
    Case("temperature-negative", CHAT, chat(temperature=-1), 400, "invalid_value"),
    Case("temperature-3", CHAT, chat(temperature=3), 400, "invalid_value"),
    Case("top-p-0", CHAT, chat(top_p=0), 400, "invalid_value"),
    Case("top-k-minus-2", CHAT, chat(top_k=-2), 400, "invalid_value"),
    Case("repetition-penalty-0", CHAT, chat(repetition_penalty=0), 400, "invalid_value"),
    Case("top-logprobs-21", CHAT, chat(logprobs=True, top_logprobs=21), 400, "invalid_value"),
    Case("top-logprobs-negative", CHAT, chat(logprobs=True, top_logprobs=-1), 400, "invalid_value"),
    Case("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), 400),
    Case("logprobs-string", CHAT, chat(logprobs="yes"), 400, "invalid_type"),
    Case("n-0", CHAT, chat(n=0), 400, "invalid_value"),
    Case("n-huge", CHAT, chat(n=10**9), 400, "invalid_value"),
    Case("n-string", CHAT, chat(n="2"), 400, "invalid_type"),
    Case("seed-string", CHAT, chat(seed="1"), 400, "invalid_type"),
    Case("seed-float", CHAT, chat(seed=1.5), 400, "invalid_type"),
    Case("seed-over-64-bits", CHAT, chat(seed=2**64), 400, "invalid_value"),
    Case("seed-negative-ok", CHAT, chat(seed=-1), 200),
    Case("stream-string", CHAT, chat(stream="true"), 400, "invalid_type"),
    Case("stream-options-without-stream", CHAT, chat(stream_options={"include_usage": True}), 400),
    Case("stream-options-string", CHAT, chat(stream=True, stream_options="x"), 400, "invalid_type"),
    Case("stream-options-usage-string", CHAT, chat(stream=True, stream_options={"include_usage": "y"}), 400),
    Case("stop-number", CHAT, chat(stop=5), 400, "invalid_type"),
    Case("stop-list-of-numbers", CHAT, chat(stop=[5]), 400, "invalid_type"),
    Case("stop-100-strings", CHAT, chat(stop=["a"] * 100), 400, "invalid_value"),
    Case("stop-empty-strings", CHAT, chat(stop=["", ""]), 400, "invalid_value"),  # (vLLM's refusal)
    Case("stop-16-long-strings-ok", CHAT, chat(stop=["ab" * 511 + str(i) for i in range(16)]), 200),
    # over MAX_STOP_CHARS (1024): bounded, as per-token hold-back work and the memo grow with them
    Case("stop-huge", CHAT, chat(stop=["ab" * 30000 + str(i) for i in range(9)]), 400, "invalid_value"),
    Case("stop-token-ids-negative", CHAT, chat(stop_token_ids=[-1]), 400, "invalid_type"),
    Case("min-tokens-negative", CHAT, chat(min_tokens=-1), 400, "invalid_value"),
    Case("ignore-eos-string", CHAT, chat(ignore_eos="x"), 400, "invalid_type"),
    Case("logit-bias-list", CHAT, chat(logit_bias=[1]), 400, "invalid_type"),
    Case("logit-bias-key-word", CHAT, chat(logit_bias={"abc": 1}), 400),
    Case("logit-bias-value-101", CHAT, chat(logit_bias={"5": 101}), 400),
    Case("logit-bias-value-string", CHAT, chat(logit_bias={"5": "1"}), 400),
    Case("parallel-tool-calls-string", CHAT, chat(parallel_tool_calls="no"), 400, "invalid_type"),
    Case(
        "top-k-over-int32",
        CHAT,
        chat(top_k=2**40),
        400,
    ),
    Case(
        "min-tokens-over-uint32",
        CHAT,
        chat(min_tokens=2**40),
        400,
    ),
    Case(
        "stop-token-id-over-uint32",
        CHAT,
        chat(stop_token_ids=[2**40]),
        400,
    ),
    Case(
        "vllm-seed-over-int32",
        CHAT,
        chat(model="nemo", seed=2**31),
        frozenset({200, 400}),
    ),
    Case(
        "vllm-logit-bias-key-over-int32",
        CHAT,
        chat(model="nemo", logit_bias={str(2**31): 1}),
        400,
    ),
    Case(
        "logit-bias-key-outside-vocab",
        CHAT,
        chat(logit_bias={"999999": 1}),
        400,
    ),
    Case(
        "logit-bias-key-negative",
        CHAT,
        chat(logit_bias={"-5": 1}),
        400,
    ),
    Case(
        "stop-token-id-outside-vocab",
        CHAT,
        chat(stop_token_ids=[99999]),
        400,
    ),
    Case(
        "min-tokens-over-max-tokens",
        CHAT,
        chat(min_tokens=100, max_tokens=2),
        400,
    ),
    Case(
        "engine-rejects-request",
        CHAT,
        chat(n=128, max_tokens=3000, ignore_eos=True),
        400,
    ),
    # -- tools, tool_choice, response_format
    Case("tools-string", CHAT, chat(tools="x"), 400, "invalid_type"),
    Case("tools-list-of-int", CHAT, chat(tools=[1]), 400),
    Case("tools-no-name", CHAT, chat(tools=[{"type": "function", "function": {}}]), 400),
    Case("tools-name-int", CHAT, chat(tools=[{"type": "function", "function": {"name": 5}}]), 400),
    Case("tools-type-code", CHAT, chat(tools=[{"type": "code", "function": {"name": "f"}}]), 400),
    Case(
        "tools-parameters-string",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
        400,
    ),
    Case(
        "tools-parameters-bad-schema",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]),
        400,
    ),
    Case(
        "tools-strict-string",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f", "strict": "y"}}]),
        400,
    ),
    Case(
        "tools-1000-over-context",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(1000)]),
        400,
        "context_length_exceeded",
    ),
    Case(
        "tools-parameters-nested-300",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": nested_obj(300)}}]),
        400,
    ),
    Case("tool-choice-int", CHAT, chat(tools=[TOOL], tool_choice=5), 400),
    Case("tool-choice-unknown-string", CHAT, chat(tools=[TOOL], tool_choice="sometimes"), 400),
    Case("tool-choice-required-without-tools", CHAT, chat(tool_choice="required"), 400),
    Case(
        "tool-choice-unknown-function",
        CHAT,
        chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),
        400,
    ),
    Case(
        "tool-choice-function-string",
        CHAT,
        chat(tools=[TOOL], tool_choice={"type": "function", "function": "f"}),
        400,
    ),
    Case("tool-choice-list", CHAT, chat(tools=[TOOL], tool_choice=["f"]), 400),
    Case("response-format-string", CHAT, chat(response_format="json"), 400, "invalid_type"),
    Case("response-format-no-type", CHAT, chat(response_format={}), 400),
    Case("response-format-xml", CHAT, chat(response_format={"type": "xml"}), 400),
    Case("json-schema-missing", CHAT, chat(response_format={"type": "json_schema"}), 400),
    Case(
        "json-schema-string",
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"schema": "s"}}),
        400,
    ),
    Case(
        "json-schema-invalid",
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": 5}}}),
        400,
    ),
    Case(
        "json-schema-bad-regex",
        CHAT,
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"schema": {"type": "string", "pattern": "("}},
            }
        ),
        400,
    ),
    Case(
        "json-schema-strict-string",
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"schema": {}, "strict": "y"}}),
        400,
    ),
    Case(
        "json-schema-nested-300",
        CHAT,
        chat(
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": nested_obj(300)}}
        ),
        400,
    ),
    Case(
        "structural-tag-nested-300",
        CHAT,
        chat(response_format={"type": "structural_tag", "structures": nested_list(300), "triggers": []}),
        400,
    ),
    Case(
        "structural-tag-garbage",
        CHAT,
        chat(response_format={"type": "structural_tag", "structures": 5, "triggers": "x"}),
        400,
        defect="response_format structural_tag is passed to the engine unvalidated (structures: 5)",
    ),
    # -- /v1/completions
    Case("prompt-missing", COMP, comp(), 400, "invalid_type"),
    Case("prompt-int", COMP, comp(prompt=5), 400, "invalid_type"),
    Case("prompt-empty-string", COMP, comp(prompt=""), 400),
    Case("prompt-empty-list", COMP, comp(prompt=[]), 400, "invalid_type"),
    Case("prompt-empty-id-list", COMP, comp(prompt=[[]]), 400, "invalid_type"),
    Case("prompt-mixed-list", COMP, comp(prompt=["a", 1]), 400, "invalid_type"),
    Case("prompt-bool-ids", COMP, comp(prompt=[True]), 400, "invalid_type"),
    Case("prompt-float-ids", COMP, comp(prompt=[1.0]), 400, "invalid_type"),
    Case("prompt-negative-id", COMP, comp(prompt=[-1]), 400, "invalid_type"),
    Case("prompt-id-outside-vocab", COMP, comp(prompt=[VOCAB]), 400),
    Case("prompt-id-outside-vocab-2nd", COMP, comp(prompt=[[1], [999999]]), 400),
    Case("prompt-id-2**40", COMP, comp(prompt=[[2**40]]), 400),
    Case(
        "prompt-negative-id-nested",
        COMP,
        comp(prompt=[[1, -1]]),
        400,
    ),
    Case("prompt-over-context", COMP, comp(prompt=[1] * 5000), 400, "context_length_exceeded"),
    Case(
        "prompt-over-context-2nd-stream",
        COMP,
        comp(prompt=[[1], [1] * 5000], stream=True),
        400,
        "context_length_exceeded",
    ),
    Case("prompt-empty-2nd-stream", COMP, comp(prompt=["a", ""], stream=True), 400),
    Case("prompts-x-n-over-128", COMP, comp(prompt=["a"] * 129), 400),
    Case(
        "generate-ids-over-context",
        "/generate",
        {"model": "qwen3", "input_ids": [1] * 5000, "sampling_params": {"max_new_tokens": 2}},
        400,
        "context_length_exceeded",
    ),
    Case("echo-string", COMP, comp(prompt="a", echo="y"), 400, "invalid_type"),
    Case("completion-logprobs-true", COMP, comp(prompt="a", logprobs=True), 400, "invalid_type"),
    Case("completion-logprobs-21", COMP, comp(prompt="a", logprobs=21), 400, "invalid_value"),
    Case("suffix", COMP, comp(prompt="a", suffix="b"), 400, "unsupported_parameter"),
    Case("best-of-2", COMP, comp(prompt="a", best_of=2), 400, "unsupported_parameter"),
    Case("best-of-0", COMP, comp(prompt="a", best_of=0), 400, "invalid_value"),
    Case("completion-max-tokens-0", COMP, comp(prompt="a", max_tokens=0), 400, "invalid_value"),
    Case("relay-bad-prompt", COMP, comp(model="relay", prompt=5), 400, "invalid_type"),
    Case("relay-bad-sampling", CHAT, chat(model="relay", temperature="hot"), 400, "invalid_type"),
    # -- /v1/tokenize, /v1/detokenize
    Case("tokenize-empty", "/v1/tokenize", {}, 404, "model_not_found"),  # several models: no default
    Case("tokenize-prompt-int", "/v1/tokenize", {"model": "qwen3", "prompt": 5}, 400),
    Case(
        "tokenize-add-special-string",
        "/v1/tokenize",
        {"model": "qwen3", "prompt": "x", "add_special_tokens": "no"},
        400,
    ),
    Case("tokenize-messages-string", "/v1/tokenize", {"model": "qwen3", "messages": "x"}, 400),
    Case("tokenize-messages-int", "/v1/tokenize", {"model": "qwen3", "messages": [1]}, 400),
    Case(
        "tokenize-role-int",
        "/v1/tokenize",
        {"model": "qwen3", "messages": [{"role": 5, "content": "x"}]},
        400,
    ),
    Case(
        "tokenize-content-int",
        "/v1/tokenize",
        {"model": "qwen3", "messages": [{"role": "user", "content": 5}]},
        400,
    ),
    Case("tokenize-no-content", "/v1/tokenize", {"model": "qwen3", "messages": [{"role": "user"}]}, 400),
    Case("tokenize-tools-string", "/v1/tokenize", {"model": "qwen3", "messages": MSGS, "tools": "x"}, 400),
    Case("tokenize-tools-int", "/v1/tokenize", {"model": "qwen3", "messages": MSGS, "tools": [1]}, 400),
    Case(
        "tokenize-generation-prompt-string",
        "/v1/tokenize",
        {"model": "qwen3", "messages": MSGS, "add_generation_prompt": "x"},
        400,
    ),
    Case(
        "tokenize-kwargs-list",
        "/v1/tokenize",
        {"model": "qwen3", "messages": MSGS, "chat_template_kwargs": [1]},
        400,
    ),
    Case("tokenize-nemo-roles", "/v1/tokenize", {"model": "nemo", "messages": [MSGS[0], MSGS[0]]}, 400),
    Case("tokenize-nul-ok", "/v1/tokenize", {"model": "qwen3", "prompt": "a\x00b"}, 200),
    Case(
        "tokenize-content-parts",
        "/v1/tokenize",
        {"model": "qwen3", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        200,
    ),
    Case("detokenize-empty", "/v1/detokenize", {}, 404, "model_not_found"),
    Case("detokenize-tokens-string", "/v1/detokenize", {"model": "qwen3", "tokens": "1,2"}, 400),
    Case("detokenize-negative", "/v1/detokenize", {"model": "qwen3", "tokens": [-1]}, 400),
    Case("detokenize-vocab-size", "/v1/detokenize", {"model": "qwen3", "tokens": [VOCAB]}, 400),
    Case("detokenize-2**40", "/v1/detokenize", {"model": "qwen3", "tokens": [2**40]}, 400),
    Case("detokenize-floats", "/v1/detokenize", {"model": "qwen3", "tokens": [1.0]}, 400),
    Case("detokenize-bools", "/v1/detokenize", {"model": "qwen3", "tokens": [True]}, 400),
    Case("detokenize-nested-mixed", "/v1/detokenize", {"model": "qwen3", "tokens": [[1], 2]}, 400),
    Case("detokenize-nested-deep", "/v1/detokenize", {"model": "qwen3", "tokens": [[[1]]]}, 400),
    Case("detokenize-batch", "/v1/detokenize", {"model": "qwen3", "tokens": [[1], [2, 3]]}, 200),
    Case(
        "detokenize-skip-string",
        "/v1/detokenize",
        {"model": "qwen3", "tokens": [1], "skip_special_tokens": "x"},
        400,
    ),
    Case("detokenize-partial-utf8-ok", "/v1/detokenize", {"model": "qwen3", "tokens": [195]}, 200),
    # -- body size (limit 1 MiB), encodings, content types
    Case("body-at-limit", COMP, b"", 400, "context_length_exceeded"),  # body built in the test: exactly LIMIT
    Case("body-limit-plus-1", COMP, b"", 413, "body_too_large"),  # body built in the test: LIMIT + 1
    Case(
        "body-10mb",
        CHAT,
        b'{"model":"qwen3","messages":[{"role":"user","content":"' + b"a" * 10_000_000 + b'"}]}',
        413,
        "body_too_large",
    ),
    Case(
        "gzip-bomb",
        CHAT,
        gzip.compress(b" " * (20 * LIMIT)),
        413,
        "body_too_large",
        headers=(("content-encoding", "gzip"),),
    ),
    Case("gzip-valid", CHAT, gzip.compress(VALID), 200, headers=(("content-encoding", "gzip"),)),
    Case(
        "gzip-corrupt",
        CHAT,
        VALID,
        400,
        headers=(("content-encoding", "gzip"),),
    ),
    Case(
        "brotli-unsupported",
        CHAT,
        VALID,
        frozenset({400, 415}),
        headers=(("content-encoding", "br"),),
    ),
    # a JSON body must say it is JSON (a browser cannot send that cross-origin without a preflight)
    Case(
        "content-type-text",
        CHAT,
        VALID,
        415,
        "unsupported_media_type",
        headers=(("content-type", "text/plain"),),
    ),
    Case(
        "content-type-form",
        CHAT,
        b"model=qwen3&messages=hi",
        415,
        "unsupported_media_type",
        headers=(("content-type", "application/x-www-form-urlencoded"),),
    ),
    Case(
        "content-type-json-charset-ok",
        CHAT,
        VALID,
        200,
        headers=(("content-type", "application/json; charset=utf-8"),),
    ),
    Case(
        "keys-content-type-text",
        "/admin/keys",
        {"name": "x"},
        415,
        "unsupported_media_type",
        headers=(("content-type", "text/plain"),),
    ),
    Case(
        "keys-foreign-origin",
        "/admin/keys",
        {"name": "x"},
        403,
        "cross_origin_refused",
        headers=(("origin", "http://evil.example"),),
    ),
    # -- routes and methods
    Case("get-chat", CHAT, b"", 405, method="GET"),
    Case("put-chat", CHAT, VALID, 405, method="PUT"),
    Case("delete-completions", COMP, b"", 405, method="DELETE"),
    Case("options-chat", CHAT, b"", 405, method="OPTIONS"),
    Case("post-models", "/v1/models", b"{}", 405),
    Case("get-tokenize", "/v1/tokenize", b"", 405, method="GET"),
    Case("post-health", "/health", b"{}", 405),
    Case("trace-health", "/health", b"", 405, method="TRACE"),
    Case("patch-workers", "/workers", b"{}", 405, method="PATCH"),
    Case("unknown-route", "/v1/nothing", b"{}", 404),
    Case("unknown-model-id", "/v1/models/no-such-model", b"", 404, "model_not_found", method="GET"),
    Case("nul-in-path", "/%00", b"", 404, method="GET"),
    Case("dot-dot-path", "/v1/chat/completions/../../health", b"", 404, method="GET"),
    Case("mesh-off", "/mesh/members", b"", 404, "mesh_disabled", method="GET"),
    # -- worker admin (URL validation with a model_id is in test_worker_urls)
    Case("worker-no-url", "/workers", {}, 400),
    Case("worker-url-int", "/workers", {"url": 5}, 400),
    Case("worker-url-empty", "/workers", {"url": "", "model_id": "qwen3"}, 400, "invalid_worker_url"),
    Case("worker-url-ftp", "/workers", {"url": "ftp://x:1", "model_id": "qwen3"}, 400, "invalid_worker_url"),
    Case("worker-url-javascript", "/workers", {"url": "javascript:alert(1)"}, 400, "invalid_worker_url"),
    Case(
        "worker-url-no-host", "/workers", {"url": "grpc://", "model_id": "qwen3"}, 400, "invalid_worker_url"
    ),
    Case("worker-model-needed", "/workers", {"url": "grpc://127.0.0.1:9"}, 400),
    Case(
        "worker-model-unknown",
        "/workers",
        {"url": "grpc://127.0.0.1:9", "model_id": "nope"},
        404,
        "model_not_found",
    ),
    Case(
        "worker-model-int", "/workers", {"url": "grpc://127.0.0.1:9", "model_id": 5}, 404, "model_not_found"
    ),
    Case("worker-get-unknown", "/workers/nope", b"", 404, "worker_not_found", method="GET"),
    Case("worker-delete-unknown", "/workers/nope", b"", 404, "worker_not_found", method="DELETE"),
    Case("worker-delete-no-id", "/workers", b"", 400, "missing_parameter", method="DELETE"),
    Case(
        "worker-delete-unknown-url", "/workers?url=grpc://x:1", b"", 404, "worker_not_found", method="DELETE"
    ),
    # -- auth (data plane: /v1/models; control plane: /admin/keys)
    Case("auth-none", "/v1/models", b"", 401, "missing_credentials", method="GET", auth=None),
    Case("auth-empty", "/v1/models", b"", 401, method="GET", auth=""),
    Case("auth-bearer-no-key", "/v1/models", b"", 401, "missing_credentials", method="GET", auth="Bearer"),
    Case(
        "auth-basic", "/v1/models", b"", 401, "invalid_auth_scheme", method="GET", auth="Basic dXNlcjpwYXNz"
    ),
    Case(
        "auth-token-scheme",
        "/v1/models",
        b"",
        401,
        "invalid_auth_scheme",
        method="GET",
        auth="Token " + ADMIN_KEY,
    ),
    Case(
        "auth-key-without-scheme", "/v1/models", b"", 401, "invalid_auth_scheme", method="GET", auth=ADMIN_KEY
    ),
    Case("auth-wrong-key", "/v1/models", b"", 401, "invalid_api_key", method="GET", auth="Bearer sk-wrong"),
    Case("auth-key-plus-junk", "/v1/models", b"", 401, method="GET", auth=ADMIN + " extra"),
    Case("auth-jwt-shaped", "/v1/models", b"", 401, method="GET", auth="Bearer eyJhbGciOiJub25lIn0.e30."),
    Case("auth-8000-chars", "/v1/models", b"", 401, method="GET", auth="Bearer " + "k" * 8000),
    Case(
        "auth-9000-chars",
        "/v1/models",
        b"",
        401,
        method="GET",
        auth="Bearer " + "k" * 9000,
    ),
    Case("auth-chat-wrong-key", CHAT, chat(), 401, "invalid_api_key", auth="Bearer sk-wrong"),
    Case("auth-keys-no-key", "/admin/keys", {"name": "x"}, 401, auth=None),
    Case("keys-name-int", "/admin/keys", {"name": 5}, 400),
    Case("keys-name-newline", "/admin/keys", {"name": "a\nb"}, 400),
    Case("keys-name-long", "/admin/keys", {"name": "x" * 201}, 400),
    Case("keys-role-root", "/admin/keys", {"role": "root"}, 400),
    Case("keys-tenant-int", "/admin/keys", {"tenant": 5}, 400),
    Case("keys-models-string", "/admin/keys", {"models": "qwen3"}, 400),
    Case("keys-models-empty-name", "/admin/keys", {"models": [""]}, 400),
    Case("keys-expires-negative", "/admin/keys", {"expires_in": -1}, 400),
    Case("keys-expires-string", "/admin/keys", {"expires_in": "1"}, 400),
    Case("keys-expires-bool", "/admin/keys", {"expires_in": True}, 400),
    Case("keys-expires-past", "/admin/keys", {"expires_at": 1}, 400),
    Case("keys-expires-both", "/admin/keys", {"expires_in": 1, "expires_at": 2}, 400),
    Case("keys-body-array", "/admin/keys", b"[]", 400, "invalid_json"),
    Case("keys-get-unknown", "/admin/keys/nope", b"", 404, "key_not_found", method="GET"),
    Case("keys-delete-unknown", "/admin/keys/nope", b"", 404, "key_not_found", method="DELETE"),
    # -- headers
    Case("request-id-8000-chars-ok", CHAT, chat(), 200, headers=(("x-request-id", "r" * 8000),)),
    Case("routing-key-8000-chars-ok", CHAT, chat(), 200, headers=(("x-smg-routing-key", "k" * 8000),)),
    Case("target-worker-unknown", CHAT, chat(), 400, headers=(("x-smg-target-worker", "nope"),)),
    Case(
        "target-worker-other-model",
        CHAT,
        chat(model="llama"),
        400,
        headers=(("x-smg-target-worker", "grpc://nowhere:1"),),
    ),
]


def _param(case: Case) -> Any:
    marks = [pytest.mark.xfail(strict=True, reason=f"defect: {case.defect}")] if case.defect else []
    return pytest.param(case, id=case.id, marks=marks)


def _body(case: Case) -> bytes:
    if case.id == "body-at-limit":  # token ids, so nothing is tokenized: the context check answers
        head, tail = b'{"model":"qwen3","max_tokens":2,"prompt":[', b"]}"
        n = (LIMIT - len(head) - len(tail) + 1) // 2
        body = head + b",".join([b"1"] * n) + tail
        return body + b" " * (LIMIT - len(body))
    if case.id == "body-limit-plus-1":
        return b" " * (LIMIT + 1)
    return case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_hostile_request(case: Case, node: NodeProc, engine: MockEngineProc, http: httpx.Client) -> None:
    headers = {"content-type": "application/json", **dict(case.headers)}
    if case.auth is not None:
        headers["authorization"] = case.auth
    body = _body(case)
    if case.id == "body-at-limit":
        assert len(body) == LIMIT
    r = http.request(case.method, node.url + case.path, content=body, headers=headers)
    assert_intact(node, engine, http)  # first: a failing status must not hide a broken node
    assert_envelope(r, case.status, case.code)


# ---- requests that need more than one call -----------------------------------------------------


BAD_WORKER_URLS = [
    "grpc://127.0.0.1:abc",  # 500 today (int() in the h2 client)
    "grpc://127.0.0.1:1/path?q#f",  # 500 today
    "grpc://" + "a" * 300 + ":1",  # 500 today, and the worker is registered anyway
    "grpc://127.0.0.1:99999",  # 201 today: workers that can never be healthy
    "grpc://127.0.0.1:-1",
    "grpc://:0",
    "grpc://bad host:1",
    "grpc://127.0.0.1:1\n",
    "http://[::1",
]


@pytest.mark.parametrize("url", BAD_WORKER_URLS)
def test_worker_urls(url: str, node: NodeProc, engine: MockEngineProc, http: httpx.Client) -> None:
    h = {"authorization": ADMIN}
    before = {w["id"] for w in http.get(node.url + "/workers", headers=h).json()["workers"]}
    try:
        r = http.post(node.url + "/workers", json={"url": url, "model_id": "qwen3"}, headers=h)
        after = {w["id"] for w in http.get(node.url + "/workers", headers=h).json()["workers"]}
        assert_intact(node, engine, http)
        assert_envelope(r, 400, "invalid_worker_url")
        assert after == before, "a rejected worker must not be registered"
    finally:
        for w in http.get(node.url + "/workers", headers=h).json()["workers"]:
            if w["id"] not in before:
                http.delete(f"{node.url}/workers/{w['id']}", headers=h)


def test_worker_readded_for_other_model(node: NodeProc, engine: MockEngineProc, http: httpx.Client) -> None:
    h = {"authorization": ADMIN}
    r = http.post(node.url + "/workers", json={"url": "grpc://127.0.0.1:9", "model_id": "qwen3"}, headers=h)
    assert r.status_code == 202, r.text
    wid = r.json()["id"]
    try:
        again = http.post(
            node.url + "/workers", json={"url": "grpc://127.0.0.1:9", "model_id": "llama"}, headers=h
        )
        assert_intact(node, engine, http)
        assert_envelope(again, 409)
    finally:
        http.delete(f"{node.url}/workers/{wid}", headers=h)


def test_target_worker_of_wrong_kind(node: NodeProc, engine: MockEngineProc, http: httpx.Client) -> None:
    h = {"authorization": ADMIN}
    r = http.post(node.url + "/workers", json={"url": "http://127.0.0.1:9", "model_id": "qwen3"}, headers=h)
    assert r.status_code == 202, r.text
    wid = r.json()["id"]
    try:
        got = http.post(node.url + CHAT, json=chat(), headers={**h, "x-smg-target-worker": wid})
        assert_intact(node, engine, http)
        assert_envelope(got, 400)
    finally:
        http.delete(f"{node.url}/workers/{wid}", headers=h)


def test_user_key_on_control_plane(node: NodeProc, engine: MockEngineProc, http: httpx.Client) -> None:
    h = {"authorization": ADMIN}
    r = http.post(node.url + "/admin/keys", json={"name": "hostile-user", "role": "user"}, headers=h)
    assert r.status_code == 201, r.text
    key, kid = r.json()["key"], r.json()["id"]
    try:
        user = {"authorization": f"Bearer {key}"}
        assert_envelope(http.post(node.url + "/workers", json={"url": "grpc://x:1"}, headers=user), 403)
        assert_envelope(http.get(node.url + "/admin/keys", headers=user), 403)
        assert_envelope(
            http.post(node.url + CHAT, json=chat(max_tokens=0), headers=user), 400, "invalid_value"
        )
    finally:
        assert http.delete(f"{node.url}/admin/keys/{kid}", headers=h).status_code == 200
    assert_envelope(http.get(node.url + "/v1/models", headers={"authorization": f"Bearer {key}"}), 401)
    assert_intact(node, engine, http)


def test_probes_and_metrics_stay_bounded(node: NodeProc, engine: MockEngineProc, http: httpx.Client) -> None:
    marker = "zz" + os.urandom(4).hex()
    for i in range(20):
        assert_envelope(http.get(f"{node.url}/{marker}/{i}", headers={"authorization": ADMIN}), 404)
    for path in ("/health", "/readiness", "/liveness"):
        assert http.get(node.url + path).status_code == 200
    assert_envelope(http.get(node.url + "/metrics"), 401)  # a control route: admins only
    m = http.get(node.url + "/metrics", headers={"authorization": ADMIN})
    assert m.status_code == 200 and "smg_requests_total" in m.text
    assert marker not in m.text, "unknown paths must not become metric labels"
    assert_intact(node, engine, http)


# ---- HTTP framing: cut bodies, malformed messages ----------------------------------------------


def raw_exchange(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := s.recv(65536):
                out += chunk
        return out


# (with the credential: a caller refused at its head would have its 401 before any framing is read)
POST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + (
    b"Authorization: %s\r\n" % ADMIN.encode()
)


def node_in_flight(node: NodeProc, http: httpx.Client) -> int:
    """HTTP requests the node is still handling, once it had time to notice closed connections."""
    n = 0
    for _ in range(100):  # bounded
        n = http.get(node.url + "/health").json()["in_flight"]  # inference requests: not /health itself
        if n == 0:
            break
        time.sleep(0.05)
    return n


@pytest.mark.parametrize(
    "head",
    [
        b"Content-Length: 1000\r\n",  # the body is shorter than announced
        b"Transfer-Encoding: chunked\r\n",  # a chunk cut in the middle
    ],
    ids=["content-length", "chunked"],
)
def test_body_cut_midway(head: bytes, node: NodeProc, engine: MockEngineProc, http: httpx.Client) -> None:
    prefix = b"10\r\n" if b"chunked" in head else b""
    socks = []
    for _ in range(3):
        s = socket.create_connection(("127.0.0.1", node.port), timeout=5)
        s.sendall(POST + head + b"\r\n" + prefix + VALID[:10])
        socks.append(s)
    for s in socks:
        s.close()
    assert node_in_flight(node, http) == 0
    assert_intact(node, engine, http)


@pytest.mark.parametrize(
    "data",
    [
        POST + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
        POST + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        POST + b"Content-Length: -1\r\n\r\n",
        POST + b"Content-Length: 99999999999999999999\r\n\r\n",
        b"HELLO\r\n\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\r\n\r\n",
    ],
    ids=[
        "bad-chunk-size",
        "cl-and-te",
        "cl-negative",
        "cl-overflow",
        "garbage",
        "h2-preface",
        "nul-in-header",
    ],
)
def test_malformed_http(data: bytes, node: NodeProc, engine: MockEngineProc, http: httpx.Client) -> None:
    """Not HTTP/1.1 at all: answered 400 and the connection closed (by the lean server, the default, in
    the OpenAI error envelope; aiohttp's server, ``--http-server aiohttp``, answers a bare 400)."""
    out = raw_exchange(node.port, data)
    assert out.split(b"\r\n", 1)[0].split(b" ")[1] == b"400", out[:200]
    assert_intact(node, engine, http)


# ---- streams and disconnects --------------------------------------------------------------------


STREAMS = [
    (CHAT, {"model": "qwen3", "messages": MSGS, "max_tokens": 400, "ignore_eos": True, "stream": True}),
    (
        CHAT,
        {"model": "nemo", "messages": MSGS, "max_tokens": 400, "ignore_eos": True, "stream": True, "n": 3},
    ),
    (
        COMP,
        {
            "model": "llama",
            "prompt": ["a", "b"],
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
            "n": 2,
        },
    ),
    (
        CHAT,
        {
            "model": "qwen3",
            "messages": MSGS,
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
            "stop": ["~~"],
        },
    ),
    (COMP, {"model": "relay", "prompt": "abc", "max_tokens": 400, "ignore_eos": True, "stream": True}),
]


@pytest.mark.parametrize(
    ("path", "body"), STREAMS, ids=["chat", "vllm-n3", "completions-2x2", "stop", "relay"]
)
def test_disconnect_mid_stream(
    path: str, body: dict[str, Any], node: NodeProc, engine: MockEngineProc, http: httpx.Client
) -> None:
    rid = f"hostile-dc-{time.time_ns()}"
    headers = {"authorization": ADMIN, "x-request-id": rid}
    with (
        httpx.Client(timeout=30) as c,
        c.stream("POST", node.url + path, json=body, headers=headers) as r,
    ):
        assert r.status_code == 200
        first = next(r.iter_raw())
        assert first.startswith(b"data: {")
        assert b"[DONE]" not in first  # 400 tokens to go: the client leaves mid-stream
    # the disconnect happened and reached the engine: it ended this very request early
    assert saw_abort(engine, http, rid), f"the engine saw no abort of {rid}"
    assert_intact(node, engine, http)  # the engine request was aborted, not left running


@pytest.mark.parametrize(("path", "body"), STREAMS[:3], ids=["chat", "vllm-n3", "completions-2x2"])
def test_disconnect_non_stream(
    path: str, body: dict[str, Any], node: NodeProc, engine: MockEngineProc, http: httpx.Client
) -> None:
    rid = f"hostile-dc-{time.time_ns()}"
    headers = {"authorization": ADMIN, "x-request-id": rid}
    with pytest.raises(httpx.TimeoutException):  # 400 tokens take longer: the client gives up (disconnects)
        httpx.post(node.url + path, json={**body, "stream": False}, headers=headers, timeout=0.3)
    assert saw_abort(engine, http, rid), f"the engine saw no abort of {rid}"
    assert_intact(node, engine, http)


@pytest.mark.usefixtures("reset_faults")
@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_disconnect_before_first_token(
    stream: bool, node: NodeProc, engine: MockEngineProc, http: httpx.Client
) -> None:
    assert (
        http.post(f"{engine.http_url}/mock/faults", json={"hang_before_first_token": True}).status_code < 300
    )
    rid = f"hostile-dc-{time.time_ns()}"
    headers = {"authorization": ADMIN, "x-request-id": rid}
    with pytest.raises(httpx.TimeoutException):  # the engine hangs: the client gives up (disconnects)
        httpx.post(node.url + CHAT, json=chat(stream=stream), headers=headers, timeout=0.3)
    assert saw_abort(engine, http, rid), f"the engine saw no abort of {rid}"
    assert (
        http.post(f"{engine.http_url}/mock/faults", json={"hang_before_first_token": False}).status_code < 300
    )
    assert_intact(node, engine, http)


def test_concurrent_cancellations(node: NodeProc, engine: MockEngineProc, http: httpx.Client) -> None:
    rng = random.Random(7)
    delays = [rng.uniform(0.0, 0.25) for _ in range(40)]

    async def one(i: int, c: httpx.AsyncClient) -> str:
        body = {
            "model": ("qwen3", "nemo", "llama")[i % 3],
            "messages": [{"role": "user", "content": f"story {i}"}],
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": i % 2 == 0,
            "n": 1 + i % 3,
        }
        try:
            async with asyncio.timeout(delays[i]):
                if body["stream"]:
                    async with c.stream("POST", node.url + CHAT, json=body) as r:
                        async for _ in r.aiter_raw():
                            pass
                else:
                    await c.post(node.url + CHAT, json=body)
            return "done"
        except TimeoutError:
            return "cancelled"

    async def run() -> list[str]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=30, limits=limits, headers={"authorization": ADMIN}) as c:
            return await asyncio.gather(*(one(i, c) for i in range(len(delays))))

    results = asyncio.run(run())
    assert "cancelled" in results
    assert_intact(node, engine, http)
    workers = http.get(node.url + "/workers", headers={"authorization": ADMIN}).json()["workers"]
    assert all(w["in_flight"] == 0 for w in workers), workers
    assert node_in_flight(node, http) == 0


def test_reused_request_id_cannot_abort_another_request(
    node: NodeProc, engine: MockEngineProc, http: httpx.Client
) -> None:
    started = threading.Event()
    out: dict[str, bytes] = {}
    h = {"authorization": ADMIN, "x-request-id": "hostile-shared-id"}
    body = {"model": "qwen3", "messages": MSGS, "max_tokens": 1000, "ignore_eos": True, "stream": True}

    def victim() -> None:
        with httpx.Client(timeout=30) as c, c.stream("POST", node.url + CHAT, json=body, headers=h) as r:
            chunks = []
            for chunk in r.iter_raw():
                chunks.append(chunk)
                started.set()
            out["raw"] = b"".join(chunks)

    t = threading.Thread(target=victim)
    t.start()
    try:
        assert started.wait(30)
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(node.url + CHAT, json={**body, "stream": False}, headers=h, timeout=0.2)
    finally:
        t.join(60)
    assert_intact(node, engine, http)
    finishes = [
        c.get("finish_reason")
        for e in sse_data(out["raw"])
        if e != "[DONE]"
        for c in json.loads(e).get("choices", [])
        if c.get("finish_reason")
    ]
    assert finishes == ["length"], finishes


# ---- engine timeouts (aux node: --request-timeout-secs 0.8) ----------------------------------------


@pytest.mark.usefixtures("reset_faults")
def test_engine_stall_times_out(aux: NodeProc, engine: MockEngineProc, http: httpx.Client) -> None:
    faults = {"stall_after_tokens": 2, "stall_seconds": 5.0}
    assert http.post(f"{engine.http_url}/mock/faults", json=faults).status_code < 300
    assert_envelope(http.post(aux.url + CHAT, json=chat(max_tokens=20)), 504, "engine_timeout")
    r = http.post(aux.url + CHAT, json=chat(max_tokens=20, stream=True))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert assert_sse_error_then_done(r.content)["code"] == "engine_timeout"
    r2 = http.post(aux.url + COMP, json=comp(prompt=["a", "b"], max_tokens=20, stream=True))
    assert r2.status_code == 200
    assert_sse_error_then_done(r2.content)
    assert http.post(f"{engine.http_url}/mock/faults", json={"stall_after_tokens": None}).status_code < 300
    assert_intact(aux, engine, http, auth=None)


@pytest.mark.usefixtures("reset_faults")
def test_engine_hang_times_out(aux: NodeProc, engine: MockEngineProc, http: httpx.Client) -> None:
    assert (
        http.post(f"{engine.http_url}/mock/faults", json={"hang_before_first_token": True}).status_code < 300
    )
    assert_envelope(http.post(aux.url + CHAT, json=chat()), 504, "engine_timeout")
    assert_envelope(http.post(aux.url + CHAT, json=chat(stream=True)), 504, "engine_timeout")
    assert (
        http.post(f"{engine.http_url}/mock/faults", json={"hang_before_first_token": False}).status_code < 300
    )
    assert_intact(aux, engine, http, auth=None)


def test_key_with_huge_expiry(aux: NodeProc, engine: MockEngineProc, http: httpx.Client) -> None:
    r = http.post(aux.url + "/admin/keys", json={"name": "forever", "expires_in": 1e308})
    listing = http.get(aux.url + "/admin/keys")
    assert_intact(aux, engine, http, auth=None)
    assert_envelope(r, frozenset({201, 400}))
    assert listing.status_code == 200, listing.text


# ---- the circuit breaker under hostile input (a node of its own: these tests break its worker) ------


@pytest.fixture(scope="module")
def breaker(engine: MockEngineProc, tokenizer_dir: Path) -> Iterator[NodeProc]:
    """The circuit opens on the first failure, half-opens after 0.3 s and one success closes it."""
    with single_node(
        engine,
        tokenizer_dir,
        *("--cb-failure-threshold", "1", "--cb-success-threshold", "1", "--cb-timeout-duration-secs", "0.3"),
    ) as n:
        yield n


def recovered(n: NodeProc, http: httpx.Client) -> int:
    """Status of a plain request once the circuit had time to close (bounded polling, no timing claim)."""
    status = 0
    for _ in range(10):
        status = http.post(n.url + CHAT, json=chat()).status_code
        if status == 200:
            break
        time.sleep(0.2)
    return status


def test_client_errors_do_not_open_the_circuit(
    breaker: NodeProc, engine: MockEngineProc, http: httpx.Client
) -> None:
    try:
        rejected = http.post(breaker.url + CHAT, json=chat(n=128, max_tokens=3000, ignore_eos=True))
        assert 400 <= rejected.status_code < 600, rejected.text  # its status: case engine-rejects-request
        r = http.post(breaker.url + CHAT, json=chat())
        assert r.status_code == 200, r.text
    finally:
        recovered(breaker, http)  # leave a closed circuit to the next test


@pytest.mark.usefixtures("reset_faults")
def test_disconnect_during_half_open_trial(
    breaker: NodeProc, engine: MockEngineProc, http: httpx.Client
) -> None:
    faults = f"{engine.http_url}/mock/faults"
    assert recovered(breaker, http) == 200
    assert http.post(faults, json={"error_rate": 1.0, "error_code": "INTERNAL"}).status_code < 300
    assert_envelope(http.post(breaker.url + CHAT, json=chat()), 502)  # a real engine failure: circuit opens
    assert http.post(faults, json={"error_rate": 0.0, "hang_before_first_token": True}).status_code < 300
    time.sleep(0.4)  # past the cool-down: the next request is the half-open trial
    with contextlib.suppress(httpx.TimeoutException):
        httpx.post(breaker.url + CHAT, json=chat(), timeout=0.3)  # ... and its client gives up
    assert http.post(faults, json={"hang_before_first_token": False}).status_code < 300
    status = recovered(breaker, http)
    assert status == 200, http.get(breaker.url + "/workers").text
