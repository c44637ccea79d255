"""The OTLP ``ExportTraceServiceRequest`` bytes of finished spans (the SDK's, or the node's lean records:
``tracing._Span``), written directly (protobuf wire format)
instead of through the exporter's message objects: the stock encoder builds a ``KeyValue`` / ``AnyValue``
object per attribute, which cost the node more CPU than making the spans. Here an attribute whose value
is a string, number or boolean is encoded once and then looked up (a request's attributes mostly repeat:
the model, the operation, the worker, the route), and the rest is bytes joined.

The bytes parse to the message the stock ``encode_spans`` makes (tests/unit/test_otlp_wire.py compares
them); ``LeanGrpcSpanExporter`` hands them to the gRPC exporter's channel as they are. The lean records of
a batch are written in C when it is built (``_otlp_spans.request``: the bytes of ``_lean_request``; it
calls ``_record`` for any span it does not write itself).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["encode_request", "lean_grpc_exporter"]

# the request of lean records in C (``_otlp_spans.c``: the bytes of ``_lean_request``); None: in Python
_CRequest = Callable[[Sequence[Any], Callable[[Any], bytes], bytes, bytes | None, str, str], bytes]
_c_request: _CRequest | None = None
try:  # setup.py builds it where a compiler is
    from shepherd.node.observe._otlp_spans import request

    _c_request = request
except ImportError:  # pragma: no cover - an install without a C compiler
    pass

_KV_CACHE: dict[tuple[str, type, Any], bytes] = {}
_KV_CACHE_MAX = 8192
# how many short strings of one key are cached: a request or response id is new each time (cached, it
# would only fill the cache until it is cleared, and every repeating pair encoded again)
_DISTINCT: dict[str, int] = {}
_DISTINCT_MAX = 256
_RESOURCES: dict[int, tuple[Any, bytes]] = {}  # id(resource) -> (resource, its encoded message)
_SCOPES: dict[int, tuple[Any, bytes]] = {}
_FIXED64 = struct.Struct("<Q")
_FIXED32 = struct.Struct("<I")
_DOUBLE = struct.Struct("<d")
_HAS_IS_REMOTE = 0x100  # SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_IS_REMOTE = 0x200


_SMALL = [bytes((i,)) for i in range(0x80)]  # the one-byte varints


def _varint(n: int) -> bytes:
    if 0 <= n < 0x80:
        return _SMALL[n]
    if 0 < n < 0x4000:  # two bytes (most lengths): no loop
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    if n < 0:
        n &= 0xFFFFFFFFFFFFFFFF
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_LEN_TAGS = [bytes((f << 3 | 2,)) for f in range(16)]  # the tag of a length-delimited field 0..15
_FIXED64_TAGS = [bytes((f << 3 | 1,)) for f in range(16)]


def _len(field: int, payload: bytes) -> bytes:
    n = len(payload)
    return _LEN_TAGS[field] + (_SMALL[n] if n < 0x80 else _varint(n)) + payload


def _str(field: int, s: str) -> bytes:
    return _len(field, s.encode("utf-8")) if s else b""


def _fixed64(field: int, v: int) -> bytes:
    return _FIXED64_TAGS[field] + _FIXED64.pack(v)


def _uint(field: int, v: int) -> bytes:
    return _varint(field << 3) + _varint(v) if v else b""


def _any(v: Any) -> bytes:
    """An ``AnyValue`` message's bytes."""
    if isinstance(v, str):
        return _len(1, v.encode("utf-8"))
    if isinstance(v, bool):
        return b"\x10" + (b"\x01" if v else b"\x00")
    if isinstance(v, int):
        return b"\x18" + _varint(v)
    if isinstance(v, float):
        return b"\x21" + _DOUBLE.pack(v)
    if isinstance(v, bytes):
        return _len(7, v)
    if isinstance(v, Sequence):
        return _len(5, b"".join(_len(1, _any(x)) for x in v))
    return _len(1, str(v).encode("utf-8"))


