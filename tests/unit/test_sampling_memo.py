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
