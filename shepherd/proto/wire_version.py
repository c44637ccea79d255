"""The protocol version every mesh packet, push-pull state, RPC frame and state payload carries.

Scheme (read this before changing a mesh message format):

* A version is ``(major, minor)``, sent as **one msgpack integer** ``major << 4 | minor`` (minor
  0..15, major 0..15): one byte on the wire up to major 7 (a positive fixint), two bytes above. The
  first element of every mesh array (``mesh_wire`` packets, push-pull states, RPC frames; the
  ``state_wire`` envelope) is that integer. Builds before versioning sent ``1`` and compared it for
  equality: ``1`` reads as version 0.1, the version this build speaks (``MESH``), so its bytes are
  theirs and a fleet of those builds upgrades to this one node by node.
* **Accepted**: the same major, and a minor at most one away from ours (previous, same or next).
  Anything else is refused as a whole (``VersionError``, ``reason`` in ``REFUSAL_REASONS``): the
  receiver logs it (once a minute per peer and reason) and counts it
  (``smg_mesh_wire_refused{reason}``). A rolling upgrade therefore moves one minor at a time; a major
  bump needs a fleet restart (or a bridge build that speaks both).
* **A minor version only adds**, and a receiver **skips what it does not know**:

  - *unknown message types* (a ``mesh_wire`` message whose type code this build does not know, a
    ``state_wire`` payload with an unknown tag) are skipped, the rest of the packet is used;
  - *unknown fields*: every array may grow at its end; a decoder reads the fields it knows and
    ignores the ones after them (never reorder, never remove, never change a field's type or meaning
    within a major);
  - a field added in minor N+1 must be optional: a decoder of N+1 fills a default when a packet of
    minor N lacks it; in ``mesh_wire`` arrays it is any msgpack value but a map or an extension
    type (decoders there refuse those anywhere).

  Anything that cannot follow these rules (a changed field, a removed message, a changed meaning)
  is a new major.

Outside this scheme: the keyring's seal around datagrams and frames (``shepherd.mesh.keyring``, its own
version byte in the authenticated data) and the TLS of the TCP channel; a change there is a new major.

A test build speaks the next minor (``SHEPHERD_TEST_WIRE_NEXT=1``, read once at start-up by
``enable_test_next_from_env``): it sends ``MINOR + 1``, adds an extra trailing field to its arrays and
an extra message type (``mesh_wire.TEST_NEXT``, a ``state_wire`` tag ``"~"``) to its packets, and
accepts around its own minor. The rolling-upgrade chaos scenario (``chaos/scenarios/wire_upgrade.py``)
replaces nodes one by one with it.
"""

from __future__ import annotations

import os
from typing import Any, Literal

__all__ = [
    "MAJOR",
    "MINOR",
    "REFUSAL_REASONS",
    "TEST_NEXT_ENV",
    "RefusalReason",
    "VersionError",
    "accepted_minors",
    "check",
    "enable_test_next_from_env",
    "encode",
    "is_strict",
    "is_test_next",
    "set_strict",
    "set_test_next",
    "speaks",
    "version_byte",
]

MAJOR = 0
MINOR = 1
TEST_NEXT_ENV = "SHEPHERD_TEST_WIRE_NEXT"

RefusalReason = Literal["major", "minor_too_old", "minor_too_new", "malformed"]
REFUSAL_REASONS: tuple[RefusalReason, ...] = ("major", "minor_too_old", "minor_too_new", "malformed")

_test_next = False
_strict = False


class VersionError(ValueError):
    """A version this node does not accept (``reason``); ``version`` is what the peer sent."""

    def __init__(self, reason: RefusalReason, version: tuple[int, int] | None) -> None:
        lo, hi = accepted_minors()
        major, minor = speaks()
        sent = f"{version[0]}.{version[1]}" if version is not None else "no version"
        super().__init__(
            f"wire version {sent} refused ({reason}): this node speaks {major}.{minor} and accepts "
            f"{major}.{lo}..{major}.{hi}"
        )
        self.reason: RefusalReason = reason
        self.version = version


def version_byte(major: int, minor: int) -> int:
    if not (0 <= major <= 15 and 0 <= minor <= 15):
        raise ValueError(f"version {major}.{minor} out of range (0..15 each)")
    return major << 4 | minor


def speaks() -> tuple[int, int]:
    """The version this process sends (``MINOR + 1`` in a test-next build)."""
    return (MAJOR, MINOR + 1 if _test_next else MINOR)


def encode() -> int:
    """The integer this process puts first in its mesh arrays."""
    return version_byte(*speaks())


def accepted_minors() -> tuple[int, int]:
    minor = speaks()[1]
    return (max(0, minor - 1), minor + 1)


def check(raw: Any) -> tuple[int, int]:
    """The ``(major, minor)`` of a received version integer, or ``VersionError``."""
    if type(raw) is not int or not 0 <= raw <= 255:
        raise VersionError("malformed", None)
    major, minor = raw >> 4, raw & 15
    if major != MAJOR:
        raise VersionError("major", (major, minor))
    lo, hi = (speaks()[1], speaks()[1]) if _strict else accepted_minors()
    if minor < lo:
        raise VersionError("minor_too_old", (major, minor))
    if minor > hi:
        raise VersionError("minor_too_new", (major, minor))
    return (major, minor)


def is_test_next() -> bool:
    """True in a test build that speaks the next minor (extra fields and message types)."""
    return _test_next


def set_test_next(enabled: bool) -> None:
    """Speak the next minor (tests and the ``SHEPHERD_TEST_WIRE_NEXT`` build only)."""
    global _test_next
    _test_next = enabled


def is_strict() -> bool:
    """True under the test-only fault ``STRICT_WIRE`` (``shepherd.mesh.faults``): decoding as builds before
    versioning did (exactly this version, no unknown message type, no extra field), so that the
    rolling-upgrade scenario can show it would fail without the rule."""
    return _strict


def set_strict(enabled: bool) -> None:
    global _strict
    _strict = enabled


def enable_test_next_from_env() -> bool:
    """``set_test_next`` from ``SHEPHERD_TEST_WIRE_NEXT=1`` (called once at the node's start-up)."""
    on = os.environ.get(TEST_NEXT_ENV, "") == "1"
    set_test_next(on)
    return on
