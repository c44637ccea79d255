"""Fuzz targets of the five C extensions' entry points, each against its Python (or protobuf) reference:

- ``_prefixcore``: ``block_hashes`` on any ints (``py_block_hashes``); ``KvMap``'s calls against a dict
  with its bound, on hashes chosen to collide under a fixed hash too; ``KvMap.apply`` on any bytes (an
  answer or ``ValueError``, never a crash); the KV wire path (``_kvwire.kv_scan`` + ``KvMap.apply``) on
  random and mutated batches against protobuf's parse and ``KvEventApplier`` (the unit tests' checks);
- ``_varint``: ``packed_uint32`` on any values (protobuf's bytes, or None), ``lone_chunk`` /
  ``chunk_fields`` on mutated responses (protobuf's event, or None when protobuf refuses the message);
- ``_pretok``: the split against the ``regex`` module's (the tokenizers' patterns), ``encode_ascii``
  against the ranks looked up piece by piece;
- ``_otlp_spans``: lean spans whose fields hold values of any type, against the Python encoder (the
  same bytes, or the same exception type);
- and each entry point called again and again on the same inputs (errors included) holds no more
  memory blocks than it did: a reference it leaked would keep its object alive.

``make fuzz-asan`` runs these (and the extensions' unit tests) with the extensions built with
AddressSanitizer and UBSan (``tests/fuzz/native_dir.py`` imports that build)."""

from __future__ import annotations

import functools
import random
import re
import sys
from collections.abc import Callable
from typing import Any

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st
from smg_grpc_proto import sglang_scheduler_pb2 as sg
from smg_grpc_proto import vllm_engine_pb2 as vl

from shepherd.node.observe import otlp_wire
from shepherd.policies.block_names import py_block_hashes
from shepherd.policies.native_index import NATIVE_INDEX, NativePrefixIndex
from shepherd.proto import engine_responses
from shepherd.proto.engine_responses import decode_response
from shepherd.proto.engine_types import EngineChunk, TokenLogprob
from shepherd.proto.varint import varint
from shepherd.tokens.fast_bpe import _C_SPLIT_DIGITS
from tests.colliding_keys import colliding_keys
from tests.fuzz.profiles import Budget, fuzz_settings, run_bounded
from tests.mutate import mutated

try:  # optional: an install without a C compiler has none of them (the targets are skipped)
    from shepherd.policies import _prefixcore
    from shepherd.proto import _kvwire, _varint
    from shepherd.tokens import _pretok
except ImportError:  # pragma: no cover
    pytest.skip("the C extensions are not built", allow_module_level=True)

INT64 = (-(1 << 63), (1 << 63) - 1)


@functools.cache
def _colliding() -> list[int]:
    """Keys whose fixed hash shares its low 20 bits (one probe run at any table size up to 2**20)."""
    return colliding_keys(1000, 20)


# ---- _prefixcore ----------------------------------------------------------------------------------------

_ANY_INT = st.one_of(
    st.integers(0, 40),
    st.integers(0, (1 << 32) - 1),
    st.integers(*INT64),
    st.integers(-(1 << 70), 1 << 70),
    st.booleans(),
)


def test_fuzz_block_hashes(fuzz_budget: Budget) -> None:
    @fuzz_settings(ci_examples=100)
    @given(st.lists(_ANY_INT, max_size=70), st.one_of(st.none(), _ANY_INT), st.integers(0, 70), st.booleans())
    def check(ids: list[int], seed: int | None, start: int, as_tuple: bool) -> None:
        kw: dict[str, Any] = {} if seed is None else {"seed": seed}
        seq = tuple(ids) if as_tuple else ids
        assert _prefixcore.block_hashes(seq, start=start, **kw) == py_block_hashes(seq, start=start, **kw)

    run_bounded(check, fuzz_budget)


