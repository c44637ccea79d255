"""Prompt generation and request bodies for the benchmarks."""

from __future__ import annotations

import math

import orjson
import pytest

from shepherd.loadgen.client import LoadResult, LoadSpec
from shepherd.loadgen.http1 import RequestTemplate
from shepherd.loadgen.prompts import (
    ChatRequestSource,
    ChatShape,
    ConversationSource,
    PromptConfig,
    PromptFactory,
    approx_tokens,
    load_qwen3_tokenizer,
)
from shepherd.loadgen.report import format_table, row_from_result
from shepherd.loadgen.stats import Distribution

TEMPLATE = RequestTemplate("127.0.0.1", 1234, "/v1/chat/completions")


def body_of(request: bytes) -> dict[str, object]:
    doc: dict[str, object] = orjson.loads(request.partition(b"\r\n\r\n")[2])
    return doc


def user_text(request: bytes) -> str:
    messages = body_of(request)["messages"]
    assert isinstance(messages, list)
    text: str = messages[-1]["content"]
    return text


def test_bodies_are_valid_chat_requests() -> None:
    factory = PromptFactory(PromptConfig(prompt_tokens=200))
    source = ChatRequestSource(factory, TEMPLATE, ChatShape(model="m", max_tokens=7, stream=True))
    doc = body_of(source.next_request())
    assert doc["model"] == "m"
    assert doc["max_tokens"] == 7
    assert doc["stream"] is True
    assert doc["ignore_eos"] is True
    assert doc["stream_options"] == {"include_usage": True}
    messages = doc["messages"]
    assert isinstance(messages, list)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"] == factory.system_prompt


def test_default_every_user_message_is_distinct_and_system_shared() -> None:
    factory = PromptFactory(PromptConfig())
    source = ChatRequestSource(factory, TEMPLATE, ChatShape())
    texts = [user_text(source.next_request()) for _ in range(500)]
    assert len(set(texts)) == 500
    assert source.repeats == 0


def test_repeat_ratio_one_cycles_the_pool() -> None:
    factory = PromptFactory(PromptConfig(repeat_ratio=1.0, pool_size=5))
    source = ChatRequestSource(factory, TEMPLATE, ChatShape())
    texts = [user_text(source.next_request()) for _ in range(20)]
    assert len(set(texts)) == 5
    assert texts[:5] == texts[5:10]


def test_partial_repeat_ratio_mixes() -> None:
    factory = PromptFactory(PromptConfig(repeat_ratio=0.5, pool_size=8, seed=3))
    source = ChatRequestSource(factory, TEMPLATE, ChatShape())
    texts = [user_text(source.next_request()) for _ in range(400)]
    assert 0 < source.repeats < 400
    assert len(set(texts)) == 400 - source.repeats + min(8, source.repeats)


def test_sources_continue_the_sequence() -> None:
    factory = PromptFactory(PromptConfig())
    first = ChatRequestSource(factory, TEMPLATE, ChatShape())
    seen = {user_text(first.next_request()) for _ in range(50)}
    second = ChatRequestSource(factory, TEMPLATE, ChatShape(), start_index=first.next_index)
    assert not seen & {user_text(second.next_request()) for _ in range(50)}


def test_prompt_size_tracks_the_target_with_the_estimator() -> None:
    for target in (100, 250, 1000):
        factory = PromptFactory(PromptConfig(prompt_tokens=target), approx_tokens)
        sizes = [factory.rendered_prompt_tokens(i) for i in range(64, 114)]
        mean = sum(sizes) / len(sizes)
        assert abs(mean - target) < 0.15 * target


def test_prompt_size_with_the_real_tokenizer() -> None:
    count = load_qwen3_tokenizer()
    # the tokenizer is embedded in the package and `tokenizers` is a dependency: it must load (no skip)
    assert count is not None, "the embedded qwen3 tokenizer did not load (shepherd/loadgen/prompts.py)"
    factory = PromptFactory(PromptConfig(prompt_tokens=250), count)
    sizes = [factory.rendered_prompt_tokens(i) for i in range(64, 94)]
    assert abs(sum(sizes) / len(sizes) - 250) < 25


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        PromptFactory(PromptConfig(repeat_ratio=1.5))
    with pytest.raises(ValueError):
        PromptFactory(PromptConfig(pool_size=0))


