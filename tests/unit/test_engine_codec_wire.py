"""The hand-built GenerateRequest bytes equal protobuf's, for any request; decoding matches the messages."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st
from smg_grpc_proto import sglang_scheduler_pb2 as sg
from smg_grpc_proto import vllm_engine_pb2 as vl

from shepherd.proto.engine_requests import (
    PIECES,
    PieceVarints,
    _c_packed,
    _packed,
    sglang_generate,
    sglang_generate_bytes,
    vllm_generate,
    vllm_generate_bytes,
)
from shepherd.proto.engine_responses import _c_chunk, decode_batch, decode_response, lone_chunk
from shepherd.proto.engine_types import EngineChunk, EngineComplete, GenerateRequest, SamplingParams
from shepherd.proto.prompt_ids import PromptIds
from shepherd.proto.varint import varint

INT32 = st.integers(-(2**31), 2**31 - 1)
IDS = st.lists(st.integers(0, 2**32 - 1), max_size=80)
TEXT = st.text(max_size=12)


@st.composite
def samplings(draw: st.DrawFn) -> SamplingParams:
    constraint = draw(
        st.sampled_from(["", "json_schema", "regex", "ebnf", "structural_tag", "choice", "json_object"])
    )
    return SamplingParams(
        temperature=draw(st.floats(0, 2)),
        top_p=draw(st.floats(0, 1)),
        top_k=draw(st.integers(-1, 100)),
        max_new_tokens=draw(st.none() | st.integers(0, 2**31 - 1)),
        min_new_tokens=draw(st.integers(0, 10)),
        stop_token_ids=tuple(draw(st.lists(st.integers(0, 200_000), max_size=3))),
        ignore_eos=draw(st.booleans()),
        n=draw(st.integers(1, 4)),
        seed=draw(st.none() | st.integers(0, 2**63 - 1)),
        logit_bias=tuple(draw(st.lists(st.tuples(st.integers(0, 1000), st.floats(-100, 100)), max_size=1))),
        stream_interval=draw(st.none() | st.integers(1, 8)),
        json_schema="{}" if constraint == "json_schema" else None,
        regex="a+" if constraint == "regex" else None,
        ebnf="root ::= 'a'" if constraint == "ebnf" else None,
        structural_tag="{}" if constraint == "structural_tag" else None,
        choice=tuple(draw(st.lists(TEXT, min_size=1, max_size=3))) if constraint == "choice" else None,
        json_object=constraint == "json_object",
    )


@st.composite
def requests(draw: st.DrawFn) -> GenerateRequest:
    pd = draw(st.booleans())
    return GenerateRequest(
        request_id=draw(TEXT),
        input_ids=draw(IDS),
        sampling=draw(samplings()),
        stream=draw(st.booleans()),
        logprobs=draw(st.booleans()),
        top_logprobs=draw(st.integers(0, 20) | INT32),
        text=draw(TEXT),
        bootstrap_host=draw(TEXT) if pd else None,
        bootstrap_port=draw(st.none() | st.integers(0, 65535)) if pd else None,
        bootstrap_room=draw(st.none() | INT32) if pd else None,
        kv_transfer_params_json=draw(st.none() | TEXT),
    )


@settings(max_examples=150, deadline=None)
@given(requests())
def test_generate_bytes_equal_the_message(req: GenerateRequest) -> None:
    want_sg = sglang_generate(req)
    got_sg = sglang_generate_bytes(req)
    assert sg.GenerateRequest.FromString(got_sg) == want_sg
    want_vl = vllm_generate(req)
    got_vl = vllm_generate_bytes(req)
    assert vl.GenerateRequest.FromString(got_vl) == want_vl
    if len(req.sampling.logit_bias) <= 1 and req.sampling.seed is None:  # no map order to differ on
        assert got_sg == want_sg.SerializeToString()
        assert got_vl == want_vl.SerializeToString()


@pytest.mark.parametrize(
    "bad",
    [
        {"input_ids": [-1]},
        {"input_ids": [2**32]},
        {"input_ids": [*range(100), -5]},
        {"top_logprobs": 2**31},
        {"bootstrap_host": "h", "bootstrap_room": 2**40},
        {"bootstrap_host": "h", "bootstrap_port": -(2**31) - 1},
    ],
)
def test_values_protobuf_refuses_are_refused_alike(bad: dict[str, object]) -> None:
    req = GenerateRequest(**{"request_id": "r", "input_ids": [1], "sampling": SamplingParams(), **bad})  # type: ignore[arg-type]
    with pytest.raises(ValueError) as want:
        sglang_generate(req)
    with pytest.raises(ValueError) as got:
        sglang_generate_bytes(req)
    assert str(got.value) == str(want.value)


def _prompt(pieces: list[tuple[str, list[int]]]) -> PromptIds:
    ids = [i for _, seg in pieces for i in seg]
    return PromptIds(ids, tuple((t, len(seg)) for t, seg in pieces))


PIECE_IDS = st.lists(st.integers(0, 300_000), max_size=70)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.tuples(st.sampled_from("abcdefg"), PIECE_IDS), max_size=6), max_size=8))
def test_piece_cache_equals_encoding_the_ids(prompts: list[list[tuple[str, list[int]]]]) -> None:
    """Whatever pieces recur (same text, other ids: another tokenizer), the bytes are the ids'."""
    cache = PieceVarints(max_entries=3, max_ids=200, min_ids=4, reuse_min_ids=4, min_prompt_ids=4)
    for _ in range(3):  # kept from the second sighting, reused from the third
        for pieces in prompts:
            p = _prompt(pieces)
            assert cache.packed(p) == _packed(list(p))
    assert len(cache) <= 3 and cache.total_ids <= 200


