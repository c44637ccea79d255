"""Engine requests: our ``GenerateRequest`` -> the SGLang scheduler and vLLM engine messages (smg-grpc-proto).

Every sampling field is set explicitly: proto3 zero defaults are not the semantic defaults.
Both the grpcio client and any other transport share this module, so the wire mapping exists once.

``sglang_generate_bytes`` / ``vllm_generate_bytes`` serialize a GenerateRequest straight to the bytes
``sglang_generate(req).SerializeToString()`` gives (fields in number order, as protobuf writes them;
only the order of map entries in the sampling parameters may differ), without building the message:
the sampling parameters are serialized once per distinct value (cached), the token ids by protobuf's
own encoder (``TokenizedInput``; the long prompt pieces that recur, once: ``PieceVarints``), the rest
by hand (protobuf's wire format for a handful of scalars). Property-tested against the message builders.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from google.protobuf import json_format
from smg_grpc_proto import sglang_scheduler_pb2 as sg
from smg_grpc_proto import vllm_engine_pb2 as vl

from shepherd.proto.engine_types import GenerateRequest, SamplingParams
from shepherd.proto.varint import SMALL, SMALL_LIMIT
from shepherd.proto.varint import varint as _varint

SGLANG_SERVICE = "sglang.grpc.scheduler.SglangScheduler"
VLLM_SERVICE = "vllm.grpc.engine.VllmEngine"


_EBNF_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _ebnf_literal(s: str) -> str:
    out = []
    for ch in s:
        esc = _EBNF_ESCAPES.get(ch)
        if esc is None and ord(ch) < 0x20:
            esc = f"\\x{ord(ch):02x}"
        out.append(esc or ch)
    return '"' + "".join(out) + '"'


def choice_grammar(choices: list[str] | tuple[str, ...]) -> str:
    """The EBNF grammar of "exactly one of ``choices``", as vLLM builds it (``choice_as_grammar`` in
    vllm/v1/structured_output/utils.py: ``"``, ``\\``, line breaks, tabs and other controls escaped)."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


# A request's own constraint (a JSON schema, regex, grammar, choice list) or logit_bias can be large: kept by
# the per-parameters caches below (4,096 entries each), a client varying only its seed would pin whatever
# each request sent (hundreds of MB). Parameters carrying more than this are built each time, not cached.
CACHED_PAYLOAD_MAX = 4096  # characters of constraint and stop text, plus 16 a logit_bias entry or stop id


def _small(p: SamplingParams) -> bool:
    n = 16 * (len(p.logit_bias) + len(p.stop_string_ids)) + sum(len(s) for s in p.stop_strings)
    for s in (p.json_schema, p.regex, p.ebnf, p.structural_tag):
        if s:
            n += len(s)
    if p.choice:
        n += sum(len(c) for c in p.choice)
    return n <= CACHED_PAYLOAD_MAX


def sglang_sampling(p: SamplingParams) -> sg.SamplingParams:
    """Cached per distinct parameters when small (``_small``); callers copy it into their request."""
    return _sglang_sampling_cached(p) if _small(p) else _sglang_sampling(p)


_UINT32_MAX = (1 << 32) - 1


def _uint32(v: int) -> int:
    """A count clamped to a uint32 field's range (max_new_tokens: a bound past it is no bound)."""
    return 0 if v < 0 else _UINT32_MAX if v > _UINT32_MAX else v


def _stop_ids(p: SamplingParams) -> tuple[int, ...]:
    """SGLang's stop_token_ids: the request's, then its single-token stop strings' (not repeated)."""
    if not p.stop_string_ids:
        return p.stop_token_ids
    return tuple(dict.fromkeys((*p.stop_token_ids, *p.stop_string_ids)))


def _sglang_sampling(p: SamplingParams) -> sg.SamplingParams:
    sp = sg.SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        repetition_penalty=p.repetition_penalty,
        # stop strings stay the gateway's (SGLang's servicer needs its tokenizer for them, and our matcher
        # is the judge); those that are one token reach the engine as that token, so it stops there
        stop_token_ids=_stop_ids(p),
        skip_special_tokens=p.skip_special_tokens,
        spaces_between_special_tokens=p.spaces_between_special_tokens,
        n=p.n,
        min_new_tokens=p.min_new_tokens,
        ignore_eos=p.ignore_eos,
        # the gateway trims stop strings itself; the engine sees only token ids
        no_stop_trim=True,
    )
    if p.max_new_tokens is not None:  # unset: SGLang's own bound (the context left)
        sp.max_new_tokens = _uint32(p.max_new_tokens)
    if p.stream_interval is not None:
        sp.stream_interval = p.stream_interval
    for tok, bias in p.logit_bias:
        sp.logit_bias[str(tok)] = bias
    if p.json_schema is not None:
        sp.json_schema = p.json_schema
    elif p.regex is not None:
        sp.regex = p.regex
    elif p.ebnf is not None:
        sp.ebnf_grammar = p.ebnf
    elif p.structural_tag is not None:
        sp.structural_tag = p.structural_tag
    elif p.choice is not None:  # SGLang has no choice constraint: the grammar vLLM builds for one
        sp.ebnf_grammar = choice_grammar(p.choice)
    elif p.json_object:
        sp.json_schema = '{"type":"object"}'
    # no seed: SGLang's SamplingParams takes it as ``sampling_seed``, which neither servicer (SMG's nor
    # SGLang's in-tree one) fills from the gRPC request (the proto has no seed field); ``custom_params``
    # only reach custom logit processors, where a "seed" key would be a foreign input, not a seed
    return sp


