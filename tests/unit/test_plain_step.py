"""The plain per-token step in C (``plain_step.PlainStep``) against the Python token path.

The Python path a streamed choice's batch takes (``Generation._drive``'s ``take_and_write`` for one
choice: ``ChoiceState.feed``, the parser stage's ``stream`` or the encoder's ``content``, the chunk's
framing and write) is written out here from the same public pieces; the C step, with that as its
fallback, must write the same bytes and leave the same state after every batch, on hostile token
sequences of the qwen3 and llama tokenizers: multi-byte characters split across tokens, special and
added tokens, control characters, quotes, backslashes, U+2028/2029, emoji as byte tokens, ids outside
the vocabulary, stop and EOS ids, logprobs, batches of two events, chunks of more than 64 ids, a reasoning
parser before and after its think block. The end-to-end test runs a paced answer through the node with
the C step and without it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.node.openai.requests import parse_chat
from shepherd.node.openai.sse import ChatChunks, CompletionChunks
from shepherd.node.output import plain_step as plain_step_module
from shepherd.node.output.chat import ChatOutput, ChoiceParsing
from shepherd.node.output.choice import ChoiceState
from shepherd.node.output.plain_step import PlainStep, plain_step
from shepherd.proto.engine_types import EngineChunk, EngineEvent, TokenLogprob
from shepherd.tokens.detokenizer import IncrementalDetokenizer
from shepherd.tokens.fast_bpe_core import _to_latin1_table
from shepherd.tokens.fast_decode import ByteDecoder
from shepherd.tokens.tokenizer import Tokenizer
from tests.unit.test_tokenizer_shared import llama, qwen3

pytestmark = pytest.mark.skipif(not plain_step_module.BUILT, reason="the C extension is not built")

_HOSTILE = [
    *'ab "\\\n\r\t\x00\x01\x08\x0c\x1b\x1f\x7f\u2028\u2029é中🙂🦩\ufffd',
    " the",
    "<think>",
    "</think>",
    "<|im_end|>",
    "<|eot_id|>",
    "STOP",
    "'s",
    "  ",
]


class _KeepAlive:
    def __init__(self) -> None:
        self.last = 0.0


class _Wire:
    """The connection's ``send_framed``: records each write; every ``pause_every``-th asks for a pause."""

    def __init__(self, pause_every: int = 0) -> None:
        self.writes: list[bytes] = []
        self.pause_every = pause_every

    def send_framed(self, chunk: bytes) -> bool:
        self.writes.append(chunk)
        return bool(self.pause_every) and len(self.writes) % self.pause_every == 0