def test_piece_cache_reuses_a_long_shared_prefix() -> None:
    cache = PieceVarints()
    system = ("system: be brief<|im_end|>", list(range(100_000, 100_300)))
    for turn in range(4):
        p = _prompt(
            [system, (f"user {turn}<|im_end|>", list(range(turn, turn + 60))), ("assistant\n", [7, 8])]
        )
        assert cache.packed(p) == _packed(list(p))
    assert cache.hits == 2  # stored at the second request, reused by the third and the fourth
    other = _prompt([(system[0], list(range(5, 305)))])  # the same text, another tokenizer's ids
    assert cache.packed(other) == _packed(list(other))
    # a shape that does not describe its ids is ignored
    wrong = PromptIds(list(range(400)), ((system[0], 300), ("x", 50)))
    assert cache.packed(wrong) == _packed(list(wrong))
    # a short prompt is encoded whole: its pieces are not even looked at
    stored = cache.stored
    short = _prompt([("short system<|im_end|>", list(range(100)))])
    for _ in range(3):
        assert cache.packed(short) == _packed(list(short))
    assert cache.stored == stored and "short system<|im_end|>" not in cache._d


def test_short_runs_and_plain_lists() -> None:
    for ids in ([], [0], [127, 128, 16383, 16384, 2**21, 2**32 - 1], list(range(0, 300_000, 997))):
        assert PIECES.packed(ids) == _packed(ids)
        assert (
            sg.TokenizedInput.FromString(b"\x12" + varint(len(_packed(ids))) + _packed(ids)).input_ids == ids
            or not ids
        )


CHUNKS = st.builds(
    lambda ids, i, p, c, k: sg.GenerateResponse(
        request_id="r",
        chunk=sg.GenerateStreamChunk(
            token_ids=ids, index=i, prompt_tokens=p, completion_tokens=c, cached_tokens=k
        ),
    ),
    st.lists(st.integers(0, 2**20), max_size=5),
    st.integers(0, 3),
    st.integers(0, 999),
    st.integers(0, 999),
    st.integers(0, 999),
)
COMPLETES = st.builds(
    lambda ids, i, reason, stop: sg.GenerateResponse(
        complete=sg.GenerateComplete(
            output_ids=ids,
            index=i,
            finish_reason=reason,
            prompt_tokens=3,
            completion_tokens=len(ids),
            **(
                {}
                if stop is None
                else {"matched_token_id": stop}
                if isinstance(stop, int)
                else {"matched_stop_str": stop}
            ),
        )
    ),
    st.lists(st.integers(0, 2**20), max_size=5),
    st.integers(0, 3),
    st.sampled_from(["", "stop", "length", "abort"]),
    st.none() | st.integers(0, 9) | st.text(max_size=3),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(CHUNKS | COMPLETES, min_size=1, max_size=6))