_sglang_sampling_cached = functools.lru_cache(maxsize=4096)(_sglang_sampling)


def _sglang_logprob_fields(req: GenerateRequest) -> tuple[bool, int, int]:
    """SGLang's (return_logprob, logprob_start_len, top_logprobs_num): the prompt's logprobs are asked by
    starting at position 0 (-1: none of the prompt's); one alternatives count serves both, the larger
    (each answer keeps its own)."""
    plp = req.prompt_logprobs
    if plp is None:
        return req.logprobs, -1, req.top_logprobs
    return True, 0, max(plp, req.top_logprobs if req.logprobs else 0)


def sglang_generate(req: GenerateRequest) -> sg.GenerateRequest:
    want, start, top = _sglang_logprob_fields(req)
    msg = sg.GenerateRequest(
        request_id=req.request_id,
        tokenized=sg.TokenizedInput(original_text=req.text, input_ids=req.input_ids),
        sampling_params=sglang_sampling(req.sampling),
        return_logprob=want,
        logprob_start_len=start,
        top_logprobs_num=top,
        stream=req.stream,
        require_reasoning=req.require_reasoning,
    )
    if req.bootstrap_host is not None:
        msg.disaggregated_params.bootstrap_host = req.bootstrap_host
        msg.disaggregated_params.bootstrap_port = req.bootstrap_port or 0
        msg.disaggregated_params.bootstrap_room = req.bootstrap_room or 0
    return msg


def vllm_sampling(
    p: SamplingParams, logprobs: bool, top_logprobs: int, prompt_logprobs: int | None = None
) -> vl.SamplingParams:
    """Cached per distinct parameters when small (``_small``); callers copy it into their request.
    ``prompt_logprobs``: vLLM's (the prompt's logprobs with that many alternatives), None: not asked."""
    return (_vllm_sampling_cached if _small(p) else _vllm_sampling)(
        p, logprobs, top_logprobs, prompt_logprobs
    )