def _kv(key: str, v: Any) -> bytes:
    """A ``KeyValue`` element of a repeated field whose tag is ``_LEN_TAGS[field]``, with its length.
    Strings, integers and booleans are looked up (they mostly repeat); a float (a duration: new each
    time) is written, its key's bytes looked up."""
    tv = type(v)
    if tv is float:
        kb = _KEYS.get(key)
        if kb is None:
            kb = _str(1, key)
            if len(_KEYS) < _KV_CACHE_MAX:
                _KEYS[key] = kb
        body = kb + b"\x12\x09\x21" + _DOUBLE.pack(v)  # value: AnyValue{double_value}, 9 bytes
        enc = _SMALL[len(body)] + body if len(body) < 0x80 else _varint(len(body)) + body
        seen = _DISTINCT.get(key, 0)
        if seen < _DISTINCT_MAX and v:  # a setting (temperature, top_p) repeats; a duration does not
            # (no zero: 0.0 and -0.0 are one key and two encodings)
            _DISTINCT[key] = seen + 1
            if len(_KV_CACHE) >= _KV_CACHE_MAX:
                _KV_CACHE.clear()
                _DISTINCT.clear()
            _KV_CACHE[(key, tv, v)] = enc
        return enc
    if tv is str and len(v) < 0x7D:  # a short string: AnyValue{string_value} written in place
        kb = _KEYS.get(key)
        if kb is None:
            kb = _str(1, key)
            if len(_KEYS) < _KV_CACHE_MAX:
                _KEYS[key] = kb
        vb = v.encode("utf-8")
        n = len(vb)
        if n < 0x7E:
            body = b"".join((kb, b"\x12", _SMALL[n + 2], b"\x0a", _SMALL[n], vb))
            n = len(body)
            enc = (_SMALL[n] if n < 0x80 else _varint(n)) + body
            seen = _DISTINCT.get(key, 0)
            if seen < _DISTINCT_MAX:  # a key whose values keep changing (ids) is not cached
                _DISTINCT[key] = seen + 1
                if len(_KV_CACHE) >= _KV_CACHE_MAX:
                    _KV_CACHE.clear()
                    _DISTINCT.clear()
                _KV_CACHE[(key, tv, v)] = enc
            return enc
    if tv is str or tv is int or tv is bool:  # (not tuples: (1,), (True,) and (1.0,) are one key)
        ck = (key, tv, v)
        got = _KV_CACHE.get(ck)
        if got is None:
            body = _str(1, key) + _len(2, _any(v))
            got = _varint(len(body)) + body
            if len(_KV_CACHE) >= _KV_CACHE_MAX:
                _KV_CACHE.clear()
            _KV_CACHE[ck] = got
        return got
    body = _str(1, key) + _len(2, _any(v))
    return _varint(len(body)) + body


_KEYS: dict[str, bytes] = {}  # an attribute key's bytes (field 1 of KeyValue)


def _attributes(field: int, attrs: Mapping[str, Any] | None) -> bytes:
    if not attrs:
        return b""
    tag = _LEN_TAGS[field]
    # the SDK's BoundedAttributes: its dict (read after the span ended: no longer written), not the
    # Mapping methods written in Python
    items = getattr(attrs, "_dict", attrs)
    return b"".join([tag + _kv(k, v) for k, v in items.items()])


def _resource(resource: Any) -> bytes:
    hit = _RESOURCES.get(id(resource))
    if hit is not None and hit[0] is resource:
        return hit[1]
    enc = _attributes(1, resource.attributes)
    _RESOURCES[id(resource)] = (resource, enc)
    return enc


def _scope(scope: Any) -> bytes:
    hit = _SCOPES.get(id(scope))
    if hit is not None and hit[0] is scope:
        return hit[1]
    enc = (
        _str(1, scope.name)
        + _str(2, scope.version or "")
        + _attributes(3, getattr(scope, "attributes", None))
    )
    _SCOPES[id(scope)] = (scope, enc)
    return enc


_FLAGS_LOCAL = b"\x85\x01" + _FIXED32.pack(_HAS_IS_REMOTE)  # field 16, fixed32
_FLAGS_REMOTE = b"\x85\x01" + _FIXED32.pack(_HAS_IS_REMOTE | _IS_REMOTE)
_STATUS_UNSET = _len(15, b"")  # a Status with code UNSET and no description


def _flags(parent: Any) -> bytes:
    return _FLAGS_REMOTE if parent is not None and parent.is_remote else _FLAGS_LOCAL