def test_decode_batch_agrees_with_decoding_one_by_one(msgs: list[sg.GenerateResponse]) -> None:
    raws = [m.SerializeToString() for m in msgs]
    batch = decode_batch(raws, sg.GenerateResponse.FromString)
    single = [decode_response(m) for m in msgs]
    # merging consecutive chunks of one choice keeps every token in order and the latest counts
    tokens = [(e.index, t) for e in single if isinstance(e, EngineChunk) for t in e.token_ids]
    assert [(e.index, t) for e in batch if isinstance(e, EngineChunk) for t in e.token_ids] == tokens
    assert [e for e in batch if isinstance(e, EngineComplete)] == [
        e for e in single if isinstance(e, EngineComplete)
    ]
    if len(msgs) == 1:
        one = single[0]
        assert one is not None and len(batch) == 1
        got = batch[0]
        assert (
            type(got),
            got.index,
            list(got.token_ids if isinstance(got, EngineChunk) else got.output_ids),
        ) == (
            type(one),
            one.index,
            list(one.token_ids if isinstance(one, EngineChunk) else one.output_ids),
        )


def test_decode_vllm_complete_keeps_kv_params() -> None:
    done = vl.GenerateResponse(
        complete=vl.GenerateComplete(finish_reason="stop", kv_transfer_params_json="{}")
    )
    ev = decode_batch([done.SerializeToString()], vl.GenerateResponse.FromString)[0]
    assert isinstance(ev, EngineComplete) and ev.kv_transfer_params_json == "{}"
    plain = vl.GenerateResponse(complete=vl.GenerateComplete(finish_reason="stop"))
    ev2 = decode_response(plain)
    assert isinstance(ev2, EngineComplete) and ev2.kv_transfer_params_json is None
    sg_done = decode_response(sg.GenerateResponse(complete=sg.GenerateComplete()))
    assert (
        isinstance(sg_done, EngineComplete)
        and sg_done.finish_reason == "stop"
        and sg_done.kv_transfer_params_json is None
    )


@st.composite
def _one_choice_stream(draw: st.DrawFn) -> tuple[str, list[bytes]]:
    """A single-choice response stream as an engine sends it: chunks with cumulative counts (logprobs
    on every chunk or none), completes anywhere, request ids short, long (> 127 bytes) or absent."""
    kind = draw(st.sampled_from(["sglang", "vllm"]))
    pb = sg if kind == "sglang" else vl
    rid = draw(st.sampled_from(["", "r-1", "x" * 130]))
    with_lp = draw(st.booleans())
    prompt = draw(st.integers(1, 5000))
    done = 0
    cached = 0
    raws: list[bytes] = []
    for _ in range(draw(st.integers(1, 12))):
        if draw(st.integers(0, 5)) == 0:
            msg = pb.GenerateResponse(
                complete=pb.GenerateComplete(finish_reason="stop", prompt_tokens=prompt)
            )
        else:
            ids = draw(st.lists(st.integers(0, 300_000), min_size=1, max_size=3))
            done += len(ids)
            cached = max(cached, draw(st.integers(0, prompt)))
            chunk = pb.GenerateStreamChunk(
                token_ids=ids, prompt_tokens=prompt, completion_tokens=done, cached_tokens=cached
            )
            if with_lp:
                chunk.output_logprobs.token_ids.extend(ids)
                chunk.output_logprobs.token_logprobs.extend(-0.5 * (k + 1) for k in range(len(ids)))
                for t in ids:
                    top = chunk.output_logprobs.top_logprobs.add()
                    top.token_ids.extend([t, t + 1])
                    top.values.extend([-0.1, -2.0])
            msg = pb.GenerateResponse(chunk=chunk)
        raw = msg.SerializeToString()
        if kind == "sglang" and rid:
            head = sg.GenerateResponse(request_id=rid).SerializeToString()
            # the request id after the response (valid protobuf, another field order): parsed alone
            raw = raw + head if draw(st.integers(0, 9)) == 0 else head + raw
        raws.append(raw)
    return kind, raws


