"""The node's per-choice output path: engine chunks (coalesced or not) -> visible text and finish."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from smg_grpc_proto import sglang_scheduler_pb2 as sg

from shepherd.node.openai.requests import parse_chat
from shepherd.node.output.choice import ChoiceState
from shepherd.node.output.stop import StopMatcher, StoppingDecoder
from shepherd.proto.engine_responses import decode_batch, decode_response
from shepherd.proto.engine_types import EngineChunk, EngineComplete, EngineEvent
from shepherd.tokens.detokenizer import IncrementalDetokenizer
from tests.unit.test_tokenizer_shared import qwen3


def sampling(**kw: object) -> object:
    return parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], **kw}).sampling


def run(events: list[EngineEvent], n: int, **kw: object) -> list[tuple[str, str | None]]:
    tok = qwen3()
    s = sampling(**kw)
    states = [ChoiceState(i, tok, s) for i in range(n)]  # type: ignore[arg-type]
    for ev in events:
        stt = states[ev.index]
        if isinstance(ev, EngineChunk):
            stt.feed(ev.token_ids)
        else:
            stt.end(ev.finish_reason)
    return [(x.full_text(), x.finish_reason) for x in states]


def wire(ev: EngineEvent) -> bytes:
    if isinstance(ev, EngineChunk):
        c = sg.GenerateStreamChunk(token_ids=ev.token_ids, index=ev.index, cached_tokens=ev.cached_tokens)
        return bytes(sg.GenerateResponse(chunk=c).SerializeToString())
    done = sg.GenerateComplete(index=ev.index, finish_reason=ev.finish_reason)
    return bytes(sg.GenerateResponse(complete=done).SerializeToString())


def coalesce(events: list[EngineEvent]) -> list[EngineEvent]:
    return decode_batch([wire(e) for e in events], sg.GenerateResponse.FromString)


def test_decode_batch_merges_runs_per_choice_only() -> None:
    evs: list[EngineEvent] = [
        EngineChunk(0, [1]),
        EngineChunk(0, [2], cached_tokens=16),
        EngineChunk(1, [3]),
        EngineChunk(0, [4]),
        EngineComplete(0, "stop"),
        EngineChunk(0, [5]),
    ]
    out = coalesce(evs)
    assert [(type(e).__name__, e.index) for e in out] == [
        ("EngineChunk", 0),
        ("EngineChunk", 1),
        ("EngineChunk", 0),
        ("EngineComplete", 0),
        ("EngineChunk", 0),
    ]
    first = out[0]
    assert isinstance(first, EngineChunk) and list(first.token_ids) == [1, 2] and first.cached_tokens == 16
    single = [decode_response(sg.GenerateResponse.FromString(wire(e))) for e in evs]
    assert [list(e.token_ids) for e in single if isinstance(e, EngineChunk)] == [[1], [2], [3], [4], [5]]


@settings(max_examples=60, deadline=None)
@given(
    st.text(alphabet=st.sampled_from(list("ab cSTOP.é中🙂\n")), min_size=1, max_size=60),
    st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=30),
    st.booleans(),
)
def test_coalesced_and_single_chunks_give_the_same_output(text: str, cuts: list[int], two: bool) -> None:
    ids = qwen3().encode(text, add_special_tokens=False)
    n = 2 if two else 1
    events: list[EngineEvent] = []
    i = 0
    k = 0
    while i < len(ids):
        step = cuts[k % len(cuts)]
        events.extend(EngineChunk(c, ids[i : i + step]) for c in range(n))
        i += step
        k += 1
    events += [EngineComplete(c, "length") for c in range(n)]
    plain = run(events, n, stop=["STOP"])
    assert run(coalesce(events), n, stop=["STOP"]) == plain
    full = qwen3().decode(ids)
    expect = full.split("STOP")[0]
    assert plain[0][0] == expect
    assert plain[0][1] == ("stop" if "STOP" in full else "length")


@settings(max_examples=60, deadline=None)
@given(
    st.text(alphabet=st.sampled_from(list("ab cSTOP.é中🙂\n")), min_size=0, max_size=60),
    st.booleans(),
    st.sampled_from(["stop", "length"]),
)
def test_whole_output_equals_incremental(text: str, include: bool, reason: str) -> None:
    tok = qwen3()
    ids = [*tok.encode(text, add_special_tokens=False), *tok.eos_token_ids]
    s = sampling(stop=["STOP"], include_stop_str_in_output=include)
    a = ChoiceState(0, tok, s)  # type: ignore[arg-type]
    b = ChoiceState(0, tok, s)  # type: ignore[arg-type]
    whole = a.whole(ids, (), reason)
    incremental = b.feed(ids) + b.end(reason)
    assert (whole, a.finish_reason, a.matched) == (incremental, b.finish_reason, b.matched)


_HOSTILE = [*'ab "\\\n\r\t\x00\x01\x1f\x7f\u2028é中🙂🦩', "<|im_end|>", "<think>", "STOP"]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.sampled_from(_HOSTILE), max_size=30),
    st.lists(st.integers(1, 4), min_size=1, max_size=40),
    st.booleans(),
    st.sampled_from([(), (14,)]),
)
def test_feed_without_stop_strings_equals_the_stopping_decoder(
    pieces: list[str], sizes: list[int], eos_at_end: bool, stop_ids: tuple[int, ...]
) -> None:
    """ChoiceState.feed with no stop string (the detokenizer's text straight through, a stop token
    sending it the matcher's way) gives, chunk by chunk, what StoppingDecoder gives: partial UTF-8
    held across chunks (emoji split into byte tokens), escapes and control characters, special tokens,
    an EOS or a stop token inside a chunk."""
    tok = qwen3()
    ids = tok.encode("".join(pieces), add_special_tokens=False)
    if eos_at_end:
        ids = [*ids, *tok.eos_token_ids[:1], *ids[:3]]
    s = sampling(stop_token_ids=list(stop_ids)) if stop_ids else sampling()
    st_ = ChoiceState(0, tok, s)  # type: ignore[arg-type]
    ref = StoppingDecoder(
        IncrementalDetokenizer(tok.hf, skip_special_tokens=True),
        StopMatcher(stop_token_ids=stop_ids, eos_token_ids=tok.eos_token_ids),
    )
    pos = k = 0
    stopped = False
    while pos < len(ids) and not stopped:  # bounded by the ids: each turn takes at least one
        chunk = ids[pos : pos + sizes[k % len(sizes)]]
        pos += len(chunk)
        k += 1
        want = ref.feed(chunk)
        got = st_.feed(chunk)
        assert got == want.visible, (chunk, got, want)
        assert st_.finished == want.finished
        stopped = want.finished
        if stopped:
            assert (st_.finish_reason, st_.matched) == ("stop", want.matched)
    if not stopped:
        end = ref.finish()
        assert st_.end("length") == end.visible
        assert st_.finish_reason == "length"
        assert st_.tokens == pos
    else:  # up to the stop token, which counts; not what came after it in its chunk
        assert isinstance(st_.matched, int)
        assert st_.tokens == ids.index(st_.matched) + 1


@settings(max_examples=80, deadline=None)
@given(
    st.text(alphabet=st.sampled_from(list("ab cSTOP.é🙂\n")), min_size=0, max_size=50),
    st.lists(st.integers(1, 8), min_size=1, max_size=30),
    st.booleans(),
    st.sampled_from([{"stop": ["STOP"]}, {"stop": ["."]}, {"stop_token_ids": [13]}, {}]),
)
def test_usage_ends_at_the_token_that_stopped_the_output(
    text: str, sizes: list[int], include: bool, stops: dict[str, list[object]]
) -> None:
    """However the engine's tokens come in chunks, the choice counts (and logs the logprobs of) the tokens
    up to the one that completed a stop string or was a stop token, as one token a chunk does (vLLM's usage):
    the tokens the engine sent after it in the same chunk are neither shown nor counted."""
    tok = qwen3()
    ids = [*tok.encode(text, add_special_tokens=False), *tok.eos_token_ids]
    s = sampling(include_stop_str_in_output=include, **stops)
    one = ChoiceState(0, tok, s)  # type: ignore[arg-type]
    for t in ids:
        one.feed([t])
    chunked = ChoiceState(0, tok, s)  # type: ignore[arg-type]
    lps = [object() for _ in ids]  # one per token
    pos, k = 0, 0
    while pos < len(ids) and not chunked.finished:
        n = sizes[k % len(sizes)]
        chunked.feed(ids[pos : pos + n], lps[pos : pos + n])  # type: ignore[arg-type]
        pos, k = pos + n, k + 1
    assert (chunked.tokens, chunked.full_text(), chunked.matched) == (
        one.tokens,
        one.full_text(),
        one.matched,
    )
    assert chunked.logprobs == lps[: chunked.tokens]
