"""The node over SMG's vLLM servicer, replayed (tests/contract/replay.py, dialect ``vllm-smg``).

Read from lightseekorg/smg grpc_servicer/smg_grpc_servicer/vllm/servicer.py (Generate: with streaming,
DELTA outputs, a chunk per choice and step carrying its ``index``, a finished choice's Complete
repeating its last delta; without, FINAL_ONLY Completes with every id; ``finish_reason`` is vLLM's,
"error" included) and grpc_servicer/smg_grpc_servicer/vllm/kv_transfer.py (``params_to_response_fields``:
the connector's parameters as ``kv_transfer_params_json`` and, for a host and port, the typed
``kv_transfer_params``; releases before the JSON field sent the typed one alone). Through a real node.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.contract.nodes import (
    MODEL,
    complete,
    ids,
    node_over,
    replay,
    sse_events,
    streamed_text,
    text_and_tokens,
)
from tests.contract.replay import Choice, Plan, ReplayServer
from tests.e2e.node_procs import NodeProc, start_node

DIALECT = "vllm-smg"


@pytest.mark.parametrize("stream", [False, True])
def test_final_delta_repeated_in_the_complete_is_shown_once(
    engine: ReplayServer, node: NodeProc, http: httpx.Client, tok: Path, stream: bool
) -> None:
    engine.plan = Plan([Choice([ids(tok, "ab"), ids(tok, "cd"), ids(tok, "ef")])])
    r = complete(http, node, prompt="hi", stream=stream, logprobs=1)
    assert r.status_code == 200, r.text
    assert text_and_tokens(r, stream) == ("abcdef", "abcdef")


@pytest.mark.parametrize("stream", [False, True])
def test_n2_by_index(
    engine: ReplayServer, node: NodeProc, http: httpx.Client, tok: Path, stream: bool
) -> None:
    engine.plan = Plan([Choice([ids(tok, "x1"), ids(tok, "x2")]), Choice([ids(tok, "y1")])])
    r = complete(http, node, prompt="hi", n=2, stream=stream)
    assert r.status_code == 200, r.text
    if stream:
        ev = sse_events(r.text)
        assert (streamed_text(ev, 0), streamed_text(ev, 1)) == ("x1x2", "y1")
    else:
        assert [c["text"] for c in r.json()["choices"]] == ["x1x2", "y1"]


@pytest.mark.parametrize("reason", ["error", "abort"])
def test_error_and_abort_finishes_are_errors(
    engine: ReplayServer, node: NodeProc, http: httpx.Client, tok: Path, reason: str
) -> None:
    engine.plan = Plan([Choice([ids(tok, "so"), ids(tok, "me")], finish=reason)])
    r = complete(http, node, prompt="hi")
    assert r.status_code == 502, r.text
    r = complete(http, node, prompt="hi", stream=True)
    ev = sse_events(r.text)
    assert any("error" in e for e in ev), r.text
    assert not any(c.get("finish_reason") for e in ev for c in e.get("choices", []))


def test_cached_tokens(engine: ReplayServer, node: NodeProc, http: httpx.Client, tok: Path) -> None:
    engine.plan = Plan([Choice([ids(tok, "ok")])], cached=2)
    r = complete(http, node, prompt="hello")
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 2


@pytest.mark.parametrize("typed_only", [False, True])
def test_pd_kv_transfer_params_typed_or_json(http: httpx.Client, tok: Path, typed_only: bool) -> None:
    params = {"remote_host": "10.0.0.7", "remote_port": 14579}
    with replay("vllm-smg") as prefill, replay("vllm-smg") as decode:
        prefill.plan = Plan([Choice([ids(tok, "p")])], kv_params=params, typed_kv_only=typed_only)
        decode.plan = Plan([Choice([ids(tok, "deco"), ids(tok, "ded")])])
        args = ["--pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url]
        node = start_node(*args, "--model-id", MODEL, "--model-path", str(tok), "--tokenizer-workers", "0")
        try:
            r = complete(http, node, prompt="hi")
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == "decoded"
        finally:
            node.stop()
        sent: Any = decode.generates()[-1]
        got = json.loads(sent.kv_transfer_params_json)
        assert (got["remote_host"], got["remote_port"]) == ("10.0.0.7", 14579)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_stop_id_and_length(
    engine: ReplayServer, node: NodeProc, http: httpx.Client, tok: Path, stream: bool
) -> None:
    def answer(**body: Any) -> tuple[str, str | None]:
        r = complete(http, node, prompt="hi", stream=stream, **body)
        assert r.status_code == 200, r.text
        if stream:
            ev = sse_events(r.text)
            reasons = [c["finish_reason"] for e in ev for c in e["choices"] if c.get("finish_reason")]
            return streamed_text(ev), (reasons[-1] if reasons else None)
        c = r.json()["choices"][0]
        return c["text"], c["finish_reason"]

    # the engine gets the stop ids only; a stop string is cut by the node (include_stop_str_in_output)
    engine.plan = Plan([Choice([ids(tok, "one. "), ids(tok, "two")], finish="length")])
    assert answer(stop=["."]) == ("one", "stop")
    (bang,) = ids(tok, "!")
    engine.plan = Plan([Choice([ids(tok, "fi"), ids(tok, "n!")], matched=bang)])
    assert answer(stop_token_ids=[bang]) == ("fin", "stop")  # the matched stop id is not shown
    engine.plan = Plan([Choice([ids(tok, "ab"), ids(tok, "cd")], finish="length")])
    assert answer(max_tokens=4) == ("abcd", "length")


def test_error_before_the_answer_is_retried_on_another_worker(http: httpx.Client, tok: Path) -> None:
    """vLLM's ``error`` finish of one choice of n = 2 (not streamed: FINAL_ONLY, a Complete per choice by
    its index), on whichever worker is asked first: nothing was answered, so another worker serves it."""
    lock = threading.Lock()
    seen: list[str] = []

    def plan(s: ReplayServer, req: Any) -> Plan:
        with lock:
            seen.append(s.url)
            if len(seen) == 1:
                return Plan([Choice([ids(tok, "fine")]), Choice([ids(tok, "bad")], finish="error")])
        return Plan([Choice([ids(tok, "two")]), Choice([ids(tok, "two")])])

    with replay("vllm-smg") as a, replay("vllm-smg") as b:
        a.plan = b.plan = plan
        with node_over([a, b], tok) as n:
            r = complete(http, n, prompt="hi", n=2)
            assert r.status_code == 200, r.text
            assert [c["text"] for c in r.json()["choices"]] == ["two", "two"]
            assert len(set(seen)) == 2
