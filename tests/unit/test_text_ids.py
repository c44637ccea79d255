"""text_ids: a relayed request's text as pseudo token ids (cache_aware's key for ``http://`` workers)."""

from __future__ import annotations

from typing import Any

from shepherd.policies.block_names import block_hashes
from shepherd.policies.text_ids import BYTES_PER_ID, MAX_TEXT_BYTES, body_ids, text_ids

SYSTEM = {"role": "system", "content": "You are terse. " * 10}


def chat(*msgs: dict[str, Any]) -> dict[str, Any]:
    return {"model": "m", "messages": [SYSTEM, *msgs]}


def test_the_ids_are_pinned_little_endian_words_below_2_30() -> None:
    """Every node must name a text alike (the mesh matches one node's decisions on another): the ids are
    the bytes as little-endian words, each top byte folded to 6 bits, so every id is a one-digit int."""
    assert text_ids("abcd").tolist() == [0x25636261]  # "d" (0x64) folds to (0x64 ^ 1) & 0x3F = 0x25
    assert text_ids("abcdef") == text_ids("abcd")  # a partial last word is left out
    assert len(text_ids("")) == 0 and len(text_ids("abc")) == 0
    ids = text_ids(bytes(range(256)) * 4)
    assert len(ids) == 256 and max(ids) < 2**30


def test_a_follow_ups_ids_start_with_the_previous_turns() -> None:
    """A follow-up resends the conversation: its ids start with the previous request's, tool calls and
    content parts included, so its blocks match the ones the first turn's worker holds."""
    user = {"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image_url"}]}
    call = {"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"q": "x"}'}}
    first = body_ids(chat(user))
    second = body_ids(
        chat(
            user,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        )
    )
    assert len(second) > len(first) > 0
    assert second[: len(first)] == first
    assert block_hashes(second)[: len(first) // 16] == block_hashes(first)


def test_roles_and_contents_tell_conversations_apart() -> None:
    a = body_ids(chat({"role": "user", "content": "hello there, how are you"}))
    b = body_ids(chat({"role": "assistant", "content": "hello there, how are you"}))
    c = body_ids(chat({"role": "user", "content": "hello there, who are you?"}))
    assert len({tuple(a), tuple(b), tuple(c)}) == 3
    assert body_ids(chat({"role": "user", "content": "hello there, how are you"})) == a  # deterministic


def test_completion_prompts() -> None:
    assert body_ids({"prompt": "Once upon a time"}) == text_ids("Once upon a time")
    assert body_ids({"prompt": [1, 2, 3]}) == [1, 2, 3]  # token ids as they are
    assert body_ids({"prompt": [[7, 8], [9]]}) == [7, 8]  # a batch of them: the first
    joined = body_ids({"prompt": ["Once upon", "a time"]})
    assert joined[: len(text_ids("Once"))] == text_ids("Once")
    assert body_ids({"prompt": [True, 1]}) == [] and body_ids({"input": "x"}) == []


def test_hostile_requests_are_keyed_within_the_bounds() -> None:
    """A huge request keys its first ``MAX_TEXT_BYTES`` only; countless empty pieces stop the key early."""
    cap = MAX_TEXT_BYTES // BYTES_PER_ID
    huge = "x" * (4 * MAX_TEXT_BYTES)
    assert len(body_ids(chat({"role": "user", "content": huge}))) == cap
    assert len(body_ids({"prompt": huge})) == cap
    assert len(body_ids({"prompt": [huge, huge]})) == cap
    assert len(body_ids({"prompt": list(range(4 * cap))})) == cap
    parts = [{"type": "text", "text": ""}] * 1_000_000
    assert len(body_ids(chat({"role": "user", "content": parts}))) < 4096
    calls = [{"function": {"name": "", "arguments": ""}}] * 1_000_000
    assert len(body_ids(chat({"role": "assistant", "tool_calls": calls}))) < 4096
    assert len(body_ids({"messages": [{}] * 1_000_000})) < 4096