class _DictMap:
    """``KvMap``'s reference: an insertion-ordered dict with the same bound."""

    def __init__(self, per: int, max_blocks: int) -> None:
        self.per, self.max = per, max_blocks
        self.d: dict[int, list[int]] = {}

    def put(self, hs: list[int], names: list[int]) -> None:
        for i in range(min(len(names) // self.per, len(hs))):  # bounded
            self.d[hs[i]] = names[i * self.per : (i + 1) * self.per]
        over = len(self.d) - self.max
        if over > 0:
            for k in list(self.d)[: over + self.max // 16]:
                del self.d[k]

    def pop(self, hs: list[int]) -> list[int]:
        out: list[int] = []
        for h in hs:
            out += self.d.pop(h, [])
        return out

    def seed(self, h: int) -> int | None:
        v = self.d.get(h)
        return None if v is None else v[-1]


def test_fuzz_kv_map_against_a_dict(fuzz_budget: Budget) -> None:
    @fuzz_settings(ci_examples=60)
    @given(st.integers(0, 1 << 32), st.integers(1, 3), st.sampled_from([1, 5, 64, 1 << 20]))
    def check(seed: int, per: int, max_blocks: int) -> None:
        rng = random.Random(seed)
        pool = [*(rng.randint(*INT64) for _ in range(30)), *rng.sample(_colliding(), 300)]
        m, ref = _prefixcore.KvMap(per, max_blocks), _DictMap(per, max_blocks)
        for _ in range(rng.randint(1, 60)):  # bounded
            op = rng.random()
            if op < 0.5:
                hs = rng.sample(pool, rng.randint(0, 40))
                names = [rng.randint(*INT64) for _ in range(rng.randint(0, 45 * per))]
                m.put(hs, names)
                ref.put(hs, names)
            elif op < 0.8:
                hs = [*rng.sample(pool, rng.randint(0, 20)), 1 << 64, -(1 << 70)]  # outside 64 bits: none
                assert m.pop(hs) == ref.pop(hs)
            elif op < 0.95:
                h = rng.choice([*pool, 1 << 80])
                assert m.seed(h) == ref.seed(h)
            else:
                m.clear()
                ref.d.clear()
            assert m.keys() == list(ref.d) and len(m) == len(ref.d)
        assert m.probes() < 40 * (len(pool) + 60 * 40)  # no run of colliding cells

    run_bounded(check, fuzz_budget)


@pytest.mark.skipif(not NATIVE_INDEX, reason="the C index is not built")
def test_fuzz_kv_map_apply_on_any_bytes(fuzz_budget: Budget) -> None:
    """Any bytes from any start: an answer (stops within the bytes) or ValueError, the map and the index
    usable after."""
    from tests.unit.test_kv_events_native import _stream  # not at the top: the unit tests' generator

    @fuzz_settings(ci_examples=200)
    @given(st.integers(0, 1 << 32), st.integers(0, 8), st.integers(-1, 2), st.binary(max_size=64))
    def check(seed: int, flips: int, slot: int, junk: bytes) -> None:
        rng = random.Random(seed)
        raw = mutated(rng, _stream(rng, 1)[0], flips) if rng.random() < 0.8 else junk
        ix = NativePrefixIndex()
        ix.insert(list(range(64)), "w", 1.0)
        m = _prefixcore.KvMap(rng.choice([1, 2]), rng.choice([1, 64]))
        start = rng.randrange(len(raw) + 1)
        try:
            lo, hi, *_counts = m.apply(ix._core, raw, start, slot, 1.0)
        except ValueError:
            pass
        else:
            assert lo == -1 or start <= lo < hi <= len(raw)
        m.keys()
        assert ix.match(list(range(64))) is not None
        assert _kvwire.kv_scan(raw) is None or isinstance(_kvwire.kv_scan(raw), tuple)

    run_bounded(check, fuzz_budget)


@pytest.mark.skipif(not NATIVE_INDEX, reason="the C index is not built")
def test_fuzz_kv_wire_path_against_protobuf(fuzz_budget: Budget) -> None:
    """Random streams and mutated batches: the unit tests' checks (the C path's state is the Python
    path's; kv_scan reads what protobuf parses and refuses what it refuses), with random seeds."""
    from tests.unit import test_kv_events_native as kv  # not at the top: the unit tests' checks

    mutated: Any = kv.test_kv_scan_reads_what_protobuf_parses_and_the_wire_path_fails_where_it_fails

    @fuzz_settings(ci_examples=20)
    @given(st.integers(0, 1 << 32), st.integers(1, 6), st.booleans())
    def check(seed: int, flips: int, replica: bool) -> None:
        mutated.hypothesis.inner_test(seed, flips)
        if seed % 4 == 0:
            kv._run(seed, replica)

    run_bounded(check, fuzz_budget)


# ---- _varint --------------------------------------------------------------------------------------------


def test_fuzz_packed_uint32(fuzz_budget: Budget) -> None:
    @fuzz_settings(ci_examples=100)
    @given(
        st.lists(st.one_of(_ANY_INT, st.floats(), st.text(max_size=2), st.none()), max_size=40),
        st.booleans(),
    )
    def check(ids: list[Any], as_tuple: bool) -> None:
        got = _varint.packed_uint32(tuple(ids) if as_tuple else ids)
        plain = all(type(i) is int and 0 <= i < 1 << 32 for i in ids)
        assert got == (b"".join(varint(i) for i in ids) if plain else None)

    run_bounded(check, fuzz_budget)


def _chunk_response(rng: random.Random, vllm: bool) -> bytes:
    ids = [rng.choice([rng.randrange(128), rng.randrange(1 << 32)]) for _ in range(rng.randint(0, 6))]
    counts = {k: rng.randrange(1 << 20) for k in ("prompt_tokens", "completion_tokens", "cached_tokens")}
    if vllm:
        raw: bytes = vl.GenerateResponse(
            chunk=vl.GenerateStreamChunk(token_ids=ids, **counts)
        ).SerializeToString()
        return raw
    rid = rng.choice(["", "r-1", "é" * 3, "x" * 130])
    chunk = sg.GenerateStreamChunk(token_ids=ids, **counts)
    raw = sg.GenerateResponse(request_id=rid, chunk=chunk).SerializeToString()
    return raw


def test_fuzz_lone_chunk_against_protobuf(fuzz_budget: Budget) -> None:
    """A (mutated) chunk response: the C readers' event is protobuf's, or they leave the message alone;
    never an event for a message protobuf refuses."""

    @fuzz_settings(ci_examples=300)
    @given(st.integers(0, 1 << 32), st.integers(0, 4), st.booleans())
    def check(seed: int, flips: int, vllm: bool) -> None:
        rng = random.Random(seed)
        raw = mutated(rng, _chunk_response(rng, vllm), flips)
        parse = (vl if vllm else sg).GenerateResponse.FromString
        try:
            msg = parse(raw)
        except DecodeError:
            msg = None
        lone = _varint.lone_chunk(raw, vllm)
        if lone is not None:
            assert msg is not None and msg.WhichOneof("response") == "chunk"
            assert lone == decode_response(msg)
        head = (engine_responses._vllm_chunk_head if vllm else engine_responses._sglang_chunk_head)(raw)
        fields = _varint.chunk_fields(raw, head, *((7, 0) if vllm else (8, 9))) if head else None
        if fields is not None:
            assert msg is not None
            want = decode_response(msg)
            assert isinstance(want, EngineChunk)
            assert (fields[0], fields[1], fields[2], fields[3], fields[4]) == (
                want.index,
                want.token_ids,
                want.prompt_tokens,
                want.completion_tokens,
                want.cached_tokens,
            )

    run_bounded(check, fuzz_budget)


# ---- _pretok --------------------------------------------------------------------------------------------

_ASCII_BITS = ["'s", "'LL", " ", "\n", "\r\n", "\t", "  ", "ab", "Z", "1234", "!?", " .", "\x0b", "\x1c"]
_ASCII = st.text(st.characters(max_codepoint=127), max_size=40) | st.lists(
    st.sampled_from(_ASCII_BITS), max_size=12
).map("".join)


def test_fuzz_pretok_against_the_regex_split(fuzz_budget: Budget) -> None:
    regex = pytest.importorskip("regex")  # (tiktoken's dependency: the patterns' \p{..} classes)
    patterns = {digits: regex.compile(p) for p, digits in _C_SPLIT_DIGITS.items()}

    @fuzz_settings(ci_examples=200)
    @given(
        _ASCII,
        st.sampled_from([1, 3]),
        st.dictionaries(st.binary(max_size=4), st.integers(0, 1 << 40), max_size=30),
    )
    def check(text: str, digits: int, ranks: dict[bytes, int]) -> None:
        spans = [m.span() for m in patterns[digits].finditer(text)]
        assert _pretok.split_ascii(text, digits) == spans
        table = _pretok.rank_table(ranks)

        def piece(b: bytes) -> list[int]:
            return [-x for x in b]

        want: list[int] = []
        for i, j in spans:
            b = text[i:j].encode()
            want += [ranks[b]] if b in ranks else piece(b)
        assert _pretok.encode_ascii(text, table, piece, digits) == want
        assert _pretok.encode_ascii(text + "é", table, piece, digits) is None

    run_bounded(check, fuzz_budget)


# ---- _otlp_spans ----------------------------------------------------------------------------------------

_ODD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 70), 1 << 130),
    st.floats(),
    st.text(max_size=5),
    st.binary(max_size=5),
    st.lists(st.integers(-2, 2) | st.text(max_size=2), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers() | st.text(max_size=3) | st.none(), max_size=3),
)
_FIELDS = (
    "trace_id",
    "parent",
    "name",
    "kind",
    "start_time",
    "end_time",
    "attrs",
    "events",
    "dropped_events",
)
_FIELDS2 = (*_FIELDS, "status", "desc", "remote", "state")


