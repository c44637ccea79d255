"""The PROXY protocol (HAProxy's, versions 1 and 2): the client's address, as a load balancer passes it.

A load balancer in TCP mode (HAProxy ``send-proxy`` / ``send-proxy-v2``, AWS NLB, GCP and Azure's) opens
each connection with a header naming the client it relays; behind one, without it, every client has the
balancer's address (what the per-client connection cap, the failed-authentication limiter, logs and
traces key on). ``parse`` reads that header from the first bytes of a connection (a pure function:
the server's gate feeds it what has arrived); only connections from the addresses the operator names
(``--proxy-protocol-from``) are read so: a header from anyone else would let a client claim any address.

Version 1: ``PROXY TCP4|TCP6 <src> <dst> <sport> <dport>\\r\\n`` or ``PROXY UNKNOWN ...\\r\\n``, at most 107
bytes. Version 2: the 12-byte signature, version and command, family and protocol, a 2-byte length, the
addresses, then TLVs (skipped). ``LOCAL`` (a balancer's own health check), ``UNKNOWN`` and families
other than TCP over IPv4 / IPv6 keep the connection's own address.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

__all__ = ["MAX_HEADER", "ProxyError", "ProxyHeader", "header_end", "parse"]

V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
V1_MAX = 107  # the longest version 1 line, CRLF included (the specification's bound)
MAX_HEADER = 16 + 1024  # a version 2 header with more TLV bytes than this is refused (no use for them here)
_V2_FIXED = struct.Struct(">12sBBH")
# the family and protocol byte's values: UNSPEC, TCP and UDP over IPv4, IPv6, unix stream and datagram
_V2_FAMILIES = frozenset({0x00, 0x11, 0x12, 0x21, 0x22, 0x31, 0x32})


class ProxyError(ValueError):
    """Not a PROXY protocol header (the connection is closed)."""


@dataclass(frozen=True, slots=True)
class ProxyHeader:
    """What the header said: ``client`` (None: keep the connection's own address) and its length."""

    client: str | None
    length: int


def parse(buf: bytes) -> ProxyHeader | None:
    """The header at the start of ``buf``; None: not all of it has arrived (read more, up to
    ``MAX_HEADER``); ``ProxyError``: ``buf`` does not start with one."""
    if buf[:1] == b"P":
        return _v1(buf)
    if buf[:1] == b"\r":
        return _v2(buf)
    if buf:
        raise ProxyError("the connection does not start with a PROXY protocol header")
    return None


def header_end(buf: bytes) -> int | None:
    """Where the header that ``buf`` starts with ends, as far as ``buf`` tells (None: not yet known).

    A reader that must not read past the header (TLS follows it, and the TLS stack reads the socket
    itself) takes at most this many bytes: version 1 ends at its first CRLF, version 2 after its length
    field's bytes; before either is known every byte read so far belongs to the header. Bytes that are not
    a header end nowhere here: ``parse`` refuses them."""
    if buf[:1] == b"P":
        end = buf.find(b"\r\n", 0, V1_MAX)
        return None if end < 0 else end + 2
    if buf[:1] == b"\r" and len(buf) >= 16:
        return 16 + int.from_bytes(buf[14:16], "big")
    return None


def _v1(buf: bytes) -> ProxyHeader | None:
    n = min(len(buf), 6)
    if buf[:n] != b"PROXY "[:n]:
        raise ProxyError("not a PROXY protocol v1 line")
    end = buf.find(b"\r\n", 0, V1_MAX)
    if end < 0:
        if len(buf) >= V1_MAX:
            raise ProxyError("a PROXY protocol v1 line longer than 107 bytes")
        return None
    parts = buf[:end].split(b" ")
    if parts[0] != b"PROXY" or len(parts) < 2:
        raise ProxyError("not a PROXY protocol v1 line")
    if parts[1] == b"UNKNOWN":
        return ProxyHeader(None, end + 2)
    if parts[1] not in (b"TCP4", b"TCP6") or len(parts) != 6:
        raise ProxyError("a PROXY protocol v1 line with an unknown protocol or the wrong number of fields")
    if not all(p.isdigit() and (p == b"0" or not p.startswith(b"0")) and int(p) <= 65535 for p in parts[4:6]):
        raise ProxyError("a PROXY protocol v1 line with a malformed port")
    if b"%" in parts[2] or b"%" in parts[3]:  # (a scope id: free text, not an address)
        raise ProxyError("a PROXY protocol v1 line with a scoped address")
    try:
        src = ipaddress.ip_address(parts[2].decode("ascii"))
        dst = ipaddress.ip_address(parts[3].decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise ProxyError("a PROXY protocol v1 line with a malformed address") from None
    want = 4 if parts[1] == b"TCP4" else 6
    if src.version != want or dst.version != want:
        raise ProxyError("a PROXY protocol v1 line whose addresses do not match its protocol")
    return ProxyHeader(str(src), end + 2)


def _v2(buf: bytes) -> ProxyHeader | None:
    n = min(len(buf), 12)
    if buf[:n] != V2_SIGNATURE[:n]:
        raise ProxyError("not a PROXY protocol v2 signature")
    if len(buf) < 16:
        return None
    _, ver_cmd, fam, length = _V2_FIXED.unpack_from(buf)
    if ver_cmd >> 4 != 2:
        raise ProxyError(f"PROXY protocol version {ver_cmd >> 4} (2 expected)")
    cmd = ver_cmd & 0x0F
    if cmd > 1:
        raise ProxyError(f"PROXY protocol v2 command {cmd} (LOCAL or PROXY expected)")
    total = 16 + length
    if total > MAX_HEADER:
        raise ProxyError(f"a PROXY protocol v2 header of {total} bytes (at most {MAX_HEADER})")
    if len(buf) < total:
        return None
    if fam not in _V2_FAMILIES:  # (the specification's: any other must be rejected)
        raise ProxyError(f"a PROXY protocol v2 address family and protocol 0x{fam:02x}")
    if cmd == 0:  # LOCAL: the balancer's own connection (a health check)
        return ProxyHeader(None, total)
    body = buf[16:total]
    family, proto = fam >> 4, fam & 0x0F
    if proto == 2:  # a datagram relay is not this server's
        raise ProxyError("a PROXY protocol v2 header for a datagram transport")
    if family == 1:  # AF_INET: src, dst (4 bytes each), sport, dport
        if length < 12:
            raise ProxyError("a PROXY protocol v2 IPv4 header too short for its addresses")
        return ProxyHeader(str(ipaddress.IPv4Address(body[:4])), total)
    if family == 2:  # AF_INET6: 16 bytes each
        if length < 36:
            raise ProxyError("a PROXY protocol v2 IPv6 header too short for its addresses")
        return ProxyHeader(str(ipaddress.IPv6Address(body[:16])), total)
    if family == 3 and length < 216:  # AF_UNIX: two 108-byte paths
        raise ProxyError("a PROXY protocol v2 unix header too short for its addresses")
    return ProxyHeader(None, total)  # UNSPEC or AF_UNIX: the connection's own address