@settings(max_examples=300, deadline=None)
@given(_one_choice_stream())
def test_single_choice_batches_parse_as_one(stream: tuple[str, list[bytes]]) -> None:
    kind, raws = stream
    parse = (sg if kind == "sglang" else vl).GenerateResponse.FromString
    assert decode_batch(raws, parse, single=kind) == decode_batch(raws, parse)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**64 - 1))
def test_varint_is_protobufs(n: int) -> None:
    assert sg.GenerateStreamChunk.FromString(b"\x10" + varint(n)).prompt_tokens == n & 0xFFFFFFFF


def _protobuf_packed(ids: list[int]) -> bytes:
    enc: bytes = sg.TokenizedInput(input_ids=ids).SerializeToString()
    if not enc:  # an empty repeated field is not written
        return b""
    i = 1  # after the tag: skip the length varint
    while enc[i] & 0x80:
        i += 1
    return enc[i + 1 :]


UINT32_IDS = st.lists(
    st.one_of(
        st.integers(0, 2**32 - 1), st.sampled_from([0, 127, 128, 16383, 16384, 2**30 - 1, 2**30, 2**32 - 1])
    ),
    max_size=300,
)


@settings(max_examples=300, deadline=None)
@given(UINT32_IDS, st.booleans())
def test_packed_ids_are_protobufs_bytes(ids: list[int], as_tuple: bool) -> None:
    assert _packed(tuple(ids) if as_tuple else ids) == _protobuf_packed(ids)
    assert _packed(PromptIds(ids)) == _protobuf_packed(ids)


@pytest.mark.skipif(_c_packed is None, reason="_varint not built")
@pytest.mark.parametrize("bad", [-1, 2**32, 2**64, True, 1.0, "1", None])
def test_the_c_packer_leaves_what_protobuf_refuses_to_protobuf(bad: object) -> None:
    assert _c_packed is not None
    ids = [*range(20), bad]
    assert _c_packed(ids) is None
    assert _c_packed(range(3)) is None  # not a list or tuple
    with pytest.raises((ValueError, TypeError)):
        _packed(ids)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return varint(number << 3 | wire) + payload


# pieces of a GenerateStreamChunk body as an engine (or any protobuf writer) may put them: packed or
# unpacked ids, counts (repeated: the last wins), an index, SGLang's reasoning_tokens, over-long or
# 64-bit varints (protobuf truncates a uint32), logprobs and hidden states (protobuf's path only), and
# fields no version knows
_CHUNK_PIECES = st.one_of(
    st.builds(lambda ids: _field(1, 2, varint(len(b := b"".join(varint(i) for i in ids))) + b), IDS),
    st.builds(lambda i: _field(1, 0, varint(i)), st.integers(0, 2**32 - 1)),
    st.builds(
        lambda f, v: _field(f, 0, varint(v)),
        st.sampled_from([2, 3, 4, 7, 8, 9]),
        st.integers(0, 2**32 - 1) | st.integers(2**32, 2**64 - 1),
    ),
    st.builds(lambda f: _field(f, 0, b"\x81\x80\x80\x80\x80\x00"), st.sampled_from([2, 3])),  # padded
    st.builds(lambda v: _field(5, 2, varint(len(v)) + v), st.sampled_from([b"", b"\x0a\x01\x05"])),
    st.builds(lambda v: _field(6, 2, varint(len(v)) + v), st.sampled_from([b"", b"ab"])),
    st.builds(lambda f: _field(f, 0, b"\x01"), st.integers(10, 40)),
    st.just(_field(3, 5, b"\x01\x00\x00\x00")),
)


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(["sglang", "vllm"]),
    st.lists(_CHUNK_PIECES, max_size=8),
    st.sampled_from(["", "r-1", "x" * 130]),
)
def test_a_lone_chunk_decodes_as_protobuf_decodes_it(kind: str, pieces: list[bytes], rid: str) -> None:
    """One chunk arriving alone (a paced engine's token): the C reader's event (or protobuf's, for a
    chunk it leaves alone) equals protobuf's parse of the message, whatever the encoding."""
    pb = sg if kind == "sglang" else vl
    body = b"".join(pieces)
    chunk_tag = b"\x12" if kind == "sglang" else b"\x0a"
    head = sg.GenerateResponse(request_id=rid).SerializeToString() if kind == "sglang" else b""
    raw = head + chunk_tag + varint(len(body)) + body
    parse = pb.GenerateResponse.FromString
    try:
        expected = decode_response(parse(raw))
    except DecodeError:  # protobuf refuses it (e.g. a wrong wire type): so does the C reader
        with pytest.raises(DecodeError):
            decode_batch([raw], parse, single=kind)
        return
    assert decode_batch([raw], parse, single=kind) == [expected]
    # the push path's reader (the whole message, the event made in C): protobuf's event, or None
    if lone_chunk is not None:
        lone = lone_chunk(raw, kind == "vllm")
        assert lone is None or lone == expected
    # the request id after the chunk (valid protobuf, another field order): protobuf's path
    if rid and kind == "sglang":
        assert decode_batch([raw + head], parse, single=kind) == [decode_response(parse(raw + head))]
        if lone_chunk is not None:
            assert lone_chunk(raw + head, False) is None