def _outcome(f: Callable[[], bytes]) -> bytes | type[BaseException]:
    try:
        return f()
    except Exception as e:  # any: the two writers must fail alike
        return type(e)


@pytest.mark.skipif(otlp_wire._c_request is None, reason="_otlp_spans is not built")
def test_fuzz_otlp_spans_against_the_python_encoder(fuzz_budget: Budget) -> None:
    from opentelemetry.sdk.resources import Resource  # not at the top: only this target needs it

    from shepherd.node.observe.tracing import _Span  # not at the top: only this target needs it

    saved = (_Span.resource, _Span.instrumentation_scope)
    _Span.resource = Resource.create({"service.name": "fuzz"})

    @fuzz_settings(ci_examples=200)
    @given(st.lists(st.dictionaries(st.sampled_from(_FIELDS2), _ODD, max_size=3), min_size=1, max_size=3))
    def check(changes: list[dict[str, Any]]) -> None:
        spans = []
        for ch in changes:
            s = _Span("x", 1, 0x1234, 7, False, None, True)
            s.attrs["k"] = "v"
            s.events.append(("e", s.start_time, {"a": 1}))
            s.end_time = s.start_time + 5
            for k, v in ch.items():
                setattr(s, k, v)
            spans.append(s)
        c = _outcome(lambda: otlp_wire.encode_request(spans))
        c_request, otlp_wire._c_request = otlp_wire._c_request, None
        try:
            py = _outcome(lambda: otlp_wire.encode_request(spans))
        finally:
            otlp_wire._c_request = c_request
        assert c == py

    try:
        run_bounded(check, fuzz_budget)
    finally:
        _Span.resource, _Span.instrumentation_scope = saved