def test_report_row_and_table() -> None:
    result = LoadResult(
        spec=LoadSpec("127.0.0.1", 1, concurrency=8, stream=True),
        ok=100,
        errors={"http_503": 2},
        errors_outside_window={},
        window_s=2.0,
        latency=Distribution.of([0.010, 0.020]),
        ttft=Distribution.of([0.001]),
        itl=Distribution.of([0.0001]),
        content_events=3200,
        completion_tokens=3200,
        loadgen_cpu_s=0.01,
    )
    row = row_from_result(
        "stream",
        "node",
        result,
        gateway_cpu_s=0.2,
        gateway_rss_kb=2048,
        gateway_processes=3,
        engine_cpu_s=None,
        gateway_pss_kb=1024,
    )
    assert row.rps == pytest.approx(50.0)
    assert row.gateway_cpu_ms == pytest.approx(2.0)
    assert row.gateway_rss_mb == pytest.approx(2.0)
    assert row.gateway_pss_mb == pytest.approx(1.0)
    assert math.isnan(row.engine_cpu_ms)
    assert row.chunks_per_request == pytest.approx(32.0)
    assert row.to_json()["engine_cpu_ms"] is None
    table = format_table([row])
    assert "node (3 procs)" in table
    assert "http_503:2" in table
    assert "req/s" in table.splitlines()[0]
    # per output token: the answers' usage (3200 tokens over 100 requests)
    assert row.output_tokens == pytest.approx(32.0)
    assert row.gateway_cpu_us_per_token == pytest.approx(2000.0 / 32.0)
    assert row.to_json()["gateway_cpu_us_per_token"] == pytest.approx(62.5)
    assert "us/tok" in table.splitlines()[0]


def conversation(turns: int = 4, window: int = 3, prompt_tokens: int = 2000) -> ConversationSource:
    factory = PromptFactory(PromptConfig(prompt_tokens=prompt_tokens))
    shape = ChatShape(model="m", max_tokens=64, stream=True)
    return ConversationSource(factory, TEMPLATE, shape, turns=turns, window=window, start_index=10)


def test_conversation_turns_resend_the_history() -> None:
    source = conversation()
    requests = [body_of(source.next_request()) for _ in range(12)]
    # a window of 3 conversations, turn by turn
    assert [source.position(i) for i in range(7)] == [
        (10, 0), (11, 0), (12, 0), (10, 1), (11, 1), (12, 1), (10, 2)
    ]  # fmt: skip
    first, second, third = requests[0], requests[3], requests[6]
    for doc in (first, second, third):
        assert doc["model"] == "m" and doc["stream"] is True and doc["max_tokens"] == 64
    roles = [[m["role"] for m in d["messages"]] for d in (first, second, third)]  # type: ignore[attr-defined]
    assert roles[0] == ["system", "user"]
    assert roles[1] == ["system", "user", "assistant", "user"]
    assert roles[2] == ["system", "user", "assistant", "user", "assistant", "user"]
    # each turn starts with the one before it (the caches' and prefix routing's case)
    assert second["messages"][:2] == first["messages"]  # type: ignore[index]
    assert third["messages"][:4] == second["messages"]  # type: ignore[index]
    # conversations differ from each other
    assert requests[1]["messages"][1] != first["messages"][1]  # type: ignore[index]
    # the next window starts after this one's conversations
    assert source.next_index == 13


def test_conversation_mean_prompt_tracks_the_target() -> None:
    source = conversation(turns=4, window=2, prompt_tokens=2000)
    sizes = [source.rendered_prompt_tokens(c, t) for c in range(10, 14) for t in range(4)]
    mean = sum(sizes) / len(sizes)
    assert 1700 <= mean <= 2300, sizes
    assert sizes[3] > sizes[0]  # the history grows turn by turn


def test_conversation_validation() -> None:
    with pytest.raises(ValueError):
        conversation(turns=0)
    with pytest.raises(ValueError):
        conversation(window=0)