class _Run:
    """One streamed choice, with the Python path's ``take_and_write`` (one choice, index 0) on it."""

    def __init__(
        self,
        tok: Tokenizer,
        sampling: Any,
        reasoning: str | None,
        pause_every: int,
        completions: bool = False,
    ) -> None:
        self.enc: ChatChunks | CompletionChunks = (
            CompletionChunks("cmpl-x", 1, "m") if completions else ChatChunks("chatcmpl-x", 1, "m")
        )
        self.st = ChoiceState(0, tok, sampling)
        self.post: ChoiceParsing | None = (
            ChatOutput(reasoning, False, None, (), True).choice(self.enc, 0)
            if reasoning and isinstance(self.enc, ChatChunks)
            else None
        )
        self.wire = _Wire(pause_every)
        self.ka = _KeepAlive()
        self.last = [time.perf_counter()]
        self.cached = [0]
        self.got = [0]
        self.last_ids: list[Sequence[int]] = [()]
        self.seen = [False]
        self.pending: list[bytes] = []
        self.itl: list[float] = []

    def hostile_step(
        self, detok: Any, ids: list[int], drop: Any, fallback: Callable[[Any], bool], vocab: int
    ) -> PlainStep:
        """A ``PlainStep`` on this run's state, built by hand (with the arguments tests make hostile)."""
        return PlainStep(
            EngineChunk, self.st, self.st.text, detok, ids, [], None, drop, frozenset(), None, b"p", b"t",
            self.itl.append, time.perf_counter, self.last, self.cached, self.got, self.last_ids, self.seen,
            self.ka, time.monotonic, self.wire.send_framed, self.pending, fallback, vocab,
        )  # fmt: skip

    def take_and_write(self, batch: list[EngineEvent]) -> bool:
        out: list[bytes] = []
        ntok = 0
        st_ = self.st
        for ev in batch:
            assert isinstance(ev, EngineChunk) and ev.index == 0
            self.cached[0] = max(self.cached[0], ev.cached_tokens)
            ntok += len(ev.token_ids)
            self.seen[0] = True
            self.got[0] += len(ev.token_ids)
            self.last_ids[0] = ev.token_ids
            if st_.finished:
                continue
            lps = ev.logprobs
            text = st_.feed(ev.token_ids, lps)
            lp = {"content": [lp.token_id for lp in lps]} if lps else None
            if self.post is not None:
                if text or lps:
                    self.post.stream(text, lp, out)
            elif text or lps:
                out.append(self.enc.content(0, text, lp))
            if _finished(st_):  # (a call: mypy keeps st_.finished narrowed past feed)
                out.append(self.enc.finish(0, st_.finish_reason or "stop", st_.matched))
        now = time.perf_counter()
        if ntok:
            self.itl.append((now - self.last[0]) / ntok)
        self.last[0] = now
        if not out:
            return st_.finished
        self.ka.last = time.monotonic()
        data = b"".join(self.pending + out)
        self.pending.clear()
        paused = self.wire.send_framed(b"%x\r\n%s\r\n" % (len(data), data))
        return st_.finished or paused

    def c_step(self, itl: Any = None) -> PlainStep | None:
        return plain_step(
            self.st,
            self.post,
            None if self.post is not None else self.enc.content0,
            observe=self.itl.append,
            last=self.last,
            cached=self.cached,
            got=self.got,
            last_ids=self.last_ids,
            seen=self.seen,
            ka=self.ka,
            send=self.wire.send_framed,
            pending=self.pending,
            fallback=self.take_and_write,
            itl=itl,
        )

    def state(self) -> tuple[Any, ...]:
        st_ = self.st
        detok = _detok(st_)
        return (
            st_.tokens,
            list(st_.text),
            st_.finished,
            st_.finish_reason,
            list(detok.token_ids),
            detok.pending,
            detok.text,
            self.got[0],
            self.cached[0],
            list(self.last_ids[0]),
            self.seen[0],
            len(self.itl),
            list(self.wire.writes),
        )


def _byte_chars() -> dict[int, str]:
    """byte -> its byte-level character (the GPT-2 mapping)."""
    return {ord(v): chr(k) for k, v in _to_latin1_table().items() if v != "\uffff"}


_BYTE_CHARS = _byte_chars()


def _finished(st_: ChoiceState) -> bool:
    return st_.finished


def _detok(st_: ChoiceState) -> IncrementalDetokenizer:
    d = st_.dec.decoder
    assert isinstance(d, IncrementalDetokenizer)
    return d


def _sampling(skip: bool, stop_ids: tuple[int, ...]) -> Any:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    if not skip:
        body["skip_special_tokens"] = False
    if stop_ids:
        body["stop_token_ids"] = list(stop_ids)
    return parse_chat(body).sampling


def _batches(
    tok: Tokenizer, rng: random.Random, pieces: list[str], n_batches: int
) -> list[list[EngineEvent]]:
    """Hostile chunks: the pieces' ids cut anywhere, byte tokens of split characters, special, EOS and
    out-of-vocabulary ids, random vocabulary ids, logprobs, two-event batches, chunks over 64 ids."""
    hf = tok.hf
    vocab = hf.get_vocab_size(with_added_tokens=True)
    ids = list(hf.encode("".join(pieces), add_special_tokens=False).ids)
    specials = sorted(hf.get_added_tokens_decoder())
    pool = [*ids, *specials[:8], *tok.eos_token_ids, vocab + 3]
    for ch in "🙂🦩中é\u2028":  # each byte of a multi-byte character as its own byte-level token
        for b in ch.encode():
            i = hf.token_to_id(_BYTE_CHARS[b])
            if i is not None:
                pool.extend([i] * 3)
    seq = list(ids)
    for _ in range(rng.randrange(0, 12)):
        seq.insert(
            rng.randrange(len(seq) + 1), rng.choice(pool) if rng.random() < 0.7 else rng.randrange(vocab)
        )
    out: list[list[EngineEvent]] = []
    pos = 0
    cached = 0
    for _ in range(n_batches):  # bounded
        if pos >= len(seq):
            break
        size = rng.choice([1, 1, 1, 1, 2, 3, 70])
        chunk = seq[pos : pos + size]
        pos += len(chunk)
        cached = max(0, cached + rng.choice([0, 0, 5, -3]))
        lps = [TokenLogprob(chunk[0], -0.5)] if rng.random() < 0.08 else []
        ev = EngineChunk(0, chunk, cached_tokens=cached, logprobs=lps)
        if rng.random() < 0.08 and pos < len(seq):
            ev2 = EngineChunk(0, seq[pos : pos + 1])
            pos += 1
            out.append([ev, ev2])
        else:
            out.append([ev])
    return out