# ---- _plainstep, _h2fast ----------------------------------------------------------------------------------

# a byte table's hostile entries: invalid UTF-8 (encoded surrogates, past U+10FFFF, overlong, lone lead and
# continuation bytes, a character's bytes cut anywhere), a literal U+FFFD, JSON's escapes, empty tokens
_BYTE_BITS = [
    *(b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"\x80", b"\xe4", b"\xe4\xb8"),
    *(b"\xad", b"\xf0\x9f", b"\x98\x80", b"\xef\xbf\xbd", b"", b'"', b"\\", b"\x00", b"\x1f", b"\x7f"),
    *("\u2028\u2029".encode(), b"a", b" x", b"\xff", b"\xf0\x90\x80", "\U0001f642".encode(), b"\r\n\t\b\f"),
]
_TEXT_BITS = [
    *("a", " b", "\u00e9", "\u4e2d", "\U0001f642", '"', "\\"),
    *("\n", "\x00", "\x7f", "\u2028", "\ufffdx", "x\ufffd"),
]


def _hostile_bytes(rng: random.Random) -> bytes:
    r = rng.random()
    if r < 0.5:
        return rng.choice(_TEXT_BITS).encode()
    if r < 0.55:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(6)))
    return b"".join(rng.choice(_BYTE_BITS) for _ in range(rng.randrange(3)))


