"""What a client is, by its address: the key its connections and failed authentications count under."""

from __future__ import annotations

import ipaddress

__all__ = ["client_key"]


def client_key(remote: str | None) -> str:
    """The address a client is counted under: its IP address, an IPv6 one by its /64 (one host holds a
    whole /64); IPv4-mapped IPv6 as IPv4."""
    if not remote:
        return ""
    try:
        ip = ipaddress.ip_address(remote.partition("%")[0])
    except ValueError:
        return remote[:64]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)