def _tokenizer(name: str) -> Tokenizer:
    tok = qwen3() if name == "qwen3" else llama()
    assert ByteDecoder.build(tok.hf) is not None  # the node builds it at start
    return tok


@settings(max_examples=120, deadline=None)
@given(
    st.sampled_from(["qwen3", "llama"]),
    st.lists(st.sampled_from(_HOSTILE), min_size=1, max_size=40),
    st.integers(0, 2**32),
    st.booleans(),
    st.sampled_from([(), (14,), (220, 13)]),
    st.sampled_from([None, "qwen3"]),
    st.sampled_from([0, 0, 3]),
    st.booleans(),
)
def test_the_c_step_writes_what_the_python_path_writes(
    name: str,
    pieces: list[str],
    seed: int,
    skip: bool,
    stop_ids: tuple[int, ...],
    reasoning: str | None,
    pause_every: int,
    completions: bool,
) -> None:
    tok = _tokenizer(name)
    rng = random.Random(seed)
    batches = _batches(tok, rng, pieces, 200)
    s = _sampling(skip, stop_ids)
    py = _Run(tok, s, reasoning, pause_every, completions)
    cc = _Run(tok, s, reasoning, pause_every, completions)
    step = None
    for k, batch in enumerate(batches):
        want = py.take_and_write(batch)
        if k == 0:  # the first batch is the Python path's (as in the node: before the push)
            got = cc.take_and_write(batch)
            step = cc.c_step()
        else:
            got = step(batch) if step is not None else cc.take_and_write(batch)
        assert got == want, (k, batch)
        assert cc.state() == py.state(), (k, batch)
        if step is not None and step.paused:  # what _drive does with the pause
            step.paused = False
    assert cc.st.end("length") == py.st.end("length")
    assert cc.state() == py.state()
    if cc.post is not None and py.post is not None:
        a: list[bytes] = []
        b: list[bytes] = []
        cc.post.stream_end(a)
        py.post.stream_end(b)
        assert a == b


def test_the_c_step_takes_plain_tokens_and_leaves_the_rest() -> None:
    tok = _tokenizer("qwen3")
    s = _sampling(True, ())
    run = _Run(tok, s, None, 0)
    hf = tok.hf
    first = hf.encode("Hi", add_special_tokens=False).ids
    run.take_and_write([EngineChunk(0, first)])
    step = run.c_step()
    assert step is not None
    emoji = list("🙂".encode())
    byte_ids = [hf.token_to_id(_BYTE_CHARS[b]) or 0 for b in emoji]
    assert all(byte_ids)
    for i in byte_ids:  # the character's bytes one token each: held until whole
        assert step([EngineChunk(0, [i])]) is False
    assert step.taken == len(byte_ids)
    assert run.st.text[-1] == "🙂" and len(run.wire.writes) == 2
    assert run.wire.writes[-1].endswith(
        b'"delta":{"content":"\xf0\x9f\x99\x82"},"logprobs":null,"finish_reason":null}]}\n\n\r\n'
    )
    quote = hf.encode(' "\\\n', add_special_tokens=False).ids
    step([EngineChunk(0, quote)])
    assert b'"delta":{"content":" \\"\\\\\\n"}' in run.wire.writes[-1]
    taken = step.taken
    step([EngineChunk(0, [*tok.eos_token_ids[:1]])])  # a stop id: the Python path's (it finishes)
    assert step.taken == taken and run.st.finished
    assert run.wire.writes[-1].endswith(
        b'"finish_reason":"stop","matched_stop":%d,"stop_reason":null}]}\n\n\r\n' % tok.eos_token_ids[0]
    )


