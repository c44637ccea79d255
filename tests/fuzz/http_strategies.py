"""Hypothesis strategies for raw HTTP/1.x request streams: methods, request targets, header sets and
bodies that are mostly almost right (so they get past the first byte) and often wrong in one place:
percent-encoding, very long or NUL-bearing targets, duplicate and conflicting framing headers, obs-fold,
huge fields, bad chunk sizes and extensions, truncated bodies, HTTP/1.0, ``Expect: 100-continue``,
upgrades, bare LF line ends and several requests pipelined. A body may hold a whole request to a canary
path (``CANARY``): if the server ever runs it, a request was smuggled."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass

from hypothesis import strategies as st

CANARY = "/canary/"

METHODS = [b"GET", b"POST", b"HEAD", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"TRACE", b"CONNECT", b"PRI"]
ODD_METHODS = [b"get", b"G ET", b"", b"SEARCH", b"M-SEARCH", b"\x00GET", b"GET\t", b"FOO", b"SOURCE"]
VERSIONS = [b"HTTP/1.1"] * 8 + [b"HTTP/1.0"] * 2 + [b"HTTP/2.0", b"HTTP/1.2", b"HTTP/0.9", b"http/1.1", b""]
EOLS = [b"\r\n"] * 12 + [b"\n", b"\r", b"\r\r\n"]
TARGET_SUFFIXES = [
    b"",
    b"%00",
    b"%2e%2e/%2e%2e/",
    b"%",
    b"%zz",
    b"%C3%A9",
    b"%ff%fe",
    b"%2F",
    b"\x00",
    b" ",
    b"\xc3\xa9",
    b"\xf0\x9f\x99\x82",
    b"?",
    b"?a=1&a=2&b",
    b"?q=%00%zz",
    b"#frag",
    b"/..",
    b"//",
    b"\t",
    b"\\",
]


SAFE_SUFFIXES = [
    b"",
    b"",
    b"",
    b"%2e%2e/",
    b"%C3%A9",
    b"%ff%fe",
    b"%2F",
    b"%00",
    b"?a=1&a=2&b",
    b"?q=%ff%zz",
    b"/",
]


def clean_targets(paths: list[bytes]) -> st.SearchStrategy[bytes]:
    """Targets llhttp accepts (printable ASCII): real paths, escapes (valid or not as UTF-8), queries."""
    return st.tuples(st.sampled_from(paths), st.sampled_from(SAFE_SUFFIXES)).map(lambda t: t[0] + t[1])


def targets(paths: list[bytes]) -> st.SearchStrategy[bytes]:
    base = st.sampled_from(paths)
    odd = st.sampled_from([b"*", b"", b"http://t/liveness", b"http://t", b"t:80", b"/" + b"a" * 70000])
    long = st.integers(min_value=1, max_value=2600).map(lambda n: b"/" + b"ab/" * n)
    junk = st.binary(min_size=1, max_size=40).map(lambda b: b"/" + b)
    head = st.one_of(base, base, base, odd, long, junk)
    return st.tuples(head, st.lists(st.sampled_from(TARGET_SUFFIXES), max_size=3)).map(
        lambda t: t[0] + b"".join(t[1])
    )


_token = st.text(alphabet="!#$%&'*+-.^_`|~abcxyzABC019", min_size=1, max_size=12).map(str.encode)
_value = st.binary(max_size=40)
_printable = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40).map(
    str.encode
)

CL_VALUES = [
    b"0",
    b"5",
    b"-1",
    b"+5",
    b" 5 ",
    b"5, 5",
    b"0x10",
    b"99999999999999999999",
    b"",
    b"1e3",
    b"\x00",
]
TE_VALUES = [
    b"chunked",
    b"Chunked",
    b" chunked",
    b"chunked, chunked",
    b"gzip, chunked",
    b"chunked, gzip",
    b"identity",
    b"xchunked",
    b"chunked\x00",
    b"",
    b"\tchunked",
]


@st.composite
def clean_header_line(draw: st.DrawFn) -> bytes:
    """A field llhttp accepts (the server's own checks and the app see it)."""
    kind = draw(st.integers(min_value=0, max_value=8))
    if kind == 0:
        return b"Content-Type: " + draw(
            st.sampled_from([b"application/json", b"text/plain", b"application/x+json"])
        )
    if kind == 1:
        return b"Connection: " + draw(st.sampled_from([b"close", b"keep-alive", b"upgrade"]))
    if kind == 2:
        return b"Expect: " + draw(st.sampled_from([b"100-continue", b"100-Continue", b"200-ok"]))
    if kind == 3:
        return b"Content-Encoding: " + draw(
            st.sampled_from([b"gzip", b"deflate", b"br", b"identity", b"gzip, gzip"])
        )
    if kind == 4:
        return b"X-Request-Id: " + draw(_printable | st.sampled_from([b"\xff\xfe", b"\xc3\xa9", b"a\x80b"]))
    if kind == 5:
        return b"Authorization: Bearer " + draw(_printable)
    if kind == 6:
        return b"Content-Length: " + draw(st.sampled_from([b"0", b"2", b"70000", b"99999999999"]))
    if kind == 7:
        return b"Upgrade: " + draw(st.sampled_from([b"websocket", b"h2c"]))
    return draw(_token) + b": " + draw(_printable)


@st.composite
def header_line(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(min_value=0, max_value=15))
    if kind == 0:
        return b"Content-Length: " + draw(st.sampled_from(CL_VALUES) | st.integers(0, 200).map(b"%d".__mod__))
    if kind == 1:
        return b"Transfer-Encoding: " + draw(st.sampled_from(TE_VALUES))
    if kind == 2:
        v = [
            b"close",
            b"keep-alive",
            b"upgrade",
            b"Upgrade, HTTP2-Settings",
            b"close, keep-alive",
            b"",
            b"TE",
        ]
        return b"Connection: " + draw(st.sampled_from(v))
    if kind == 3:
        return b"Upgrade: " + draw(st.sampled_from([b"websocket", b"h2c", b"HTTP/2.0", b""]))
    if kind == 4:
        return b"Expect: " + draw(st.sampled_from([b"100-continue", b"100-Continue", b"200-ok", b""]))
    if kind == 5:
        v = [b"gzip", b"deflate", b"br", b"identity", b"gzip, gzip", b"x-gzip", b"", b"GZIP"]
        return b"Content-Encoding: " + draw(st.sampled_from(v))
    if kind == 6:
        return b"Content-Type: " + draw(
            st.sampled_from([b"application/json", b"text/plain", b"", b"a/b; c=\x01"])
        )
    if kind == 7:  # obs-fold
        return b"X-Fold: a" + draw(st.sampled_from([b"\r\n b", b"\r\n\tb", b"\n b"]))
    if kind == 8:  # huge
        return b"X-Big: " + b"a" * draw(st.integers(min_value=1000, max_value=70000))
    if kind == 9:  # bad shapes
        odd = [b"No-Colon", b" Leading: x", b"X : y", b"X:\x00", b"X: a\rb", b"X: a\x7fb", b":", b"\x00: x"]
        return draw(st.sampled_from(odd))
    if kind == 10:
        return b"Host: " + draw(st.sampled_from([b"t", b"", b"t:99999", b"a b", b"\xc3\xa9"]))
    if kind == 11:
        return b"X-Request-Id: " + draw(_value)
    if kind == 12:
        return (
            b"Authorization: "
            + draw(st.sampled_from([b"Bearer ", b"Basic ", b"", b"Bearer \xff"]))
            + draw(_value)
        )
    return draw(_token) + b": " + draw(_value)


@dataclass(frozen=True)
class Chunk:
    data: bytes
    size: bytes | None  # the size line as sent (None: the right one)
    ext: bytes
    crlf: bool  # the CRLF after the data


@st.composite
def chunks(draw: st.DrawFn) -> bytes:
    out = []
    for _ in range(draw(st.integers(min_value=0, max_value=4))):
        data = draw(st.binary(max_size=30))
        size = draw(
            st.none()
            | st.none()
            | st.sampled_from([b"zz", b"-1", b"ffffffffffffffffffff", b"", b" 5", b"5 ", b"0x5", b"1" * 30])
            | st.integers(min_value=0, max_value=300).map(lambda n: b"%x" % n)
        )
        ext = draw(st.sampled_from([b"", b"", b";a=b", b";", b';a="q"', b";\x00", b"; " + b"e" * 3000]))
        crlf = draw(st.booleans() | st.just(True))
        c = Chunk(data, size, ext, crlf)
        out.append((c.size if c.size is not None else b"%x" % len(c.data)) + c.ext + b"\r\n" + c.data)
        if c.crlf:
            out.append(b"\r\n")
    end = draw(
        st.sampled_from([b"0\r\n\r\n"] * 4 + [b"0\r\nX-Trailer: t\r\n\r\n", b"0;e=1\r\n\r\n", b"0\r\n", b""])
    )
    return b"".join(out) + end


JSON_BODY = json.dumps(
    {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
).encode()


def bodies(canary: str) -> st.SearchStrategy[bytes]:
    smuggled = f"GET {CANARY}{canary} HTTP/1.1\r\nHost: t\r\n\r\n".encode()
    return st.one_of(
        st.just(b""),
        st.just(JSON_BODY),
        st.just(gzip.compress(JSON_BODY)),
        st.just(b"{}"),
        st.just(b"[]"),
        st.just(b'{"a": ' * 300),
        st.binary(max_size=64),
        st.just(smuggled),
        st.just(b"0\r\n\r\n" + smuggled),
        st.just(JSON_BODY + smuggled),
        st.integers(min_value=1, max_value=200_000).map(lambda n: b"x" * n),
    )


@st.composite
def message(draw: st.DrawFn, paths: list[bytes], canary: str) -> bytes:
    """One request: two in three are clean up to their framing (what llhttp accepts, so the server's own
    logic and the app see it), the others wrong anywhere."""
    if draw(st.integers(min_value=0, max_value=2)):
        eol = b"\r\n"
        method = draw(
            st.sampled_from([b"GET", b"GET", b"POST", b"POST", b"HEAD", b"PUT", b"DELETE", b"OPTIONS"])
        )
        target = draw(clean_targets(paths))
        version = draw(st.sampled_from([b"HTTP/1.1"] * 4 + [b"HTTP/1.0"]))
        field = clean_header_line()
    else:
        eol = draw(st.sampled_from(EOLS))
        method = draw(st.sampled_from(METHODS + METHODS + ODD_METHODS))
        target = draw(targets(paths))
        version = draw(st.sampled_from(VERSIONS))
        field = header_line()
    line = method + b" " + target + (b" " + version if version else b"")
    headers = [b"Host: t"] if draw(st.booleans() | st.just(True)) else []
    if draw(st.booleans()):
        headers.append(b"Content-Type: application/json")
    headers += draw(st.lists(field, max_size=5))
    if draw(st.integers(min_value=0, max_value=9)) == 0:  # many fields
        headers += [b"X-Many-%d: v" % i for i in range(draw(st.integers(min_value=20, max_value=200)))]
    body = draw(bodies(canary))
    framing = draw(st.sampled_from(["length", "length", "chunked", "none", "raw"]))
    if framing == "length":
        headers.append(b"Content-Length: %d" % len(body))
    elif framing == "chunked":
        headers.append(b"Transfer-Encoding: chunked")
        body = (b"%x\r\n" % len(body) + body + b"\r\n" if body else b"") + draw(chunks())
    elif framing == "none":
        body = b""
    headers = draw(st.permutations(headers))
    return line + eol + b"".join(h + eol for h in headers) + eol + body


@st.composite
def request_stream(draw: st.DrawFn, paths: list[bytes], canary: str) -> bytes:
    """One to three requests back to back (pipelined), the last maybe cut short."""
    msgs = draw(st.lists(message(paths, canary), min_size=1, max_size=3))
    data = b"".join(msgs)
    if draw(st.integers(min_value=0, max_value=5)) == 0:
        data = data[: draw(st.integers(min_value=1, max_value=max(1, len(data) - 1)))]
    return data
