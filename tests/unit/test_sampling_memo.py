"""parse_sampling's memo answers exactly what a fresh parse answers, for any request (values of any JSON
type, in any order, valid or not), and engine_sampling's memo exactly what a fresh mapping does."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.node.api.generation import _engine_sampling, engine_sampling
from shepherd.node.openai import requests as proto
from shepherd.node.openai.requests import parse_sampling
from shepherd.proto.openai_errors import ApiError

KEYS = sorted(proto._SAMPLING_KEYS)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 40),
    st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.5, -1.0, 1e300]),
    st.text(max_size=3),
)
values = st.one_of(
    scalars,
    st.lists(scalars, max_size=3),
    st.dictionaries(st.sampled_from(["include_usage", "5", "x"]), scalars, max_size=2),
    st.lists(st.lists(st.integers(0, 3), max_size=2), max_size=2),  # too deep for the memo key
)
requests = st.dictionaries(st.sampled_from([*KEYS, "model", "messages"]), values, max_size=6)


def _outcome(d: dict[str, Any], keys: tuple[str, ...]) -> Any:
    try:
        return proto._parse_sampling(d, keys)
    except ApiError as e:
        return ("error", e.status, e.message, e.param, e.code)


def _memo_outcome(d: dict[str, Any], keys: tuple[str, ...]) -> Any:
    try:
        return parse_sampling(d, max_tokens_keys=keys)
    except ApiError as e:
        return ("error", e.status, e.message, e.param, e.code)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(requests, min_size=1, max_size=8),
    st.sampled_from([("max_tokens",), ("max_tokens", "max_completion_tokens")]),
)
def test_memo_equals_fresh_parse(ds: list[dict[str, Any]], keys: tuple[str, ...]) -> None:
    for d in ds + ds:  # the second pass answers from the memo
        got = _memo_outcome(d, keys)
        want = _outcome(d, keys)
        assert got == want
        if not isinstance(want, tuple):  # equal fields, and equal types (1 vs 1.0 vs True)
            for f in proto.Sampling.__slots__:
                assert type(getattr(got, f)) is type(getattr(want, f)), f


def test_types_are_told_apart() -> None:
    assert parse_sampling({"ignore_eos": True}, max_tokens_keys=("max_tokens",)).ignore_eos is True
    for bad_value in (1, 1.0, "true"):
        try:
            parse_sampling({"ignore_eos": bad_value}, max_tokens_keys=("max_tokens",))
        except ApiError as e:
            assert e.param == "ignore_eos"
        else:
            raise AssertionError(f"ignore_eos={bad_value!r} accepted")


def test_memo_is_bounded() -> None:
    for i in range(proto.SAMPLING_MEMO_MAX + 10):
        parse_sampling({"seed": i}, max_tokens_keys=("max_tokens",))
    assert len(proto._SAMPLING_MEMO) <= proto.SAMPLING_MEMO_MAX


@settings(max_examples=100, deadline=None)
@given(requests, st.integers(1, 64), st.sampled_from([None, 1, 4]))
def test_engine_sampling_memo(d: dict[str, Any], max_new: int, interval: int | None) -> None:
    try:
        s = parse_sampling(d, max_tokens_keys=("max_tokens",))
    except ApiError:
        return
    first = engine_sampling(s, max_new, interval)
    assert first == _engine_sampling(s, max_new, interval, None)
    again = engine_sampling(s, max_new, interval)
    if s.stop or s.logit_bias or s.stop_token_ids:  # not memoized: an entry would pin its request bytes
        assert again == first
    else:
        assert again is first


def test_large_constraints_are_not_kept_by_the_engine_parameter_caches() -> None:
    """A client varying only its seed with a large schema (or regex, choices, logit_bias) would pin each
    request's payload in the 4,096-entry caches: parameters past CACHED_PAYLOAD_MAX are built each time
    (the same bytes), small ones cached as before."""
    import dataclasses

    from shepherd.proto import engine_requests as er
    from shepherd.proto.engine_types import SamplingParams

    big = SamplingParams(json_schema='{"type":"object","description":"' + "x" * 50_000 + '"}')
    caches = (
        er._sglang_sampling_cached,
        er._vllm_sampling_cached,
        er._sglang_field_cached,
        er._vllm_field_cached,
    )
    before = [c.cache_info().currsize for c in caches]
    for seed in range(50):
        p = dataclasses.replace(big, seed=seed)
        assert er._sglang_sampling_field(p) == er._sglang_field(p)
        assert er._vllm_sampling_field(p, False, 0) == er._vllm_field(p, False, 0)
        assert er.sglang_sampling(p) == er._sglang_sampling(p)
        assert er.vllm_sampling(p, False, 0) == er._vllm_sampling(p, False, 0)
    for p in (
        dataclasses.replace(big, json_schema=None, regex="a" * 50_000),
        dataclasses.replace(big, json_schema=None, choice=("c" * 5_000,)),
        dataclasses.replace(big, json_schema=None, logit_bias=tuple((i, 1.0) for i in range(1_000))),
    ):
        er._sglang_sampling_field(p)
        er._vllm_sampling_field(p, True, 2)
    assert [c.cache_info().currsize for c in caches] == before
    small = SamplingParams(json_schema='{"type":"object"}', seed=12345)
    er._sglang_sampling_field(small)
    assert er._sglang_field_cached.cache_info().currsize == before[2] + 1 or before[2] == 4096