def _vllm_sampling(
    p: SamplingParams, logprobs: bool, top_logprobs: int, prompt_logprobs: int | None = None
) -> vl.SamplingParams:
    sp = vl.SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=max(p.top_k, 0),  # vLLM: 0 means all tokens
        min_p=p.min_p,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        repetition_penalty=p.repetition_penalty,
        min_tokens=p.min_new_tokens,
        # the stop strings: vLLM stops generating at them; the output keeps them (below) for the
        # gateway's stop matcher, which decides what the client sees
        stop=p.stop_strings,
        stop_token_ids=p.stop_token_ids,
        skip_special_tokens=p.skip_special_tokens,
        spaces_between_special_tokens=p.spaces_between_special_tokens,
        ignore_eos=p.ignore_eos,
        n=p.n,
        include_stop_str_in_output=True,
    )
    if p.max_new_tokens is not None:  # unset: vLLM's own bound (max_model_len less the prompt)
        sp.max_tokens = _uint32(p.max_new_tokens)
    if p.seed is not None:  # vLLM's seed field is int32: a 64-bit seed is folded in (SMG's cast saturates)
        sp.seed = fold_seed(p.seed)
    if logprobs:
        sp.logprobs = top_logprobs
    if prompt_logprobs is not None:
        # vLLM's servicer lists a position's prompt token first, then the best others, cut at the number
        # asked: one more brings the k best others vLLM's own server shows (its max_logprobs, 20, bounds it)
        sp.prompt_logprobs = min(prompt_logprobs + 1, VLLM_MAX_LOGPROBS)
    for tok, bias in p.logit_bias:
        sp.logit_bias[tok] = bias
    if p.json_schema is not None:
        sp.json_schema = p.json_schema
    elif p.regex is not None:
        sp.regex = p.regex
    elif p.ebnf is not None:
        sp.grammar = p.ebnf
    elif p.structural_tag is not None:
        sp.structural_tag = p.structural_tag
    elif p.choice is not None:
        sp.choice.choices.extend(p.choice)
    elif p.json_object:
        sp.json_object = True
    return sp


_vllm_sampling_cached = functools.lru_cache(maxsize=4096)(_vllm_sampling)

_V = SMALL  # the varints of lengths below 16 KiB (one or two bytes)
_VN = SMALL_LIMIT
_INT32_MIN = -(1 << 31)
VLLM_MAX_LOGPROBS = 20  # vLLM's default max_logprobs: what its engine accepts for (prompt) logprobs
_INT32_MAX = (1 << 31) - 1


_MASK64 = (1 << 64) - 1


def fold_seed(v: int) -> int:
    """A seed for an int32 field (vLLM's, MLX's): one in int32's range as it is; any other (vLLM's own
    server takes any int64) mixed into it (splitmix64's finalizer), so that distinct seeds give distinct
    samples as they do on vLLM's server (saturating, as SMG does, or truncating sends 2**40, 2**41 and
    2**62 alike)."""
    if _INT32_MIN <= v <= _INT32_MAX:
        return v
    x = v & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x = (x ^ (x >> 31)) & 0xFFFFFFFF
    return x - (1 << 32) if x > _INT32_MAX else x


def _int32(v: object) -> bytes | None:
    """An int32 field value as protobuf writes it (negative: 10 bytes), or None if protobuf would refuse
    it (out of range, not an int): the caller then takes the message path, which raises as it always did."""
    if type(v) is not int or not _INT32_MIN <= v <= _INT32_MAX:
        return None
    return _varint(v if v >= 0 else v + (1 << 64))


