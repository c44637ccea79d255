"""The node over SMG's SGLang servicer, replayed (tests/contract/replay.py, dialect ``sglang-smg``).

Read from lightseekorg/smg grpc_servicer/smg_grpc_servicer/sglang/servicer.py (Generate: a streamed
finish is a chunk and then a Complete with the same last delta; HealthCheck: ``asyncio.sleep(1)``
before it first looks; GetModelInfo: ``max_context_length`` from server.py's model_info, which is
the scheduler's ``max_total_num_tokens``; ``_convert_sampling_params``: no seed field, custom_params
passed through to SGLang's custom logit processors), grpc_servicer/smg_grpc_servicer/sglang/
request_manager.py (n > 1: indexes only when streaming) and grpc_servicer/smg_grpc_servicer/sglang/
server.py. Every test goes through a real node process and checks its HTTP answer.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from tests.contract.nodes import (
    complete,
    ids,
    node_over,
    replay,
    sse_events,
    streamed_text,
    text_and_tokens,
    token_id,
)
from tests.contract.replay import Choice, EngineFacts, Plan, ReplayServer
from tests.e2e.node_procs import NodeProc

DIALECT = "sglang-smg"


def words(tok: Path, *parts: str) -> list[list[int]]:
    return [ids(tok, p) for p in parts]


def test_non_streamed_n2_every_complete_index_0_gives_both_choices_in_order(
    engine: ReplayServer, node: NodeProc, http: httpx.Client, tok: Path
) -> None:
    engine.plan = Plan([Choice(words(tok, "alpha")), Choice(words(tok, "beta"))])
    r = complete(http, node, prompt="hi", n=2)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in choices] == [
        (0, "alpha", "stop"),
        (1, "beta", "stop"),
    ]
    assert r.json()["usage"]["completion_tokens"] == len("alpha") + len("beta")


def test_streamed_n2_choices_by_their_index(
    engine: ReplayServer, node: NodeProc, http: httpx.Client, tok: Path
) -> None:
    engine.plan = Plan([Choice(words(tok, "on", "e")), Choice(words(tok, "tw", "o", "!"))])
    r = complete(http, node, prompt="hi", n=2, stream=True)
    ev = sse_events(r.text)
    assert (streamed_text(ev, 0), streamed_text(ev, 1)) == ("one", "two!")


@pytest.mark.parametrize("stream", [False, True])
def test_final_delta_in_chunk_and_complete_is_shown_once(
    engine: ReplayServer, node: NodeProc, http: httpx.Client, tok: Path, stream: bool
) -> None:
    engine.plan = Plan([Choice(words(tok, "hel", "lo", " wor", "ld"))])
    r = complete(http, node, prompt="hi", stream=stream, logprobs=1)
    assert r.status_code == 200, r.text
    # the repeated delta's logprobs are not counted twice
    assert text_and_tokens(r, stream) == ("hello world", "hello world")


def test_context_window_from_server_args_not_the_kv_pool(
    engine: ReplayServer, node: NodeProc, http: httpx.Client, tok: Path
) -> None:
    # the replayed engine: KV pool 100 tokens (GetModelInfo.max_context_length), context 2048
    engine.plan = Plan([Choice(words(tok, "ok"))])
    r = complete(http, node, prompt="x" * 150, max_tokens=8)
    assert r.status_code == 200, r.text
    r = complete(http, node, prompt="x" * 2100, max_tokens=8)
    assert r.status_code == 400 and "2048" in r.json()["error"]["message"]
    (w,) = http.get(node.url + "/workers").json()["workers"]
    assert (w["max_context_length"], w["kv_capacity_tokens"]) == (2048, 100)  # the pool: shown only


def test_seed_is_not_sent_as_a_custom_logit_processor_param(
    engine: ReplayServer, node: NodeProc, http: httpx.Client, tok: Path
) -> None:
    engine.plan = Plan([Choice(words(tok, "ok"))])
    before = len(engine.generates())
    r = complete(http, node, prompt="hi", seed=7)
    assert r.status_code == 200, r.text
    sent = engine.generates()[before:]
    assert sent and all("seed" not in dict(g.sampling_params.custom_params) for g in sent)


def test_stop_string_stop_id_and_length(
    engine: ReplayServer, node: NodeProc, http: httpx.Client, tok: Path
) -> None:
    engine.plan = Plan([Choice(words(tok, "one. ", "two"), finish="length")])
    r = complete(http, node, prompt="hi", stop=["."])
    assert r.json()["choices"][0]["text"] == "one" and r.json()["choices"][0]["finish_reason"] == "stop"
    eos = token_id(tok, "<|im_end|>")
    engine.plan = Plan([Choice([*words(tok, "fin"), [eos]], matched=eos)])
    for stream in (False, True):
        r = complete(http, node, prompt="hi", stream=stream)
        if stream:
            ev = sse_events(r.text)
            text = streamed_text(ev)
            reason = [c["finish_reason"] for e in ev for c in e["choices"] if c.get("finish_reason")]
        else:
            text = r.json()["choices"][0]["text"]
            reason = [r.json()["choices"][0]["finish_reason"]]
        assert (text, reason) == ("fin", ["stop"])
    engine.plan = Plan([Choice(words(tok, "ab", "cd"), finish="length")])
    r = complete(http, node, prompt="hi", max_tokens=4)
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_cached_tokens_reach_the_usage(
    engine: ReplayServer, node: NodeProc, http: httpx.Client, tok: Path
) -> None:
    engine.plan = Plan([Choice(words(tok, "ok"))], cached=1)
    r = complete(http, node, prompt="hi")
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 1


def test_engine_abort_is_an_error_not_a_200(
    engine: ReplayServer, node: NodeProc, http: httpx.Client, tok: Path
) -> None:
    engine.plan = Plan([Choice(words(tok, "partial"), finish="abort")])
    r = complete(http, node, prompt="hi")
    assert r.status_code == 502, r.text
    # streamed: tokens went out first, then the abort: an SSE error event, no finish_reason "abort"
    engine.plan = Plan([Choice(words(tok, "par", "tial"), finish="abort")])
    r = complete(http, node, prompt="hi", stream=True)
    ev = sse_events(r.text)
    assert any("error" in e for e in ev), r.text
    assert not any(c.get("finish_reason") == "abort" for e in ev for c in e.get("choices", []))


def test_grpc_status_from_the_servicer_is_an_error(
    engine: ReplayServer, node: NodeProc, http: httpx.Client, tok: Path
) -> None:
    # request_manager._handle_abort_req: a scheduler abort becomes context.abort(code, message)
    engine.plan = Plan(
        [Choice(words(tok, "a", "b"), finish=None)], fail=(grpc.StatusCode.INTERNAL, "Abort before prefill")
    )
    r = complete(http, node, prompt="hi", stream=True)
    assert any("error" in e for e in sse_events(r.text)), r.text
    r = complete(http, node, prompt="hi")
    assert r.status_code == 502, r.text


@pytest.mark.parametrize("transport", ["h2", "grpcio"])
def test_abort_before_the_first_token_is_retried_on_another_worker(
    http: httpx.Client, tok: Path, transport: str
) -> None:
    first = threading.Lock()
    seen: list[str] = []

    def plan(s: ReplayServer, req: Any) -> Plan:
        n = max(req.sampling_params.n, 1)
        with first:
            seen.append(s.url)
            if len(seen) == 1:  # whichever worker gets it first gives up
                if n == 1:  # before any token
                    return Plan([Choice([[]], finish="abort")])
                # n > 1 without streaming: the first choice finished, the last one aborted; each is its
                # own Complete (request_manager: one per choice, all index 0), nothing was answered yet
                return Plan([*(Choice(words(tok, "done")) for _ in range(n - 1)), Choice([[]], "abort")])
        return Plan([Choice(words(tok, "second")) for _ in range(n)])

    with replay("sglang-smg") as a, replay("sglang-smg") as b:
        a.plan = b.plan = plan
        with node_over([a, b], tok, "--engine-transport", transport) as n:
            for stream, count in ((False, 1), (True, 1), (False, 2)):
                seen.clear()
                r = complete(http, n, prompt="hi", stream=stream, n=count)
                assert r.status_code == 200, (stream, count, r.text)
                if stream:
                    texts = [streamed_text(sse_events(r.text))]
                else:
                    texts = [c["text"] for c in r.json()["choices"]]
                assert texts == ["second"] * count and len(set(seen)) == 2, (stream, count, seen)


def test_health_check_that_sleeps_one_second_passes_with_a_one_second_timeout(tok: Path) -> None:
    # SMG sleeps 1 s, then reads the scheduler's last answer: a little over a second in all
    # the node is ready once the worker is healthy: start_node raises if it never is
    with (
        replay("sglang-smg", EngineFacts(health_delay_s=1.2)) as s,
        node_over([s], tok, "--health-check-timeout-secs", "1", timeout=30) as n,
    ):
        assert n.proc.poll() is None