def test_fuzz_plain_step_against_the_python_path(fuzz_budget: Budget) -> None:
    """The C step (``plain_step``) against the Python token path on a byte table whose first ids are
    hostile bytes: the same writes, state and answers after every batch (special, stop and
    out-of-vocabulary ids, logprobs, two-event batches and chunks of up to 65 ids mixed in, so the
    held-back bytes cross the fallback and back, and holds reach the hand-over to DecodeStream)."""
    from shepherd.node.output.plain_step import BUILT  # not at the top: the unit tests' two paths
    from tests.unit import test_plain_step as ps

    if not BUILT:
        pytest.skip("the C extension is not built")

    @fuzz_settings(ci_examples=25)
    @given(st.integers(0, 1 << 32), st.sampled_from(["qwen3", "llama"]))
    def check(seed: int, name: str) -> None:
        rng = random.Random(seed)
        tok = ps._tokenizer(name)
        vocab = tok.hf.get_vocab_size(with_added_tokens=True)
        s = ps._sampling(rng.random() < 0.7, rng.choice([(), (5,), (7, 9)]))
        reasoning = rng.choice([None, None, "qwen3"])
        pause, comp = rng.choice([0, 0, 2, 3]), rng.random() < 0.3
        py, cc = ps._Run(tok, s, reasoning, pause, comp), ps._Run(tok, s, reasoning, pause, comp)
        base = ps._detok(py.st)._table
        assert base is not None
        table = list(base)
        hostile = 300
        table[:hostile] = [_hostile_bytes(rng) for _ in range(hostile)]
        ps._detok(py.st)._table, ps._detok(cc.st)._table = table, list(table)
        step = None
        cached = 0
        for k in range(rng.randrange(1, 120)):  # bounded
            n = rng.choice([1, 1, 1, 1, 2, 3, 33, 64, 65])
            odd = [vocab, vocab + 5, 5, *tok.eos_token_ids[:1], rng.randrange(vocab)]
            ids = [rng.randrange(hostile) if rng.random() < 0.95 else rng.choice(odd) for _ in range(n)]
            cached = max(0, cached + rng.choice([0, 0, 5, -3]))
            lps = [TokenLogprob(ids[0], -0.5)] if rng.random() < 0.03 else []
            batch: list[Any] = [EngineChunk(0, ids, cached_tokens=cached, logprobs=lps)]
            if rng.random() < 0.03:
                batch.append(EngineChunk(0, [rng.randrange(hostile)]))
            want = py.take_and_write(batch)
            if k == 0:  # the first batch is the Python path's (as in the node: before the push)
                got = cc.take_and_write(batch)
                step = cc.c_step()
            else:
                got = step(batch) if step is not None else cc.take_and_write(batch)
            assert got == want, (k, batch)
            assert cc.state() == py.state(), (k, batch)
            if step is not None and step.paused:
                step.paused = False
            if py.st.finished:
                break
        assert cc.st.end("length") == py.st.end("length")
        assert cc.state() == py.state()

    run_bounded(check, fuzz_budget)


