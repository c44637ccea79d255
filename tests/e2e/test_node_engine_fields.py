"""End to end: what a node sends SGLang and vLLM workers, against what SMG sends (smg-grpc-proto), through
a real node over real mock engines on loopback (ports 50000-50999, scratch files under /tmp/fix_proto/),
each request read back from the mock's record of what it got (``/mock/stats`` ``requests``):

- the model's sampling defaults (GetModelInfo ``default_sampling_params_json``) fill what the client
  left unset, on chat, completions, /generate and Messages, on both engines;
- engine request ids are prefix-free: SGLang aborts by id prefix, so a completions prompt list whose
  first prompt ends on a stop string keeps its other prompts (the mock aborts by prefix, as SGLang);
- SGLang's ``require_reasoning`` when the request thinks; ``max_new_tokens`` unset when the client gave
  no max_tokens; stop strings to vLLM (``stop``), single-token ones to SGLang (``stop_token_ids``);
  vLLM's seed saturated; /generate's ``no_stop_trim``; stop strings not before ``min_tokens``;
- a worker started with --skip-tokenizer-init: ``min_tokens`` is a 400 naming it.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from shepherd.proto.engine_requests import fold_seed
from tests.e2e.node_fixtures import QWEN3_TEMPLATE
from tests.e2e.node_procs import NodeProc, reserved_port, running_node
from tests.e2e.procs import MockEngineProc, start_mock_engine
from tests.e2e.test_node_tools import byte_tokenizer

SCRATCH = Path("/tmp/fix_proto")
DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
SG, VL, SKIP = "sg", "vl", "skip"


def port() -> int:
    """A loopback port free now (below the ephemeral range: ``node_procs.reserved_port``)."""
    return reserved_port()


@contextlib.contextmanager
def engine(tokenizer: Path, *args: str) -> Iterator[MockEngineProc]:
    ports = ("--grpc-port", str(port()), "--http-port", str(port()))
    with start_mock_engine(*ports, "--tokenizer", str(tokenizer), "--context-length", "65536", *args) as e:
        yield e


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    d = SCRATCH / f"e2e-{uuid.uuid4().hex[:8]}"
    d.mkdir(parents=True)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def engines(scratch: Path) -> Iterator[tuple[MockEngineProc, MockEngineProc]]:
    """The model's engine (sampling defaults reported; 15 ms a token, so that a stop's Abort arrives
    while the other prompts of a list still run) and an SGLang one started with --skip-tokenizer-init."""
    tok = byte_tokenizer(scratch / "bytes")
    with (
        engine(
            tok,
            *("--default-sampling-params", json.dumps(DEFAULTS)),
            *("--output-len", "12", "--decode-ms-per-token", "15", "--prefill-us-per-token", "0"),
        ) as main,
        engine(tok, "--zero-latency", "--output-len", "4", "--skip-tokenizer-init") as skip,
    ):
        yield main, skip


@pytest.fixture(scope="module")
def node(scratch: Path, engines: tuple[MockEngineProc, MockEngineProc]) -> Iterator[NodeProc]:
    main, skip = engines

    def model(name: str, url: str, reasoning: str) -> dict[str, Any]:
        return {
            "name": name,
            "model_path": str(scratch / "bytes"),
            "worker_urls": [url],
            "chat_template": str(QWEN3_TEMPLATE),
            "reasoning_parser": reasoning,
            "tool_call_parser": "none",
        }

    cfg = scratch / "node.yaml"
    models = [
        model(SG, f"sglang://{main.grpc_target}", "qwen3"),
        model(VL, f"vllm://{main.grpc_target}", "qwen3"),
        model(SKIP, f"sglang://{skip.grpc_target}", "none"),
    ]
    cfg.write_text(yaml.safe_dump({"models": models, "tokenizer_workers": 0}))
    with running_node("--config", str(cfg), port=port()) as n:
        yield n


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as c:
        yield c


def rid() -> str:
    return f"req-{uuid.uuid4().hex[:12]}"


def got(http: httpx.Client, e: MockEngineProc, rid: str) -> list[dict[str, Any]]:
    """What the engine got for client request id ``rid`` (its engine ids: a unique token, then ``rid``)."""
    reqs = http.get(f"{e.http_url}/mock/stats").json()["requests"]
    return [r for r in reqs if r["request_id"].partition(".")[2].startswith(rid)]


def one(http: httpx.Client, e: MockEngineProc, rid: str) -> dict[str, Any]:
    [r] = got(http, e, rid)
    return r


def script(http: httpx.Client, e: MockEngineProc, text: str, match: str) -> None:
    r = http.post(f"{e.http_url}/mock/responses", json={"text": text, "match": match})
    assert r.status_code < 300, r.text


def chat(http: httpx.Client, node: NodeProc, model: str, r: str, text: str = "Hello", **kw: Any) -> Any:
    body = {"model": model, "messages": [{"role": "user", "content": text}], **kw}
    return http.post(f"{node.url}/v1/chat/completions", json=body, headers={"x-request-id": r})


def close(a: float, b: float) -> bool:
    return abs(a - b) < 1e-5  # (SGLang's and vLLM's sampling floats are float32)


# ---- 1: the model's sampling defaults ----------------------------------------------------------------------


@pytest.mark.parametrize("model", [SG, VL])
def test_unset_sampling_fields_get_the_model_defaults(
    http: httpx.Client, node: NodeProc, engines: tuple[MockEngineProc, MockEngineProc], model: str
) -> None:
    e = engines[0]
    r = rid()
    assert chat(http, node, model, r, max_tokens=2).status_code == 200
    sp = one(http, e, r)["sampling_params"]
    for k, v in DEFAULTS.items():
        assert close(sp[k], v), (k, sp)
    r = rid()  # what the client sets is its own, 0 included
    assert (
        chat(http, node, model, r, max_tokens=2, temperature=0, top_k=5, repetition_penalty=1.0).status_code
        == 200
    )
    sp = one(http, e, r)["sampling_params"]
    assert (sp["temperature"], sp["top_k"], sp["repetition_penalty"]) == (0, 5, 1.0)
    assert close(sp["top_p"], 0.95) and close(sp["min_p"], 0.05)
    listed = http.get(f"{node.url}/workers").json()["workers"]
    assert [w["sampling_defaults"] for w in listed if w["model"] == model] == [DEFAULTS]  # (shown too)
    r = rid()  # completions
    body = {"model": model, "prompt": "Hi", "max_tokens": 2, "top_p": 0.5}
    assert http.post(f"{node.url}/v1/completions", json=body, headers={"x-request-id": r}).status_code == 200
    sp = one(http, e, r)["sampling_params"]
    assert close(sp["top_p"], 0.5) and close(sp["temperature"], 0.6) and sp["top_k"] == 20


def test_generate_and_messages_get_the_model_defaults(
    http: httpx.Client, node: NodeProc, engines: tuple[MockEngineProc, MockEngineProc]
) -> None:
    e = engines[0]
    r = rid()
    body = {"model": SG, "text": "Hi", "rid": r, "sampling_params": {"max_new_tokens": 2, "temperature": 0.2}}
    assert http.post(f"{node.url}/generate", json=body).status_code == 200
    sp = one(http, e, r)["sampling_params"]
    assert close(sp["temperature"], 0.2) and sp["top_k"] == 20 and close(sp["min_p"], 0.05)
    # Messages: no min_p / repetition_penalty fields: the model's, always (as SMG)
    msg = {"model": SG, "max_tokens": 2, "temperature": 0.3, "messages": [{"role": "user", "content": "Hi"}]}
    m = http.post(f"{node.url}/v1/messages", json=msg)
    assert m.status_code == 200, m.text
    sp = one(http, e, m.json()["id"])["sampling_params"]
    assert close(sp["temperature"], 0.3) and close(sp["min_p"], 0.05) and close(sp["repetition_penalty"], 1.1)


# ---- 2: prefix-free engine ids (SGLang aborts by prefix) ---------------------------------------------------


def test_a_stop_string_in_one_prompt_does_not_abort_the_others(
    http: httpx.Client, node: NodeProc, engines: tuple[MockEngineProc, MockEngineProc]
) -> None:
    e = engines[0]
    marker = uuid.uuid4().hex[:8]
    script(http, e, "ab STOP " + "y" * 40, marker)
    r = rid()
    body = {"model": SG, "prompt": [f"first {marker}", "second", "third"], "stop": ["STOP"], "max_tokens": 30}
    resp = http.post(f"{node.url}/v1/completions", json=body, headers={"x-request-id": r})
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert [c["finish_reason"] for c in choices] == ["stop", "stop", "stop"]
    assert choices[0]["text"] == "ab " and choices[0]["matched_stop"] == "STOP"
    ids = [x["request_id"] for x in got(http, e, r)]
    stats = http.get(f"{e.http_url}/mock/stats").json()
    aborted = [a for a in stats["aborted_by_rpc"] if a in ids]
    assert len(ids) == 3 and len(aborted) <= 1  # only the first prompt's call, if it was still running


# ---- 3, 4, 5: require_reasoning, max_new_tokens, stop strings, seed ----------------------------------------


def test_require_reasoning_when_the_request_thinks(
    http: httpx.Client, node: NodeProc, engines: tuple[MockEngineProc, MockEngineProc]
) -> None:
    e = engines[0]
    r1, r2, r3 = rid(), rid(), rid()
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert chat(http, node, SG, r1, max_tokens=2, response_format=fmt).status_code == 200
    off = {"enable_thinking": False}
    assert chat(http, node, SG, r2, max_tokens=2, chat_template_kwargs=off).status_code == 200
    assert chat(http, node, VL, r3, max_tokens=2).status_code == 200
    assert one(http, e, r1)["require_reasoning"] is True
    assert one(http, e, r2)["require_reasoning"] is False
    assert one(http, e, r3)["require_reasoning"] is None  # (vLLM's request has no such field)


@pytest.mark.parametrize(("model", "field"), [(SG, "max_new_tokens"), (VL, "max_tokens")])
def test_no_max_tokens_leaves_the_engine_its_own_bound(
    http: httpx.Client, node: NodeProc, engines: tuple[MockEngineProc, MockEngineProc], model: str, field: str
) -> None:
    e = engines[0]
    r1, r2 = rid(), rid()
    assert chat(http, node, model, r1).status_code == 200
    assert chat(http, node, model, r2, max_tokens=3).status_code == 200
    assert field not in one(http, e, r1)["sampling_params"]
    assert one(http, e, r2)["sampling_params"][field] == 3


def bang_id(scratch: Path) -> int:
    from tokenizers import Tokenizer

    i = Tokenizer.from_file(str(scratch / "bytes" / "tokenizer.json")).token_to_id("!")
    assert i is not None
    return int(i)


def test_stop_strings_reach_the_engines_and_the_answer_is_unchanged(
    http: httpx.Client, node: NodeProc, engines: tuple[MockEngineProc, MockEngineProc], scratch: Path
) -> None:
    e = engines[0]
    r = rid()
    assert chat(http, node, VL, r, max_tokens=2, stop=["\n\n", "END"], seed=2**40 + 5).status_code == 200
    sp = one(http, e, r)["sampling_params"]
    assert sp["stop"] == ["\n\n", "END"] and sp["include_stop_str_in_output"] is True
    assert sp["seed"] == fold_seed(2**40 + 5) not in (5, 2**31 - 1)  # mixed in (SMG saturates, MLX truncated)
    # SGLang: the single-token stop ("!" is one byte: one token here) as a stop id; the answer as before
    marker = uuid.uuid4().hex[:8]
    script(http, e, "Hi there! more END text", marker)
    r = rid()
    resp = chat(
        http,
        node,
        SG,
        r,
        text=f"say {marker}",
        stop=["!", "END"],
        chat_template_kwargs={"enable_thinking": False},
    )
    assert resp.status_code == 200, resp.text
    c = resp.json()["choices"][0]
    assert (c["message"]["content"], c["finish_reason"], c["matched_stop"]) == ("Hi there", "stop", "!")
    sp = one(http, e, r)["sampling_params"]
    assert sp["stop_token_ids"] == [bang_id(scratch)] and sp.get("stop", []) == []


@pytest.mark.parametrize("model", [SG, VL])
def test_a_stop_string_before_min_tokens_does_not_end_the_answer(
    http: httpx.Client, node: NodeProc, engines: tuple[MockEngineProc, MockEngineProc], model: str
) -> None:
    e = engines[0]
    marker = uuid.uuid4().hex[:8]
    script(http, e, "a\nbcdefghij", marker)
    kw = {"chat_template_kwargs": {"enable_thinking": False}, "stop": ["\n"], "min_tokens": 5}
    resp = chat(http, node, model, rid(), text=f"say {marker}", **kw)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == "a\nbcdefghij"


# ---- 6: /generate's no_stop_trim ---------------------------------------------------------------------------


def test_generate_no_stop_trim_keeps_the_stop_string(
    http: httpx.Client, node: NodeProc, engines: tuple[MockEngineProc, MockEngineProc]
) -> None:
    e = engines[0]
    for trim, want in ((True, "hello STOP"), (False, "hello ")):
        marker = uuid.uuid4().hex[:8]
        script(http, e, "hello STOP world", marker)
        sp = {"max_new_tokens": 20, "stop": ["STOP"], "no_stop_trim": trim}
        resp = http.post(
            f"{node.url}/generate", json={"model": SG, "text": f"x {marker}", "sampling_params": sp}
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["text"] == want


# ---- 9: --skip-tokenizer-init ------------------------------------------------------------------------------


def test_min_tokens_on_a_skip_tokenizer_init_worker_is_a_400_naming_it(
    http: httpx.Client, node: NodeProc
) -> None:
    resp = chat(http, node, SKIP, rid(), max_tokens=4, min_tokens=2)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "min_tokens" and "skip-tokenizer-init" in err["message"]
    body = {"model": SKIP, "text": "hi", "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 2}}
    resp = http.post(f"{node.url}/generate", json=body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "sampling_params.min_new_tokens"
    assert chat(http, node, SKIP, rid(), max_tokens=4).status_code == 200  # without it: served
