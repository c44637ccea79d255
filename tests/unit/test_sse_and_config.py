from __future__ import annotations

import orjson
import pytest

from shepherd.node.config import ConfigError, build_config, check_worker_url
from shepherd.node.sse import ChatChunks, CompletionChunks, usage
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
    for bad in ("ftp://x:1", "127.0.0.1:5", "grpc://"):
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
