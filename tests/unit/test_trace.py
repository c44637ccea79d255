"""The multi-turn chat trace: deterministic under a seed, and the shape the routing benchmark needs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shepherd.loadgen.trace import TraceConfig, approx_tokens, generate_trace

SMALL = TraceConfig(users=40, seed=3)


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    a, b = generate_trace(SMALL), generate_trace(SMALL)
    assert a == b
    assert generate_trace(TraceConfig(users=40, seed=4)) != a


def test_same_trace_in_another_process() -> None:
    code = (
        "import json; from shepherd.loadgen.trace import TraceConfig, generate_trace; "
        "print(json.dumps(generate_trace(TraceConfig(users=40, seed=3)).to_json()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == json.loads(json.dumps(generate_trace(SMALL).to_json()))


def test_shape() -> None:
    cfg = SMALL
    t = generate_trace(cfg)
    assert len(t.conversations) == cfg.users and len(t.system_prompts) == cfg.system_prompts
    starts = [c.start_s for c in t.conversations]
    assert starts == sorted(starts) and starts[0] == 0.0 and starts[-1] <= cfg.arrival_s
    for s in t.system_prompts:  # long shared prefixes of the configured size (the head may add a little)
        assert cfg.system_tokens_min * 0.9 <= approx_tokens(s) <= cfg.system_tokens_max * 1.1
    texts = set()
    for c in t.conversations:
        assert cfg.turns_min <= len(c.turns) <= cfg.turns_max
        assert 0 <= c.system < cfg.system_prompts
        assert c.turns[0].think_s == 0.0
        assert all(0.0 <= x.think_s <= cfg.think_max_s for x in c.turns)
        for turn in c.turns:
            assert cfg.answer_tokens_min <= turn.max_tokens <= cfg.answer_tokens_max
            assert cfg.user_tokens_min * 0.5 <= approx_tokens(turn.user_text) <= cfg.user_tokens_max * 1.3
            texts.add(turn.user_text)
    assert len(texts) == t.requests  # every user turn is new: prefixes diverge after the history
    # a popular system prompt and rarer ones (Zipf-like), every one used by someone at this size
    users_of = [sum(1 for c in t.conversations if c.system == k) for k in range(cfg.system_prompts)]
    assert users_of[0] == max(users_of)


def test_default_size_and_scaling() -> None:
    t = generate_trace(TraceConfig())
    assert 1000 <= t.requests <= 1400  # about 1,200 requests, as docs/DESIGN.md §5's trace
    half = TraceConfig().scaled(600)
    assert half.users == 75 and half.arrival_s == pytest.approx(5.0)
    assert "requests from 150 users" in t.summary()


def test_bad_config() -> None:
    with pytest.raises(ValueError):
        TraceConfig(turns_min=5, turns_max=2)
    with pytest.raises(ValueError):
        TraceConfig(users=0)