def _ld(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field."""
    return tag + _varint(len(payload)) + payload


def _sglang_field(p: SamplingParams) -> bytes:
    """Field 4 (sampling_params) of an SGLang GenerateRequest."""
    sp: bytes = sglang_sampling(p).SerializeToString()
    return _ld(b"\x22", sp)


def _vllm_field(
    p: SamplingParams, logprobs: bool, top_logprobs: int, prompt_logprobs: int | None = None
) -> bytes:
    """Field 4 (sampling_params) of a vLLM GenerateRequest."""
    sp: bytes = vllm_sampling(p, logprobs, top_logprobs, prompt_logprobs).SerializeToString()
    return _ld(b"\x22", sp)


_sglang_field_cached = functools.lru_cache(maxsize=4096)(_sglang_field)
_vllm_field_cached = functools.lru_cache(maxsize=4096)(_vllm_field)


def _sglang_sampling_field(p: SamplingParams) -> bytes:
    """Serialized once per distinct value when small (``_small``)."""
    return _sglang_field_cached(p) if _small(p) else _sglang_field(p)


def _vllm_sampling_field(
    p: SamplingParams, logprobs: bool, top_logprobs: int, prompt_logprobs: int | None = None
) -> bytes:
    """Serialized once per distinct value when small (``_small``)."""
    return (_vllm_field_cached if _small(p) else _vllm_field)(p, logprobs, top_logprobs, prompt_logprobs)


_TOKENIZED = sg.TokenizedInput  # vLLM's has the same fields and numbers

_c_packed: Callable[[Sequence[int]], bytes | None] | None = None  # None: protobuf's encoder
try:  # packed varints in C (setup.py builds it where a compiler is)
    from shepherd.proto._varint import packed_uint32

    _c_packed = packed_uint32
except ImportError:  # pragma: no cover - an install without a C compiler
    pass


def _packed(ids: Sequence[int]) -> bytes:
    """The packed varints of ``ids`` (field 2 of TokenizedInput without its tag and length): in C where
    built (``_varint.c``, for lists of plain uint32 ints), else by protobuf's own encoder, which also
    refuses what it always refused (negative, > uint32, not an int)."""
    if _c_packed is not None:
        fast = _c_packed(ids)
        if fast is not None:
            return fast
    if len(ids) <= 8:  # a few ids: by hand (a protobuf call costs ~1.5 µs in itself)
        out = bytearray()
        for v in ids:
            if type(v) is not int or not 0 <= v <= 0xFFFFFFFF:
                break  # protobuf's refusal, below
            while v >= 0x80:
                out.append((v & 0x7F) | 0x80)
                v >>= 7
            out.append(v)
        else:
            return bytes(out)
    enc: bytes = _TOKENIZED(input_ids=ids).SerializeToString()
    i = 1  # after the tag: skip the length varint
    while enc[i] & 0x80:
        i += 1
    return enc[i + 1 :]


class PieceVarints:
    """Packed varints of long prompt pieces that recur, by piece text.

    A prompt's ids that come from the tokenizer's caches carry the pieces they were encoded from
    (``PromptIds.shape``: the L1 segments, cut after each special token: a system prompt, the earlier
    turns of a conversation, tool definitions). Such a piece recurs in request after request, and its
    ids with it; their wire form is kept here so that only what is new is encoded (protobuf's encoder
    costs ~40 ns per id). A piece is kept from its second sighting on (the last user turn, new in every
    request, costs a set lookup), first in, first out within bounds of entries and ids held. A prompt
    is assembled from kept pieces when they hold enough of its ids (below that, slicing the prompt
    costs more than it saves); a short prompt is not looked at (looking costs ~1.5 µs, more than
    what it could save there). A hit is checked against the ids themselves (the same text under
    another model's tokenizer has other ids): the bytes are used only when the ids are equal."""

    def __init__(
        self,
        max_entries: int = 4096,
        max_ids: int = 1 << 19,
        min_ids: int = 48,
        reuse_min_ids: int = 128,
        min_prompt_ids: int = 256,
    ) -> None:
        self._d: OrderedDict[str, tuple[Sequence[int], bytes]] = OrderedDict()
        self._seen: set[int] = set()  # hashes of long pieces seen once
        self._runs: dict[tuple[int, ...], bytes] = {}
        self.max_entries = max_entries
        self.max_ids = max_ids
        self.min_ids = min_ids  # shorter pieces are encoded with their neighbours, in one call
        self.reuse_min_ids = reuse_min_ids  # fewer kept ids in a prompt: it is encoded whole, in one call
        self.min_prompt_ids = min_prompt_ids  # shorter prompts are encoded whole, their pieces not looked at
        self.total_ids = 0
        self.hits = 0
        self.stored = 0

    def __len__(self) -> int:
        return len(self._d)

    def packed(self, ids: Sequence[int]) -> bytes:
        """``_packed(ids)``, reusing the bytes of its long pieces when ``ids`` carries a shape."""
        shape = getattr(ids, "shape", None)
        if not shape or len(ids) < self.min_prompt_ids:
            return _packed(ids)
        min_ids = self.min_ids
        d = self._d
        seen = self._seen
        hits: list[tuple[int, int, str, tuple[Sequence[int], bytes]]] = []
        kept = 0  # ids in hits
        pos = 0
        for text, n in shape:
            if n >= min_ids:
                hit = d.get(text)
                if hit is not None:
                    hits.append((pos, n, text, hit))
                    kept += n
                else:
                    h = hash(text)  # computed once per string (the tokenizer's cache lookup did already)
                    if h in seen:  # its second sighting: keep it from now on
                        self._store(text, ids[pos : pos + n])
                    else:
                        if len(seen) >= 4 * self.max_entries:
                            seen.clear()
                        seen.add(h)
            pos += n
        # reusing costs a slice of every id (the gaps go to protobuf as slices): worth it for many ids
        if kept < self.reuse_min_ids or pos != len(ids):
            return _packed(ids)
        parts: list[bytes] = []
        run = 0  # ids[run:pos] are not yet encoded
        for pos, n, text, hit in hits:
            seg = ids[pos : pos + n]
            if hit[0] == seg:
                enc = hit[1]
                self.hits += 1
            else:  # another tokenizer's ids for this text: keep the latest
                enc = self._store(text, seg)
            if run < pos:
                parts.append(self._run(ids[run:pos]))
            parts.append(enc)
            run = pos + n
        if run < len(ids):
            parts.append(self._run(ids[run:]))
        return b"".join(parts)

    def _store(self, text: str, seg: Sequence[int]) -> bytes:
        d = self._d
        old = d.pop(text, None)
        if old is not None:
            self.total_ids -= len(old[0])
        enc = _packed(seg)
        d[text] = (seg, enc)
        self.total_ids += len(seg)
        self.stored += 1
        while len(d) > self.max_entries or self.total_ids > self.max_ids:  # bounded: each turn drops one
            _, (dropped, _enc) = d.popitem(last=False)
            self.total_ids -= len(dropped)
        return enc

    def _run(self, seg: Sequence[int]) -> bytes:
        """Ids between kept pieces: mostly a chat template's few ids around a role (the same handful of
        sequences in every request), kept by value when short."""
        if len(seg) > 16:
            return _packed(seg)
        key = tuple(seg)
        enc = self._runs.get(key)
        if enc is None:
            enc = _packed(seg)
            if len(self._runs) >= self.max_entries:
                self._runs.clear()
            self._runs[key] = enc
        return enc


PIECES = PieceVarints()


def _tokenized(text: str, ids: Sequence[int]) -> list[bytes]:
    """Field 2 of either engine's GenerateRequest, a TokenizedInput: original_text (1), input_ids (2,
    packed); as parts to join."""
    packed = PIECES.packed(ids)
    n = len(packed)
    if not text:  # the usual request: ids only
        if not n:
            return [b"\x12\x00"]
        head = _V[n] if n < _VN else _varint(n)
        size = 1 + len(head) + n
        return [b"\x12", _V[size] if size < _VN else _varint(size), b"\x12", head, packed]
    sub = _ld(b"\x0a", text.encode()) + (_ld(b"\x12", packed) if packed else b"")
    return [b"\x12", _varint(len(sub)), sub]


_LOGPROB_START = b"\x30" + _varint(-1 + (1 << 64))  # logprob_start_len = -1 (field 6)
_SG_STREAM = b"\x88\x01\x01"  # stream = true (field 17)
_SG_REQUIRE_REASONING = b"\x90\x01\x01"  # require_reasoning = true (field 18)


def sglang_generate_bytes(req: GenerateRequest) -> bytes:
    """``sglang_generate(req).SerializeToString()``, built without the message (see the module doc)."""
    rid = req.request_id.encode()
    out = [b"\x0a", _V[len(rid)] if len(rid) < _VN else _varint(len(rid)), rid] if rid else []
    out += _tokenized(req.text, req.input_ids)
    out.append(_sglang_sampling_field(req.sampling))
    if req.prompt_logprobs is None:  # the usual request
        if req.logprobs:
            out.append(b"\x28\x01")
        out.append(_LOGPROB_START)
        top_num = req.top_logprobs
    else:  # the prompt's logprobs: from position 0 (logprob_start_len 0 is protobuf's default: not written)
        _want, _start, top_num = _sglang_logprob_fields(req)
        out.append(b"\x28\x01")
    if top_num:
        top = _int32(top_num)
        if top is None:
            return _by_message(req)
        out += (b"\x38", top)
    if req.bootstrap_host is not None:
        pd = _disaggregated(req)
        if pd is None:
            return _by_message(req)
        out.append(pd)
    if req.stream:
        out.append(_SG_STREAM)
    if req.require_reasoning:
        out.append(_SG_REQUIRE_REASONING)
    return b"".join(out)


def _by_message(req: GenerateRequest) -> bytes:
    """Through the message: for values protobuf refuses (it raises here, as it always did)."""
    out: bytes = sglang_generate(req).SerializeToString()
    return out


def _disaggregated(req: GenerateRequest) -> bytes | None:
    """Field 10 (disaggregated_params), present whenever a bootstrap host is given; None: let protobuf
    judge (and refuse) the values."""
    host = (req.bootstrap_host or "").encode()
    port = _int32(req.bootstrap_port or 0)
    room = _int32(req.bootstrap_room or 0)
    if port is None or room is None:
        return None
    sub = _ld(b"\x0a", host) if host else b""
    if req.bootstrap_port:
        sub += b"\x10" + port
    if req.bootstrap_room:
        sub += b"\x18" + room
    return _ld(b"\x52", sub)


def vllm_generate_bytes(req: GenerateRequest) -> bytes:
    """``vllm_generate(req).SerializeToString()``, built without the message (see the module doc)."""
    rid = req.request_id.encode()
    out = [b"\x0a", _V[len(rid)] if len(rid) < _VN else _varint(len(rid)), rid] if rid else []
    out += _tokenized(req.text, req.input_ids)
    out.append(_vllm_sampling_field(req.sampling, req.logprobs, req.top_logprobs, req.prompt_logprobs))
    if req.stream:
        out.append(b"\x28\x01")
    if req.kv_transfer_params_json is not None:
        out.append(_ld(b"\x42", req.kv_transfer_params_json.encode()))
    return b"".join(out)


def vllm_generate(req: GenerateRequest) -> vl.GenerateRequest:
    msg = vl.GenerateRequest(
        request_id=req.request_id,
        tokenized=vl.TokenizedInput(original_text=req.text, input_ids=req.input_ids),
        sampling_params=vllm_sampling(req.sampling, req.logprobs, req.top_logprobs, req.prompt_logprobs),
        stream=req.stream,
    )
    if req.kv_transfer_params_json is not None:
        msg.kv_transfer_params_json = req.kv_transfer_params_json
    return msg


def sglang_embed(request_id: str, ids: Sequence[int]) -> sg.EmbedRequest:
    """SGLang's Embed request: the prompt as ids only (the engine does not tokenize)."""
    return sg.EmbedRequest(request_id=request_id, tokenized=sg.TokenizedInput(input_ids=ids))


def vllm_embed(request_id: str, ids: Sequence[int]) -> vl.EmbedRequest:
    return vl.EmbedRequest(request_id=request_id, tokenized=vl.TokenizedInput(input_ids=ids))


def sampling_as_dict(msg: Any) -> dict[str, Any]:
    """For diagnostics and tests: every field, including zero values."""
    out: dict[str, Any] = json_format.MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return out