@pytest.mark.skipif(lone_chunk is None, reason="_varint not built")
def test_field_number_zero_is_refused_as_protobuf_refuses_it() -> None:
    """A tag of field 0 inside the chunk (vLLM skips field 0 elsewhere): protobuf refuses the message,
    so the C readers leave it to protobuf's parse, which raises, instead of reading past it."""
    raw = b"\x0a\x04\x08\x05\x00\x00"
    with pytest.raises(DecodeError):
        vl.GenerateResponse.FromString(raw)
    assert lone_chunk is not None and lone_chunk(raw, True) is None
    with pytest.raises(DecodeError):
        decode_batch([raw], vl.GenerateResponse.FromString, single="vllm")


@pytest.mark.skipif(lone_chunk is None, reason="_varint not built")
@settings(max_examples=200, deadline=None)
@given(IDS, st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.sampled_from(["", "r", "x" * 130]))
def test_the_lone_chunk_reader_reads_a_plain_chunk(ids: list[int], prompt: int, done: int, rid: str) -> None:
    """A plain chunk (ids and counts, as a paced engine sends one token) is read in C, both engines."""
    assert lone_chunk is not None
    for kind, pb in (("sglang", sg), ("vllm", vl)):
        if kind == "sglang":
            chunk = sg.GenerateStreamChunk(token_ids=ids, prompt_tokens=prompt, completion_tokens=done)
            raw = sg.GenerateResponse(request_id=rid, chunk=chunk).SerializeToString()
        else:
            chunk = vl.GenerateStreamChunk(token_ids=ids, prompt_tokens=prompt, completion_tokens=done)
            raw = vl.GenerateResponse(chunk=chunk).SerializeToString()
        lone = lone_chunk(raw, kind == "vllm")
        assert lone is not None
        assert lone == decode_response(pb.GenerateResponse.FromString(raw))
        assert [lone] == decode_batch([raw], pb.GenerateResponse.FromString, single=kind)
        assert type(lone) is EngineChunk and lone.logprobs == []
        assert isinstance(lone.token_ids, list)
        lone.token_ids.append(1)  # its own list
        assert lone_chunk(raw, kind == "vllm") != lone


@pytest.mark.skipif(lone_chunk is None, reason="_varint not built")
@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=40), st.booleans())
def test_the_lone_chunk_reader_on_any_bytes(raw: bytes, vllm: bool) -> None:
    """Any bytes: the C reader's event is what decode_batch makes of the message, or it hands it on."""
    assert lone_chunk is not None
    lone = lone_chunk(raw, vllm)
    if lone is None:
        return
    kind = "vllm" if vllm else "sglang"
    parse = (vl if vllm else sg).GenerateResponse.FromString
    assert decode_batch([raw], parse, single=kind) == [lone]