def test_hostile_state_goes_to_the_fallback_or_raises_without_crashing() -> None:
    tok = _tokenizer("qwen3")
    run = _Run(tok, _sampling(True, ()), None, 0)
    run.take_and_write([EngineChunk(0, tok.hf.encode("Hi", add_special_tokens=False).ids)])
    step = run.c_step()
    assert step is not None
    calls: list[Any] = []

    def fallback(batch: Any) -> bool:
        calls.append(batch)
        return True

    hostile = run.hostile_step(_detok(run.st), list(_detok(run.st).token_ids), None, fallback, 10)
    batches: list[Any] = [
        "not a list",
        [],
        [EngineChunk(0, [1]), EngineChunk(0, [2])],
        [EngineChunk(1, [1])],
        [EngineChunk(0, (1,))],  # a tuple of ids
        [EngineChunk(0, [])],
        [EngineChunk(0, [-1])],
        [EngineChunk(0, [2**70])],
        [EngineChunk(0, [10])],  # outside the vocabulary (10)
        [EngineChunk(0, [True])],  # not an exact int
        [EngineChunk(0, list(range(65)))],
        [EngineChunk(0, [1], logprobs=[TokenLogprob(1, -1.0)])],
        [object()],
    ]
    for batch in batches:
        calls.clear()
        assert hostile(batch) is True  # (the fallback's answer)
        assert calls == [batch]
    with pytest.raises(TypeError):
        hostile([EngineChunk(0, [1])], extra=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        PlainStep()  # type: ignore[call-arg]
    run.got[0] = "x"  # type: ignore[call-overload]
    calls.clear()
    hostile([EngineChunk(0, [1])])
    assert len(calls) == 1
    run.got[0] = 0
    run.pending.append(b"held")
    calls.clear()
    hostile([EngineChunk(0, [1])])
    assert len(calls) == 1
    run.pending.clear()


class _Clearing:
    """An element of a drop set whose comparison empties the lists the step is about to write."""

    def __init__(self, value: int, lists: list[list[Any]]) -> None:
        self.value = value
        self.lists = lists

    def __hash__(self) -> int:
        return hash(self.value)

    def __eq__(self, other: object) -> bool:
        for lst in self.lists:
            lst.clear()
        return False


def test_a_set_lookup_that_runs_python_code_cannot_crash_the_step() -> None:
    tok = _tokenizer("qwen3")
    run = _Run(tok, _sampling(True, ()), None, 0)
    run.take_and_write([EngineChunk(0, tok.hf.encode("Hi", add_special_tokens=False).ids)])
    detok = _detok(run.st)
    calls: list[Any] = []
    hostile = run.hostile_step(
        detok,
        list(detok.token_ids),
        {_Clearing(5, [run.got, run.cached, run.last, run.seen, run.last_ids])},
        lambda b: bool(calls.append(b)),  # type: ignore[func-returns-value]
        tok.hf.get_vocab_size(with_added_tokens=True),
    )
    assert hostile([EngineChunk(0, [5])]) is False
    assert len(calls) == 1  # the lists were emptied: the step left the batch to the fallback


def test_the_inline_histogram_update_is_observes() -> None:
    from shepherd.node.metrics import LiteHistogram

    fam = LiteHistogram("t_itl", "doc", ("model",), buckets=[0.001, 0.005, 0.01, 0.05, 0.1, 1.0])
    ours, ref = fam.labels("a"), fam.labels("b")
    tok = _tokenizer("qwen3")
    run = _Run(tok, _sampling(True, ()), None, 0)
    hf = tok.hf
    run.take_and_write([EngineChunk(0, hf.encode("Hi", add_special_tokens=False).ids)])
    step = run.c_step(itl=ours)  # (its observe, the run's list, is not called: the C step updates ``ours``)
    assert step is not None
    values: list[float] = []
    seen_by_observe = len(run.itl)
    for k, i in enumerate(hf.encode(" a b c d e f g h i j", add_special_tokens=False).ids):
        run.last[0] -= (0.0007, 0.003, 0.005, 0.02, 0.5, 3.0)[k % 6]  # every bucket and +Inf, and a bound
        before = run.last[0]
        step([EngineChunk(0, [i])])
        values.append(run.last[0] - before)
    assert step.taken == len(values)
    for v in values:
        ref.observe(v)
    assert ours.counts == ref.counts and ours.sum == pytest.approx(ref.sum, abs=0, rel=1e-12)
    assert sum(ours.counts) == len(values)
    assert len(run.itl) == seen_by_observe  # the observe callback was not called: the histogram was


# ---- through the node ----------------------------------------------------------------------------


_ANSWER = 'Il dit "bonjour" \\ à 🙂🦩 \u2028\u2029 中文\x01\t\x7f fin. '


async def _answer_through_the_node(monkeypatch: pytest.MonkeyPatch, c_step: bool, pause_every: int) -> Any:
    import asyncio

    from shepherd.node.api import generation
    from shepherd.node.app import build_app
    from shepherd.node.config import build_config
    from shepherd.node.dispatch.gateway import Gateway
    from shepherd.node.http.server import LeanServer
    from tests.fake_h2_engine import canned_worker
    from tests.unit.test_stream_push import TOKENS, _Node, _paced_reply

    made: list[PlainStep] = []

    def recording(*args: Any, **kw: Any) -> PlainStep | None:
        step = plain_step(*args, **kw) if c_step else None
        if step is not None:
            made.append(step)
        return step

    monkeypatch.setattr(generation, "plain_step", recording)
    from shepherd.node.engines.h2 import GenerateCall

    listener_calls = [0]
    real_ready = GenerateCall._on_ready

    def counting(self: GenerateCall) -> None:
        listener_calls[0] += 1
        real_ready(self)

    monkeypatch.setattr(GenerateCall, "_on_ready", counting)
    loop = asyncio.get_running_loop()
    gw = Gateway(build_config({}, {"policy": "round_robin", "tokenizer_workers": 0}))
    await gw.tokenizers.start()
    model = gw.model_names()[0]
    hf = gw.tokenizer(model).hf
    ids = list(hf.encode(_ANSWER, add_special_tokens=False).ids)
    ids += [hf.token_to_id(_BYTE_CHARS[b]) or 0 for b in "🙂".encode()]  # a character as byte tokens
    ids = (ids * 3)[:TOKENS]
    w, client, proto = canned_worker(loop, model, _paced_reply(ids), max_streams=64)
    gw.registry.workers[w.id] = w
    srv = LeanServer(build_app(gw), max_body=gw.cfg.max_body_bytes)
    try:
        t = await _Node(loop, srv, w, proto.conn.streams, model).ask(pause_every)
        assert w.in_flight == 0 and not proto.conn.streams
    finally:
        await client.close()
        await gw.tokenizers.close()
    if c_step:
        assert made and made[0].taken > 0  # the C step took the tokens
    else:
        assert not made
    return t, listener_calls[0]


@pytest.mark.parametrize("pause_every", [0, 3])
async def test_a_paced_answer_through_the_node_is_the_same_with_the_c_step(
    monkeypatch: pytest.MonkeyPatch, pause_every: int
) -> None:
    import re

    from tests.unit.test_stream_push import TOKENS, _events

    python, python_ready = await _answer_through_the_node(monkeypatch, False, pause_every)
    c, c_ready = await _answer_through_the_node(monkeypatch, True, pause_every)
    if not pause_every:  # the engine's messages went to the C step's own listener, not _on_ready
        assert python_ready >= TOKENS - 2 and c_ready <= 2, (python_ready, c_ready)
    assert _events(c.data) == _events(python.data)
    assert c.writes == python.writes
    if pause_every:
        assert c.pauses == python.pauses >= 2 and c.written_while_paused == 0

    def norm(b: bytes | bytearray) -> bytes:
        return re.sub(rb"chatcmpl-[0-9a-f]+|\"created\":\d+|x-smg-gateway-ms: [0-9.]+", b"X", bytes(b))

    assert norm(c.data) == norm(python.data)  # byte for byte, framing included


class _Fut:
    def __init__(self) -> None:
        self.finished = False

    def done(self) -> bool:
        return self.finished


class _Stream:
    def __init__(self) -> None:
        self.done = False


def test_the_c_listener_takes_a_lone_plain_chunk_and_leaves_the_rest() -> None:
    import collections

    from shepherd.proto.engine_responses import lone_chunk
    from tests.unit.test_output_path import wire

    assert lone_chunk is not None
    tok = _tokenizer("qwen3")
    run = _Run(tok, _sampling(True, ()), None, 0)
    hf = tok.hf
    run.take_and_write([EngineChunk(0, hf.encode("Hi", add_special_tokens=False).ids)])
    step = run.c_step()
    assert step is not None
    msgs: collections.deque[bytes] = collections.deque()
    stream, fut = _Stream(), _Fut()
    ends: list[Any] = []
    listener = step.bind_listener(
        msgs,
        stream,
        fut,
        lone_chunk,
        False,
        lambda: ends.append("slow"),
        lambda: ends.append("stopped"),
        lambda e: ends.append(e),
    )
    word = hf.encode(" there", add_special_tokens=False).ids
    msgs.append(wire(EngineChunk(0, word)))
    listener()
    assert not msgs and ends == [] and step.taken == 1 and run.st.text[-1] == " there"
    msgs.append(wire(EngineChunk(0, word)))
    msgs.append(wire(EngineChunk(0, word)))
    listener()  # two messages: the Python listener's
    assert len(msgs) == 2 and ends == ["slow"] and step.taken == 1
    msgs.clear()
    ends.clear()
    msgs.append(b"\x00garbage")
    listener()  # not a plain chunk: left for the Python listener
    assert list(msgs) == [b"\x00garbage"] and ends == ["slow"]
    msgs.clear()
    ends.clear()
    stream.done = True
    msgs.append(wire(EngineChunk(0, word)))
    listener()  # taken, then the end is the Python listener's
    assert not msgs and ends == ["slow"] and step.taken == 2
    stream.done = False
    ends.clear()
    fut.finished = True
    msgs.append(wire(EngineChunk(0, word)))
    listener()  # the consumer went away: the Python listener's
    assert len(msgs) == 1 and ends == ["slow"]
    fut.finished = False
    msgs.clear()
    ends.clear()
    run.wire.pause_every = 1  # the write asks for a pause: the push stops
    msgs.append(wire(EngineChunk(0, word)))
    listener()
    assert ends == ["stopped"] and step.paused
    step.paused = False
    ends.clear()

    def gone(chunk: bytes) -> bool:
        raise ConnectionResetError("the client closed the connection")

    broken = plain_step(
        run.st,
        None,
        run.enc.content0,
        observe=run.itl.append,
        last=run.last,
        cached=run.cached,
        got=run.got,
        last_ids=run.last_ids,
        seen=run.seen,
        ka=run.ka,
        send=gone,
        pending=run.pending,
        fallback=run.take_and_write,
    )
    assert broken is not None
    listener = broken.bind_listener(
        msgs, stream, fut, lone_chunk, False, lambda: None, lambda: None, lambda e: ends.append(e)
    )
    msgs.append(wire(EngineChunk(0, word)))
    listener()  # an Exception fails the push
    assert len(ends) == 1 and isinstance(ends[0], ConnectionResetError)


def test_counts_a_chunk_would_carry_past_the_int64_range_are_the_python_paths() -> None:
    tok = _tokenizer("qwen3")
    hf = tok.hf
    word = hf.encode(" there", add_special_tokens=False).ids
    top = 2**63 - 1
    for field in ("tokens", "got"):
        py = _Run(tok, _sampling(True, ()), None, 0)
        cc = _Run(tok, _sampling(True, ()), None, 0)
        first: list[EngineEvent] = [EngineChunk(0, hf.encode("Hi", add_special_tokens=False).ids)]
        py.take_and_write(first)
        cc.take_and_write(first)
        step = cc.c_step()
        assert step is not None
        for run in (py, cc):
            if field == "tokens":
                run.st.tokens = top
            else:
                run.got[0] = top
        assert step([EngineChunk(0, word)]) == py.take_and_write([EngineChunk(0, word)])
        assert cc.state() == py.state()
        assert (cc.st.tokens if field == "tokens" else cc.got[0]) == top + len(word)
        assert step.taken == 0  # the Python path's


def test_the_c_listener_holds_what_it_calls_when_the_listener_is_bound_again() -> None:
    """A future whose ``done`` binds the listener again (dropping the callables the step held): the call
    in progress goes on with the ones it started with, alive."""
    import collections

    from shepherd.proto.engine_responses import lone_chunk
    from tests.unit.test_output_path import wire

    assert lone_chunk is not None
    tok = _tokenizer("qwen3")
    run = _Run(tok, _sampling(True, ()), None, 0)
    hf = tok.hf
    run.take_and_write([EngineChunk(0, hf.encode("Hi", add_special_tokens=False).ids)])
    made = run.c_step()
    assert made is not None
    step: PlainStep = made
    reader = lone_chunk
    msgs: collections.deque[bytes] = collections.deque()
    stream = _Stream()
    ends: list[str] = []

    class _Rebinding(_Fut):
        def done(self) -> bool:
            step.bind_listener(
                msgs, stream, _Fut(), reader, False, lambda: ends.append("new"), ends.clear, lambda e: None
            )
            return True

    step.bind_listener(
        msgs,
        stream,
        _Rebinding(),
        lone_chunk,
        False,
        (lambda tag: lambda: ends.append(tag))("old"),  # (held by the step alone)
        ends.clear,
        lambda e: None,
    )
    msgs.append(wire(EngineChunk(0, hf.encode(" there", add_special_tokens=False).ids)))
    step.ready()
    assert ends == ["old"] and len(msgs) == 1
    step.ready()  # bound again: the new future is pending, the chunk is taken here
    assert ends == ["old"] and not msgs and step.taken == 1
    msgs.extend([b"a", b"b"])
    step.ready()  # two messages: the new Python listener's
    assert ends == ["old", "new"]


def test_a_lone_chunk_reader_that_raises_fails_the_push_as_the_python_listener_does() -> None:
    import collections

    from tests.unit.test_output_path import wire

    tok = _tokenizer("qwen3")
    run = _Run(tok, _sampling(True, ()), None, 0)
    hf = tok.hf
    run.take_and_write([EngineChunk(0, hf.encode("Hi", add_special_tokens=False).ids)])
    step = run.c_step()
    assert step is not None
    msgs: collections.deque[bytes] = collections.deque()
    ends: list[Any] = []

    def raising(raw: bytes, vllm: bool) -> Any:
        raise ValueError("unreadable")

    listener = step.bind_listener(
        msgs,
        _Stream(),
        _Fut(),
        raising,
        False,
        lambda: ends.append("slow"),
        lambda: ends.append("stopped"),
        ends.append,
    )
    msgs.append(wire(EngineChunk(0, [1])))
    listener()  # (_on_ready takes the message off, then the reader's error fails the push)
    assert not msgs and len(ends) == 1 and isinstance(ends[0], ValueError)
    assert step.taken == 0

    def interrupting(raw: bytes, vllm: bool) -> Any:
        raise KeyboardInterrupt

    listener = step.bind_listener(
        msgs, _Stream(), _Fut(), interrupting, False, ends.clear, ends.clear, ends.append
    )
    msgs.append(wire(EngineChunk(0, [1])))
    with pytest.raises(KeyboardInterrupt):  # not an Exception: it propagates, as from _on_ready
        listener()


def test_every_code_point_is_escaped_as_orjson_escapes_it() -> None:
    """Tokens holding every code point (U+0000 .. U+10FFFF less the surrogates, 1,024 a token): the C
    step's JSON strings are orjson's (control characters, quote and backslash escaped; DEL, U+2028/2029
    and the astral planes as UTF-8)."""
    tok = _tokenizer("qwen3")
    s = _sampling(True, ())
    py, cc = _Run(tok, s, None, 0), _Run(tok, s, None, 0)
    cps = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    chunks = ["".join(map(chr, cps[i : i + 1024])).encode() for i in range(0, len(cps), 1024)]
    for run in (py, cc):
        base = _detok(run.st)._table
        assert base is not None
        _detok(run.st)._table = chunks + base[len(chunks) :]  # (a copy: the table is the tokenizer's)
    py.take_and_write([EngineChunk(0, [0])])
    cc.take_and_write([EngineChunk(0, [0])])
    step = cc.c_step()
    assert step is not None
    for k in range(1, len(chunks)):
        py.take_and_write([EngineChunk(0, [k])])
        step([EngineChunk(0, [k])])
    assert step.taken == len(chunks) - 1
    assert cc.wire.writes == py.wire.writes
    out = b"".join(py.wire.writes)
    assert b"\\u0000" in out and b"\\u001f" in out
    assert "\u2028\u2029".encode() in out and b"\x7f\xc2\x80" in out
