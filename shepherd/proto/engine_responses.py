"""Engine responses: the SGLang scheduler and vLLM engine messages (smg-grpc-proto) -> our engine types.

``decode_response``: a GenerateResponse of either engine -> ``EngineChunk`` / ``EngineComplete``.
``decode_batch``: the responses that arrived together -> events, consecutive chunks of one choice merged
(parsed as one message when the request has one choice; a lone plain chunk read in C when
``_varint`` is built). ``decode_model_info``, ``decode_server_info``,
``decode_loads``: the other calls' answers. Shared by every transport, as engine_requests.py is.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from smg_grpc_proto import vllm_engine_pb2 as vl

from shepherd.proto.engine_types import (
    EmbedResult,
    EngineChunk,
    EngineComplete,
    EngineError,
    EngineEvent,
    EngineLoad,
    ModelInfo,
    PromptChunk,
    PromptLogprobs,
    SamplingDefaults,
    ServerInfo,
    TokenLogprob,
)


def _logprobs(lp: Any) -> list[TokenLogprob]:
    """OutputLogProbs (either engine) -> our TokenLogprob list."""
    ids: Sequence[int] = lp.token_ids
    if not ids:
        return []
    vals: Sequence[float] = lp.token_logprobs
    tops = lp.top_logprobs
    out: list[TokenLogprob] = []
    for i, tid in enumerate(ids):
        top: tuple[tuple[int, float], ...] = ()
        if i < len(tops):
            t = tops[i]
            top = tuple(zip(t.token_ids, t.values, strict=False))
        out.append(TokenLogprob(tid, vals[i] if i < len(vals) else 0.0, top))
    return out


def prompt_logprobs(lp: Any) -> PromptLogprobs:
    """InputLogProbs (either engine) -> PromptLogprobs: a position without a value (the first) has None;
    the alternatives in flat arrays (no object per pair, however long the prompt)."""
    vals: list[float | None] = [v.value if v.HasField("value") else None for v in lp.token_logprobs]
    starts = array("q", [0])
    ids = array("q")
    values = array("d")
    for t in lp.top_logprobs:
        ids.extend(t.token_ids)
        values.extend(t.values[: len(t.token_ids)])
        del ids[len(values) :]  # (a malformed entry with fewer values than ids: the pairs only)
        starts.append(len(ids))
    return PromptLogprobs(array("q", lp.token_ids), vals, starts, ids, values)


# GenerateComplete types with an optional kv_transfer_params_json (vLLM's; SGLang's has none)
_KV_COMPLETE: frozenset[type] = frozenset({vl.GenerateComplete})


def _kv_transfer_json(c: Any) -> str | None:
    """vLLM's KV transfer parameters of a GenerateComplete as JSON: ``kv_transfer_params_json`` when set,
    else the typed (legacy) ``kv_transfer_params`` (remote host and port: the only form some servicer
    versions send), else None."""
    if c.HasField("kv_transfer_params_json"):
        return str(c.kv_transfer_params_json)
    if c.HasField("kv_transfer_params"):
        t = c.kv_transfer_params
        if t.remote_host or t.remote_port:
            return json.dumps({"remote_host": t.remote_host, "remote_port": int(t.remote_port)})
    return None


def decode_response(resp: Any) -> EngineEvent | None:
    """A GenerateResponse of either engine -> EngineChunk / EngineComplete (None if empty)."""
    return _decode(resp, resp.WhichOneof("response"))


def _decode(resp: Any, kind: str | None) -> EngineEvent | None:
    if kind == "chunk":
        return _chunk_event(resp.chunk)
    if kind == "complete":
        c = resp.complete
        stop = c.WhichOneof("matched_stop")
        kv = _kv_transfer_json(c) if type(c) in _KV_COMPLETE else None
        return EngineComplete(
            c.index,
            c.finish_reason or "stop",
            c.prompt_tokens,
            c.completion_tokens,
            c.cached_tokens,
            c.output_ids,
            c.matched_token_id if stop == "matched_token_id" else None,
            c.matched_stop_str if stop == "matched_stop_str" else None,
            _logprobs(c.output_logprobs) if c.HasField("output_logprobs") else (),
            kv,
            prompt_logprobs(c.input_logprobs) if c.HasField("input_logprobs") else None,
        )
    return None


_c_chunk: Callable[[bytes, int, int, int], tuple[int, list[int], int, int, int] | None] | None = None
# lone_chunk(raw, vllm): one plain chunk response (a paced engine's token) -> EngineChunk, None for
# anything else (then decode_batch([raw], single=...) reads it; the two agree: a property test)
lone_chunk: Callable[[bytes, bool], EngineChunk | None] | None = None
try:  # a plain stream chunk's fields in C (setup.py builds it where a compiler is)
    from shepherd.proto import _varint

    _c_chunk = _varint.chunk_fields
    if hasattr(_varint, "lone_chunk"):  # (an older build has chunk_fields only)
        _varint.chunk_event_class(EngineChunk)
        lone_chunk = _varint.lone_chunk
except ImportError:  # pragma: no cover - an install without a C compiler (or an older build)
    pass
# GenerateStreamChunk's (index field, a varint field read past) per engine: SGLang's reasoning_tokens
# is not read (the upb path ignores it too); vLLM's chunk has no other varint
_SGLANG_CHUNK = (8, 9)
_VLLM_CHUNK = (7, 0)


def _sglang_chunk_head(b: bytes) -> int:
    """Whether a serialized SGLang GenerateResponse is a chunk, from its first bytes (request_id, field 1,
    then the oneof's tag: chunk is field 2): the length of that head (its bytes up to the chunk tag
    included), 0 when it is not a chunk. Anything unusual answers 0 (the caller then parses it), so does
    a request id that is not UTF-8 (a string field: protobuf's parse refuses the message)."""
    n = len(b)
    if n < 2:
        return 0
    t = b[0]
    if t == 0x12:
        return 1
    if t != 0x0A:
        return 0
    size = b[1]
    p = 2
    if size >= 0x80:  # a request id of 128 bytes or more: a two-byte length
        if n < 3 or b[2] >= 0x80:
            return 0
        size = (size & 0x7F) | (b[2] << 7)
        p = 3
    if p + size >= n or b[p + size] != 0x12:
        return 0
    rid = b[p : p + size]
    if not rid.isascii():
        try:
            rid.decode()
        except UnicodeDecodeError:
            return 0
    return p + size + 1


def _vllm_chunk_head(b: bytes) -> int:
    """The same for vLLM's GenerateResponse (no request_id; chunk is field 1)."""
    return 1 if len(b) > 0 and b[0] == 0x0A else 0


def decode_batch(
    raws: Sequence[bytes], parse: Callable[[bytes], Any], *, single: str | None = None
) -> list[EngineEvent]:
    """Several serialized GenerateResponses that arrived together -> events, with consecutive chunks of
    the same choice merged into one (one id list, logprobs concatenated, latest counts): the consumer
    then detokenizes, stop-checks and encodes them once.

    ``single`` ("sglang" or "vllm") says the request has one choice: then consecutive chunk messages are
    parsed as one. Serialized protobuf messages concatenated parse as their merge: repeated fields
    (token ids, the logprob lists) append, set scalars take the last value (the cumulative counts
    engines send: the latest) and every chunk is choice 0; one parse instead of one per message (a
    stream whose tokens arrive together is 30+ messages). Chunks are told apart from the other responses
    by their first bytes; anything unusual is parsed alone."""
    if single is not None:
        vllm = single == "vllm"
        head_of = _vllm_chunk_head if vllm else _sglang_chunk_head
        if len(raws) > 1:
            return _decode_single(raws, parse, head_of)
        if raws:
            raw = raws[0]
            head = head_of(raw)
            if head:  # one chunk (a token arriving alone, as a paced engine sends them): no oneof dispatch
                if _c_chunk is not None:  # a plain chunk read in C, without protobuf's messages
                    f = _c_chunk(raw, head, *(_VLLM_CHUNK if vllm else _SGLANG_CHUNK))
                    if f is not None:
                        return [EngineChunk(f[0], f[1], f[2], f[3], f[4], [])]
                return [_chunk_event(parse(raw).chunk)]
    out: list[EngineEvent] = []
    for raw in raws:
        resp = parse(raw)
        ev = _decode(resp, resp.WhichOneof("response"))
        if ev is not None:
            _append(out, ev)
    return out


def _decode_single(
    raws: Sequence[bytes], parse: Callable[[bytes], Any], chunk_head: Callable[[bytes], int]
) -> list[EngineEvent]:
    out: list[EngineEvent] = []
    i = 0
    n = len(raws)
    while i < n:  # bounded: each turn consumes at least one message
        raw = raws[i]
        head = chunk_head(raw)
        if head:
            # the chunks of a stream share their head (the request id and the chunk tag): a message
            # that starts with it is a chunk (the same answer as chunk_head's, at a fraction of the cost)
            prefix = raw[:head]
            j = i + 1
            while j < n and (raws[j].startswith(prefix) or chunk_head(raws[j])):
                j += 1
            if j - i > 1:
                _append(out, _chunk_event(parse(b"".join(raws[i:j])).chunk))
                i = j
                continue
        resp = parse(raw)
        ev = _decode(resp, resp.WhichOneof("response"))
        if ev is not None:
            _append(out, ev)
        i += 1
    return out


def _chunk_event(c: Any) -> EngineChunk:
    """A GenerateStreamChunk (either engine) -> EngineChunk (its ids and logprobs in lists of its own); a
    PromptChunk when it carries the prompt's logprobs."""
    if c.HasField("input_logprobs"):
        return PromptChunk(
            c.index,
            c.token_ids[:],
            c.prompt_tokens,
            c.completion_tokens,
            c.cached_tokens,
            _logprobs(c.output_logprobs) if c.HasField("output_logprobs") else [],
            prompt_logprobs(c.input_logprobs),
        )
    return EngineChunk(
        c.index,
        c.token_ids[:],  # (a list; a slice copies it in one call: list() steps the container per id)
        c.prompt_tokens,
        c.completion_tokens,
        c.cached_tokens,
        _logprobs(c.output_logprobs) if c.HasField("output_logprobs") else [],
    )


def _append(out: list[EngineEvent], ev: EngineEvent) -> None:
    """Add ``ev`` to ``out``, merged into the chunk before it when both are chunks of one choice: ids and
    logprobs appended in order, the latest counts (the consumer handles the merged chunk once)."""
    last = out[-1] if out else None
    if type(ev) is not EngineChunk or type(last) is not EngineChunk or last.index != ev.index:
        out.append(ev)
        return
    ids = last.token_ids
    if type(ids) is list:  # ours (_chunk_event): grown in place
        ids.extend(ev.token_ids)
    else:
        last.token_ids = [*ids, *ev.token_ids]
    last.completion_tokens = ev.completion_tokens
    if ev.cached_tokens > last.cached_tokens:
        last.cached_tokens = ev.cached_tokens
    if ev.logprobs:
        lps = last.logprobs
        if type(lps) is list:
            lps.extend(ev.logprobs)
        else:
            last.logprobs = [*lps, *ev.logprobs]


def decode_model_info(resp: Any, server: ServerInfo | None = None) -> ModelInfo:
    """A GetModelInfoResponse. With ``server`` (an SGLang worker's GetServerInfo): SGLang's servicers
    (SMG's and SGLang's in-tree one) fill ``max_context_length`` from the KV pool size
    (``max_total_num_tokens``), not from the model's context window; that number becomes
    ``kv_capacity_tokens`` and the context is what the server's arguments say (``context_length``),
    else GetModelInfo's ``max_req_input_len`` (the scheduler refuses a prompt of that many tokens or more:
    the engine's real bound, a little under the context, or under its KV pool), else 0 (unknown: the node's
    configured or the tokenizer's). ``skip_tokenizer_init`` comes from the server's arguments."""
    info = _model_info(resp)
    if server is None:
        return info
    ctx = server.context_length
    if not ctx:
        ctx = _positive_int(getattr(resp, "max_req_input_len", 0))
    return replace(
        info,
        max_context_length=ctx,
        kv_capacity_tokens=info.max_context_length,
        skip_tokenizer_init=server.skip_tokenizer_init,
    )


def _positive_int(v: Any) -> int:
    """A count an engine reports: 0 (unknown) unless in (0, 2**31 - 1]."""
    n = int(v)
    return n if 0 < n <= _STRUCT_INT_MAX else 0


# the bounds a default must be within to be taken (those of the request fields it stands for:
# requests.py), and the size of the JSON read at all; anything else in it is ignored
_DEFAULT_RANGES: dict[str, tuple[float, float, bool]] = {  # (low, high, low excluded)
    "temperature": (0.0, 2.0, False),
    "top_p": (0.0, 1.0, True),
    "min_p": (0.0, 1.0, False),
    "repetition_penalty": (0.0, 2.0, True),
}
_DEFAULTS_JSON_MAX = 64 * 1024


def decode_sampling_defaults(text: str) -> SamplingDefaults | None:
    """GetModelInfo's ``default_sampling_params_json`` -> the defaults usable, None when none is. Read
    defensively: JSON that does not parse (or is not an object, or is huge) gives None; a field of the
    wrong type or out of the range its request field has (temperature in [0, 2], top_p in (0, 1], top_k
    an integer >= -1, min_p in [0, 1], repetition_penalty in (0, 2]) is ignored, the others kept (SMG
    drops the whole set on a type error). top_k 0 means every token, as the request field's 0 does
    (-1 here); keys other than the five (max_new_tokens, ...) are not sampling defaults."""
    if not text or len(text) > _DEFAULTS_JSON_MAX:
        return None
    try:
        d = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(d, dict):
        return None
    got: dict[str, Any] = {}
    for key, (lo, hi, lo_open) in _DEFAULT_RANGES.items():
        v = d.get(key)
        if (
            isinstance(v, bool)
            or not isinstance(v, int | float)
            or not math.isfinite(v)
            or not lo <= v <= hi
            or (lo_open and v == lo)
        ):
            continue
        got[key] = float(v)
    k = d.get("top_k")
    if isinstance(k, float) and k.is_integer():
        k = int(k)
    if isinstance(k, int) and not isinstance(k, bool) and -1 <= k <= _STRUCT_INT_MAX:
        got["top_k"] = k if k else -1
    return SamplingDefaults(**got) if got else None


def _printable(text: str, limit: int = 256) -> str:
    """An engine's name without control characters (they would reach logs and model ids), bounded."""
    text = text[: limit * 4]
    if not text.isprintable():
        text = "".join(c for c in text if c.isprintable())
    return text[:limit]


def _model_info(resp: Any) -> ModelInfo:
    bos = int(resp.bos_token_id)
    ctx = int(resp.max_context_length)
    vocab = int(resp.vocab_size)
    return ModelInfo(
        served_model_name=_printable(resp.served_model_name),
        model_path=_printable(resp.model_path, 4096),
        # a broken engine's negative numbers mean unknown (0), not a context every request is refused by
        max_context_length=ctx if ctx > 0 else 0,
        vocab_size=vocab if vocab > 0 else 0,
        eos_token_ids=tuple(int(x) for x in resp.eos_token_ids),
        bos_token_id=bos if bos > 0 else None,
        is_generation=bool(resp.is_generation),
        sampling_defaults=decode_sampling_defaults(str(getattr(resp, "default_sampling_params_json", ""))),
    )


def decode_embed(resp: Any, n_ids: int) -> EmbedResult:
    """An EmbedResponse (SGLang or vLLM: same field names) -> EmbedResult; ``n_ids``: the prompt's
    length, the count when the engine reports none."""
    vec = list(resp.embedding)
    dim = int(resp.embedding_dim)
    if dim and dim != len(vec):
        raise EngineError(f"engine sent an embedding of {len(vec)} floats, announced {dim}")
    if not vec:
        raise EngineError("engine sent an empty embedding")
    return EmbedResult(vec, int(resp.prompt_tokens) or n_ids)


def decode_server_info(resp: Any, kind: str) -> ServerInfo:
    if kind == "sglang":
        return ServerInfo(
            kind="sglang",
            version=resp.sglang_version,
            active_requests=resp.active_requests,
            max_total_num_tokens=resp.max_total_num_tokens,
            context_length=_struct_int(resp.server_args, "context_length"),
            skip_tokenizer_init=_struct_bool(resp.server_args, "skip_tokenizer_init"),
            extra={"server_type": resp.server_type},
        )
    return ServerInfo(
        kind="vllm",
        active_requests=resp.active_requests,
        extra={"server_type": resp.server_type, "kv_role": resp.kv_role, "kv_connector": resp.kv_connector},
    )


# the largest number ``_struct_int`` takes: a context or token count beyond a signed 32-bit integer is
# no engine's (and infinity or 1e300 would not convert, or not fit a JSON integer where it is shown)
_STRUCT_INT_MAX = 2**31 - 1


def _struct_int(st: Any, key: str) -> int:
    """A positive whole number under ``key`` of a google.protobuf.Struct, at most 2**31 - 1, else 0
    (absent, null, another type, infinite, NaN, too large)."""
    f = st.fields.get(key) if st is not None else None
    if f is None or f.WhichOneof("kind") != "number_value":
        return 0
    v = f.number_value
    return int(v) if 0 < v <= _STRUCT_INT_MAX and v == int(v) else 0


def _struct_bool(st: Any, key: str) -> bool:
    """True only when ``key`` of a google.protobuf.Struct is the boolean true."""
    f = st.fields.get(key) if st is not None else None
    return f is not None and f.WhichOneof("kind") == "bool_value" and bool(f.bool_value)


def decode_loads(resp: Any) -> EngineLoad:
    running = waiting = used = total = uncached = max_running = 0
    usage = hit = 0.0
    n = 0
    for ld in resp.loads:
        n += 1
        running += ld.num_running_reqs
        waiting += ld.num_waiting_reqs
        used += ld.num_used_tokens
        total += ld.max_total_num_tokens
        uncached += ld.num_waiting_uncached_tokens
        max_running += ld.max_running_requests
        usage += ld.token_usage
        hit += ld.cache_hit_rate
    return EngineLoad(
        running=running,
        waiting=waiting,
        used_tokens=used,
        max_total_tokens=total,
        token_usage=usage / n if n else 0.0,
        waiting_uncached_tokens=uncached,
        max_running=max_running,
        cache_hit_rate=hit / n if n else 0.0,
    )