@pytest.mark.skipif(_c_chunk is None, reason="_varint not built")
def test_the_c_chunk_reader_reads_plain_chunks_only() -> None:
    assert _c_chunk is not None
    plain = sg.GenerateStreamChunk(token_ids=[7, 300, 2**32 - 1], prompt_tokens=2000, completion_tokens=3)
    raw = sg.GenerateResponse(request_id="r", chunk=plain).SerializeToString()
    assert _c_chunk(raw, 4, 8, 9) == (0, [7, 300, 2**32 - 1], 2000, 3, 0)
    with_lp = sg.GenerateStreamChunk(token_ids=[7], output_logprobs=sg.OutputLogProbs(token_ids=[7]))
    raw_lp = sg.GenerateResponse(request_id="r", chunk=with_lp).SerializeToString()
    assert _c_chunk(raw_lp, 4, 8, 9) is None  # logprobs: protobuf's path
    assert _c_chunk(raw[:-1], 4, 8, 9) is None  # truncated
    assert _c_chunk(raw + b"\x0a\x00", 4, 8, 9) is None  # bytes after the chunk


_PLAIN_CHUNK = sg.GenerateStreamChunk(
    token_ids=[7, 300], prompt_tokens=20, completion_tokens=2
).SerializeToString()


def _with_request_id(rid: bytes) -> bytes:
    """An SGLang chunk response whose request_id field holds ``rid`` as it is (UTF-8 or not)."""
    return _field(1, 2, varint(len(rid)) + rid) + _field(2, 2, varint(len(_PLAIN_CHUNK)) + _PLAIN_CHUNK)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=140),
        st.text(max_size=70).map(str.encode),
        st.sampled_from(
            [b"\xff", b"\xed\xa0\x80", b"\xc0\x80", b"\xf4\x90\x80\x80", b"ok\xe2\x82", b"x" * 130 + b"\xff"]
        ),
    )
)
def test_a_request_id_that_is_not_utf8_is_refused_as_protobuf_refuses_it(rid: bytes) -> None:
    """request_id is a string field: protobuf refuses a message whose bytes there are not UTF-8 (overlong
    forms, surrogates, code points past U+10FFFF, cut sequences included). The C readers read the chunk
    after it, so they refused nothing: now they leave such a message to protobuf's parse, which raises,
    and read the others as protobuf does."""
    raw = _with_request_id(rid)
    parse = sg.GenerateResponse.FromString
    try:
        expected = decode_response(parse(raw))
    except DecodeError:
        if lone_chunk is not None:
            assert lone_chunk(raw, False) is None
        for raws in ([raw], [raw, raw], [_with_request_id(b"r"), raw]):
            with pytest.raises(DecodeError):
                decode_batch(raws, parse, single="sglang")
        return
    assert rid.decode() is not None
    assert decode_batch([raw], parse, single="sglang") == [expected]
    if lone_chunk is not None:
        assert lone_chunk(raw, False) == expected


@pytest.mark.skipif(lone_chunk is None, reason="_varint not built")
def test_the_chunk_event_class_must_own_its_slots() -> None:
    """``lone_chunk`` writes the event's fields at the slots' offsets: a class whose field names are
    another (larger) class's member descriptors is refused, its own slots' offsets could not hold them."""
    from shepherd.proto import _varint

    fields = ("index", "token_ids", "prompt_tokens", "completion_tokens", "cached_tokens", "logprobs")
    big = type("Big", (), {"__slots__": tuple(f"pad{i}" for i in range(40)) + fields})
    impostor = type("Impostor", (), {"__slots__": ("a",), **{f: big.__dict__[f] for f in fields}})
    try:
        with pytest.raises(TypeError, match="not a plain object slot"):
            _varint.chunk_event_class(impostor)
    finally:
        _varint.chunk_event_class(EngineChunk)  # (the module's class either way)
    raw = sg.GenerateResponse(request_id="r", chunk=sg.GenerateStreamChunk(token_ids=[5])).SerializeToString()
    assert lone_chunk is not None and type(lone_chunk(raw, False)) is EngineChunk