def test_fuzz_h2fast_against_the_frame_loop(fuzz_budget: Budget) -> None:
    """A gRPC response's frames (whole messages, split, several a frame, padded, another stream's,
    compressed), bytes mutated (lengths, types, flags, stream ids, the gRPC prefix), read in pieces of
    any size or one to three frames at a time, listeners that mid-read cancel the other call or their own,
    fail the connection, re-enter ``receive`` or raise: with the C read (``_h2fast.grpc_data``) in
    ``receive``, the messages, statuses, wake-ups, frames written, receive-window counts, failure and
    errors are what the Python frame loop leaves."""
    from shepherd.node.engines import h2_frames as h2  # not at the top: the unit tests' harness
    from tests.unit import test_h2fast as hf
    from tests.unit.test_engine_h2_frames import Server, _mixed_response

    if hf._REAL is None:
        pytest.skip("the C extension is not built")
    kinds = ["whole", "whole", "whole", "whole", "split", "multi", "padded", "other", "compressed"]

    @fuzz_settings(ci_examples=150)
    @given(
        st.integers(0, 1 << 32),
        st.integers(0, 3),
        st.booleans(),
        st.tuples(st.integers(-1, 8), st.sampled_from(hf.ACTS)),
    )
    def check(seed: int, flips: int, aligned: bool, act: tuple[int, str]) -> None:
        rng = random.Random(seed)
        data = _mixed_response(
            Server(),
            1,
            3,
            [rng.choice(kinds) for _ in range(rng.randrange(17))],
            [rng.choice([0, 1, 5, 60, 120]) for _ in range(rng.randint(1, 4))],
        )
        data = mutated(rng, data, flips)
        frames = [bytearray(f) for f in hf._frames(data)]
        for _ in range(rng.randrange(3) if frames else 0):  # bounded: a header byte (length, type, flags, id)
            f = rng.choice(frames)
            at = rng.randrange(min(len(f), 14))  # (the frame header and the gRPC prefix)
            f[at] = rng.choice([0, 1, 8, 0x80, 0xFF, rng.randrange(256)])
        data = b"".join(frames)
        reads = [rng.choice([1, 2, 9, 14, 15, 40, 300]) for _ in range(rng.randint(1, 6))]
        window = rng.choice([h2.LOCAL_WINDOW, 600, 200])
        python, _ = hf._run(data, reads, aligned, window, False, act)
        c, _ = hf._run(data, reads, aligned, window, True, act)
        # (a header block hpack refuses fails the connection with a message naming a memoryview's address)
        assert re.sub(r"0x[0-9a-f]+", "0x", repr(c)) == re.sub(r"0x[0-9a-f]+", "0x", repr(python))

    run_bounded(check, fuzz_budget)


# ---- leaks ----------------------------------------------------------------------------------------------


def _calls() -> list[Callable[[], object]]:
    """Each entry point on plain inputs, odd ones and ones it refuses."""
    rng = random.Random(1)
    chunk = _chunk_response(rng, False)
    table = _pretok.rank_table({b"ab": 1 << 40, b" ": 7})
    m = _prefixcore.KvMap(1, 64)
    out: list[Callable[[], object]] = [
        lambda: _prefixcore.block_hashes(list(range(40)), seed=1 << 70),
        lambda: _prefixcore.block_hashes([1 << 80] * 16),
        lambda: m.put([rng.randint(*INT64) for _ in range(5)], list(range(5))),
        lambda: m.pop([*m.keys()[:3], 1 << 65]),
        lambda: m.seed(1 << 90),
        lambda: _kvwire.kv_scan(mutated(rng, chunk, 2)),
        lambda: _varint.packed_uint32([1, 300, 1 << 31]),
        lambda: _varint.packed_uint32([1, -1]),
        lambda: _varint.lone_chunk(chunk, False),
        lambda: _varint.lone_chunk(mutated(rng, chunk, 1), False),
        lambda: _varint.chunk_fields(chunk, engine_responses._sglang_chunk_head(chunk), 8, 9),
        lambda: _pretok.encode_ascii("ab ab cd 123", table, lambda b: [len(b)], 3),
        lambda: _pretok.split_ascii("it's  12345\n\n x", 1),
        lambda: _pretok.rank_table({b"a": 1, b"\xff": 2}),
    ]
    if NATIVE_INDEX:
        ix = NativePrefixIndex()
        out.append(lambda: m.apply(ix._core, b"\x1a\x03\x1a\x01\x0a", 0, 0, 1.0))
    return out + _step_and_read_calls()


