from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.node.config import ConfigError, build_config, check_worker_url
from shepherd.node.openai.sse import ChatChunks, CompletionChunks, usage
from shepherd.policies.base import RouteRequest, WorkerView
from shepherd.policies.simple import RoundRobin


def _event(b: bytes) -> dict[str, object]:
    assert b.startswith(b"data: ") and b.endswith(b"\n\n")
    out: dict[str, object] = orjson.loads(b[6:-2])
    return out


def test_chat_chunks_are_valid_json() -> None:
    c = ChatChunks("id1", 5, "qwen3")
    e = _event(c.content(2, 'he said "hi"\n\u00e9'))
    assert e["object"] == "chat.completion.chunk" and e["model"] == "qwen3"
    assert e["choices"] == [
        {"index": 2, "delta": {"content": 'he said "hi"\n\u00e9'}, "logprobs": None, "finish_reason": None}
    ]
    assert _event(c.role(0))["choices"][0]["delta"]["role"] == "assistant"  # type: ignore[index]
    assert _event(c.finish(0, "length"))["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    u = _event(c.usage(usage(3, 4, 1)))
    assert u["choices"] == [] and u["usage"]["total_tokens"] == 7  # type: ignore[index]
    t = CompletionChunks("id2", 5, "m")
    assert _event(t.content(0, "x"))["choices"][0]["text"] == "x"  # type: ignore[index]


def test_worker_url_schemes() -> None:
    assert check_worker_url("grpc://127.0.0.1:1")
    # (0.0.0.0 and :: are a listener's "any": no engine is dialed there)
    for bad in ("ftp://x:1", "127.0.0.1:5", "grpc://", "grpc://0.0.0.0:50051", "http://[::]:8000"):
        with pytest.raises(ConfigError):
            check_worker_url(bad)


def test_config_precedence_and_errors() -> None:
    cfg = build_config({"port": 1234, "policy": "random"}, {"port": 999, "policy": None})
    assert cfg.port == 999 and cfg.policy == "random"
    (m,) = cfg.model_configs()
    assert m.name == "qwen3"
    with pytest.raises(ConfigError):
        build_config({"bogus": 1}, {})
    with pytest.raises(ConfigError):
        build_config({}, {"worker_urls": ["tcp://x:1"]})


def test_round_robin_cycles_per_model() -> None:
    rr = RoundRobin()
    ws = [WorkerView("b", "u2"), WorkerView("a", "u1")]
    picks = [rr.pick(ws, RouteRequest("m")) for _ in range(4)]
    assert [p.id for p in picks if p] == ["a", "b", "a", "b"]


def _reference(kind: str, rid: str, created: int, model: str) -> bytes:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    head = orjson.dumps({"id": rid, "object": obj, "created": created, "model": model})
    return b"data: " + head[:-1] + b',"choices":[{"index":'


_texts = st.text(max_size=12)


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(["chat", "completion"]),
    rid=_texts,
    created=st.integers(0, 2**40),
    model=_texts,
    index=st.integers(0, 3),
    text=_texts,
    logprobs=st.none() | st.just({"content": [{"token": "a", "logprob": -0.5}]}),
    reason=st.sampled_from(["stop", "length", "abort", "tool_calls"]) | _texts,
    matched=st.none() | st.integers(0, 10**6) | _texts,
    counts=st.tuples(st.integers(0, 10**7), st.integers(0, 10**7), st.integers(0, 10**7)),
)
def test_event_bytes_equal_the_formatted_reference(
    kind: str,
    rid: str,
    created: int,
    model: str,
    index: int,
    text: str,
    logprobs: dict[str, object] | None,
    reason: str,
    matched: str | int | None,
    counts: tuple[int, int, int],
) -> None:
    """The fast paths (prefixes built with the head, cached finish tails, usage without dicts) write the
    bytes of the general formatting."""
    enc = ChatChunks(rid, created, model) if kind == "chat" else CompletionChunks(rid, created, model)
    head = _reference(kind, rid, created, model)
    content, content_end, empty = (
        (b'"delta":{"content":', b"}", b'"delta":{}') if kind == "chat" else (b'"text":', b"", b'"text":""')
    )
    lp = b"null" if logprobs is None else orjson.dumps(logprobs)
    assert enc.content(index, text, logprobs) == b'%s%d,%s%s%s,"logprobs":%s,"finish_reason":null}]}\n\n' % (
        head, index, content, orjson.dumps(text), content_end, lp
    )  # fmt: skip
    enc.stop_ids = (7,)  # the request's stop token ids: vLLM's stop_reason names only those (and strings)
    vllm = matched if isinstance(matched, str) or matched == 7 else None
    for _ in range(2):  # the second time from the cache
        assert enc.finish(index, reason, matched) == (
            b'%s%d,%s,"logprobs":null,"finish_reason":%s,"matched_stop":%s,"stop_reason":%s}]}\n\n'
            % (head, index, empty, orjson.dumps(reason), orjson.dumps(matched), orjson.dumps(vllm))
        )
    assert enc.usage_of(*counts) == enc.usage(usage(*counts))
    assert (
        enc.usage(usage(*counts))
        == head[: -len(b'[{"index":')] + b'[],"usage":' + orjson.dumps(usage(*counts)) + b"}\n\n"
    )