def _trace_state(ts: Any) -> str:
    return ",".join(f"{k}={v}" for k, v in ts.items()) if ts else ""


def _span(span: Any) -> bytes:
    ctx = span.get_span_context()
    parent = span.parent
    parts = [
        b"\x0a\x10" + ctx.trace_id.to_bytes(16, "big"),
        b"\x12\x08" + ctx.span_id.to_bytes(8, "big"),
        _str(3, _trace_state(ctx.trace_state)),
        b"\x22\x08" + parent.span_id.to_bytes(8, "big") if parent is not None else b"",
        _str(5, span.name),
        _uint(6, span.kind.value + 1),  # SpanKind.INTERNAL (0) is OTLP's SPAN_KIND_INTERNAL (1)
        _fixed64(7, span.start_time or 0),
        _fixed64(8, span.end_time or 0),
        _attributes(9, getattr(span, "_attributes", None) or span.attributes),
        _uint(10, span.dropped_attributes),
    ]
    for ev in span.events:
        body = _fixed64(1, ev.timestamp) + _str(2, ev.name) + _attributes(3, ev.attributes)
        parts.append(_len(11, body + _uint(4, ev.dropped_attributes)))
    parts.append(_uint(12, span.dropped_events))
    for link in span.links:
        lc = link.context
        body = (
            b"\x0a\x10" + lc.trace_id.to_bytes(16, "big")
            + b"\x12\x08" + lc.span_id.to_bytes(8, "big")
            + _attributes(4, link.attributes)
            + _uint(5, link.dropped_attributes)
            + b"\x35" + _FIXED32.pack(_HAS_IS_REMOTE | (_IS_REMOTE if lc.is_remote else 0))
        )  # fmt: skip
        parts.append(_len(13, body))
    parts.append(_uint(14, span.dropped_links))
    status = span.status
    code = status.status_code.value
    if code == 0 and not status.description:
        parts.append(_STATUS_UNSET)
    else:
        parts.append(_len(15, _str(2, status.description or "") + _uint(3, code)))
    parts.append(_flags(parent))
    return b"".join(parts)


_KIND_FIELDS = [_uint(6, k + 1) for k in range(5)]  # SpanKind value -> field 6 (OTLP's kind: value + 1)
_SPAN_NAMES: dict[str, bytes] = {}  # a span's name as field 5: they repeat (routes, operations, models)
_EVENT_NAMES: dict[str, bytes] = {}  # an event's name as field 2


def _name(names: dict[str, bytes], field: int, name: str) -> bytes:
    got = names.get(name)
    if got is None:
        got = _str(field, name)
        if len(names) < _KV_CACHE_MAX:
            names[name] = got
    return got


def _attrs_dict(field: int, attrs: Mapping[str, Any]) -> bytes:
    """A plain dict's attributes (a lean span's): each ``KeyValue`` looked up or written by ``_kv``."""
    if not attrs:
        return b""
    tag = _LEN_TAGS[field]
    cache = _KV_CACHE
    kv = _kv
    try:
        return tag + tag.join([cache.get((k, type(v), v)) or kv(k, v) for k, v in attrs.items()])
    except TypeError:  # a list value (unhashable: the node writes tuples): each through ``_kv``
        return tag + tag.join([kv(k, v) for k, v in attrs.items()])