def _step_and_read_calls() -> list[Callable[[], object]]:
    """``_plainstep``'s step on batches it leaves to the fallback, ``_h2fast``'s read (taken, refused)."""
    import asyncio  # not at the top: only these calls' harness

    from shepherd.node.engines import h2_frames as h2
    from shepherd.node.engines.h2_stream import grpc_message
    from shepherd.node.output.plain_step import BUILT
    from tests.unit import test_h2fast as hf
    from tests.unit import test_plain_step as ps

    out: list[Callable[[], object]] = []
    if BUILT:
        tok = ps._tokenizer("qwen3")
        run = ps._Run(tok, ps._sampling(True, ()), None, 0)
        run.take_and_write([EngineChunk(0, tok.hf.encode("Hi", add_special_tokens=False).ids)])
        step = run.hostile_step(ps._detok(run.st), [], None, lambda b: True, 300)
        out += [
            lambda: step([EngineChunk(0, [1], logprobs=[TokenLogprob(1, -1.0)])]),
            lambda: step([EngineChunk(0, [301])]),
            lambda: step([EngineChunk(0, [1]), EngineChunk(0, [2])]),
        ]
    if hf._REAL is not None:
        grpc_data = hf._REAL
        lp = asyncio.new_event_loop()
        h, s = hf.open_grpc_stream(lp)
        s.listener = s.messages.clear
        whole = h2.frame(h2.DATA, 0, s.stream_id, grpc_message(b"m"))
        other = h2.frame(h2.DATA, 0, s.stream_id + 2, grpc_message(b"m"))
        lp.close()
        ping = h2.frame(h2.PING, 0, 0, b"\0" * 8)
        out += [
            lambda: grpc_data(h.conn, whole * 3, 0, 16384),
            lambda: grpc_data(h.conn, other, 0, 16384),
            lambda: grpc_data(h.conn, whole + ping + whole, 0, 16384),
            lambda: grpc_data(h.conn, ping + whole + whole[:4], len(ping), 16384),
        ]
    return out


def _h2fast_errors() -> list[Callable[[], object]]:
    """``_h2fast``'s read ending in an error after runs were taken (a wake-up, a sink or the connection
    raising): every reference it holds is on that path."""
    from tests.unit import test_h2fast as hf  # not at the top: only these calls' harness

    return [call for call, _ in hf.hostile_reads()] if hf._REAL is not None else []


def _raising(f: Callable[[], object]) -> Callable[[], object]:
    def call() -> object:
        try:
            return f()
        except (ValueError, TypeError, OverflowError):
            return None

    return call


@pytest.mark.skipif(
    sys.getallocatedblocks() == 0, reason="no pymalloc (PYTHONMALLOC=malloc): no blocks counted"
)
def test_native_entry_points_do_not_leak() -> None:
    odd: Any = {b"a": "x"}
    refused: list[Callable[[], object]] = [
        lambda: _prefixcore.KvMap(1, 64).put([1 << 64], [1]),  # OverflowError
        lambda: _prefixcore.KvMap(0, 1),  # ValueError
        lambda: _pretok.rank_table(odd),  # TypeError
        lambda: _pretok.encode_ascii("ab", _pretok.rank_table({}), lambda b: [1 // len(b[5:])], 1),
        lambda: _varint.chunk_event_class(int),
        *_h2fast_errors(),
    ]
    for f in [*_calls(), *refused]:
        call = _raising(f) if f not in refused else _swallow(f)
        for _ in range(50):  # bounded: warm-up (caches, free lists)
            call()
        before = sys.getallocatedblocks()
        for _ in range(2000):  # bounded
            call()
        grown = sys.getallocatedblocks() - before
        assert grown < 200, (f, grown)


def _swallow(f: Callable[[], object]) -> Callable[[], object]:
    def call() -> object:
        try:
            return f()
        except Exception:  # any: the error path's references are what is counted
            return None

    return call