def _record(span: Any) -> bytes:
    """A lean span's bytes (``tracing._Span``: trace and span ids, parent id, name, kind, times, a dict of
    attributes, events as (name, time, attributes), status code and description) as a ``spans`` element
    of its ``ScopeSpans`` (field 2, with its length)."""
    parent = span.parent
    pack = _FIXED64.pack
    parts = [
        b"\x0a\x10",
        span.trace_id.to_bytes(16, "big"),
        b"\x12\x08",
        span.span_id.to_bytes(8, "big"),
        _str(3, _trace_state(span.state)) if span.state else b"",
        b"\x22\x08" + parent.to_bytes(8, "big") if parent else b"",
        _SPAN_NAMES.get(span.name) or _name(_SPAN_NAMES, 5, span.name),
        _KIND_FIELDS[span.kind],
        b"\x39",
        pack(span.start_time),
        b"\x41",
        pack(span.end_time),
        _attrs_dict(9, span.attrs),
    ]
    small = _SMALL
    for name, ts, attrs in span.events:  # field 11, each with its length
        body = b"".join(
            (b"\x09", pack(ts), _EVENT_NAMES.get(name) or _name(_EVENT_NAMES, 2, name), _attrs_dict(3, attrs))
        )
        n = len(body)
        parts += (b"\x5a", small[n] if n < 0x80 else _varint(n), body)
    if span.dropped_events:
        parts.append(_uint(12, span.dropped_events))
    code = span.status
    parts.append(_STATUS_UNSET if not code else _len(15, _str(2, span.desc) + _uint(3, code)))
    parts.append(_FLAGS_REMOTE if parent and span.remote else _FLAGS_LOCAL)
    body = b"".join(parts)
    n = len(body)
    return b"\x12" + (small[n] if n < 0x80 else _varint(n)) + body


def _lean_request(spans: Sequence[Any]) -> bytes:
    """The request of lean spans only: one resource and one scope (the tracer's)."""
    first = spans[0]
    scope = first.instrumentation_scope
    res = first.resource
    if _c_request is not None:
        return _c_request(
            spans,
            _record,
            _resource(res),
            _scope(scope) if scope is not None else None,
            (scope.schema_url or "") if scope is not None else "",
            res.schema_url or "",
        )
    body = b"".join([_record(s) for s in spans])
    if scope is not None:
        body = _len(1, _scope(scope)) + body + _str(3, scope.schema_url or "")
    return _len(1, _len(1, _resource(res)) + _len(2, body) + _str(3, res.schema_url or ""))


def encode_request(spans: Sequence[Any]) -> bytes:
    """The ``ExportTraceServiceRequest`` of ``spans`` (SDK ``ReadableSpan``s), grouped by resource and
    instrumentation scope as the stock encoder groups them."""
    if spans and all([getattr(s, "lean", False) for s in spans]):
        return _lean_request(spans)
    groups: dict[int, tuple[Any, dict[int, tuple[Any, list[bytes]]]]] = {}
    for span in spans:
        res = span.resource
        by_scope = groups.setdefault(id(res), (res, {}))[1]
        scope = span.instrumentation_scope
        by_scope.setdefault(id(scope), (scope, []))[1].append(
            _record(span) if getattr(span, "lean", False) else _len(2, _span(span))
        )
    out = []
    for res, by_scope in groups.values():
        scope_spans = []
        for scope, encoded in by_scope.values():
            body = (_len(1, _scope(scope)) if scope is not None else b"") + b"".join(encoded)
            if scope is not None:
                body += _str(3, scope.schema_url or "")
            scope_spans.append(_len(2, body))
        rs = _len(1, _resource(res)) + b"".join(scope_spans) + _str(3, res.schema_url or "")
        out.append(_len(1, rs))
    return b"".join(out)


_EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def lean_grpc_exporter(**kwargs: Any) -> Any:
    """The OTLP gRPC span exporter (its channel, retries with back-off, reconnection, timeout, headers and
    compression), sending the bytes of ``encode_request`` as the request as they are: no request message
    is built, parsed or serialized again (the stub's request serializer passes bytes through)."""
    # optional: the exporter is imported only when tracing is on
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # optional: only when on
        ExportTraceServiceResponse,
    )

    class RawTraceServiceStub:
        """``TraceServiceStub`` whose ``Export`` takes the request's bytes (the exporter makes a new stub
        on its channel when it reconnects: ``_stub`` is this class)."""

        def __init__(self, channel: Any) -> None:
            self.Export = channel.unary_unary(
                _EXPORT_METHOD,
                request_serializer=None,  # bytes: sent as they are
                response_deserializer=ExportTraceServiceResponse.FromString,
            )

    class LeanGrpcSpanExporter(OTLPSpanExporter):
        takes_lean = True  # the node's lean spans (tracing._Span) are encoded as they are

        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            self._stub = RawTraceServiceStub
            self._client = RawTraceServiceStub(self._channel)  # type: ignore[assignment]

        def _translate_data(self, data: Sequence[Any]) -> Any:
            return encode_request(data)

    return LeanGrpcSpanExporter(**kwargs)
