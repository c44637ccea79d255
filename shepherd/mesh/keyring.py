"""AES-GCM sealing of mesh UDP packets under a rotating keyring.

Wire format of a sealed packet (``OVERHEAD`` = 29 bytes over the plaintext)::

    version (1 byte) | nonce (12 random bytes) | ciphertext | GCM tag (16 bytes)

The associated data is the version byte followed by the cluster name (UTF-8), so a packet sealed
for another cluster or under another format version does not open even with the same key.

Rotation works as in memberlist: a keyring holds several keys; the *primary* seals, every key is
tried to open (primary first). To rotate, add the new key on every node, make it primary on every
node, then remove the old key. A packet that is truncated, tampered with, plaintext, of an unknown
version or sealed under a key the ring does not hold raises ``SealError`` (one exception type for
all of them: the caller drops the packet and counts it).

Replays of a *valid* packet are not detected here: SWIM messages carry sequence numbers and
incarnations and are idempotent, so a replayed probe or gossip is harmless.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

__all__ = [
    "KEY_SIZES",
    "NONCE_SIZE",
    "OVERHEAD",
    "TAG_SIZE",
    "VERSION",
    "Keyring",
    "KeyringError",
    "SealError",
    "generate_key",
    "load_keyring",
]

VERSION = 1
NONCE_SIZE = 12
TAG_SIZE = 16
OVERHEAD = 1 + NONCE_SIZE + TAG_SIZE
KEY_SIZES = (16, 24, 32)
_HEADER = 1 + NONCE_SIZE


class SealError(Exception):
    """A packet could not be opened (truncated, tampered, unknown version or key, plaintext)."""


class KeyringError(ValueError):
    """Bad key material or a keyring operation that would leave the ring unusable."""


def generate_key(size: int = 32) -> bytes:
    """A fresh random AES key of ``size`` bytes (16, 24 or 32)."""
    _check_key(bytes(size))
    return os.urandom(size)


def _check_key(key: bytes) -> None:
    if len(key) not in KEY_SIZES:
        raise KeyringError(f"AES keys are 16, 24 or 32 bytes, got {len(key)}")


def _decode_b64(text: str) -> bytes:
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError) as e:
        raise KeyringError(f"key is not valid base64: {e}") from None
    _check_key(key)
    return key


class Keyring:
    """Keys for sealing and opening mesh packets; the first key is the primary.

    Not thread-safe: it is meant to be owned by one event loop.
    """

    __slots__ = ("_aad", "_ciphers", "_keys")

    def __init__(self, keys: Sequence[bytes], *, cluster: str = "") -> None:
        if not keys:
            raise KeyringError("a keyring needs at least one key")
        self._keys: list[bytes] = []
        self._ciphers: list[AESGCM] = []
        for key in keys:
            key = bytes(key)
            _check_key(key)
            if key not in self._keys:
                self._keys.append(key)
                self._ciphers.append(AESGCM(key))
        self._aad = bytes([VERSION]) + cluster.encode("utf-8")

    # construction -----------------------------------------------------------------------------

    @classmethod
    def from_b64(cls, keys: Iterable[str], *, cluster: str = "") -> Keyring:
        """Keys given as base64 strings, the first one primary."""
        return cls([_decode_b64(k) for k in keys], cluster=cluster)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, cluster: str = "") -> Keyring:
        """Keys read from a file: one base64 key per line, the first primary; blank lines and
        lines starting with ``#`` are ignored."""
        lines = Path(path).read_text(encoding="ascii").splitlines()
        keys = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
        if not keys:
            raise KeyringError(f"no keys in {path}")
        return cls.from_b64(keys, cluster=cluster)

    @staticmethod
    def format_file(keys: Sequence[bytes]) -> str:
        """The text of a key file holding ``keys`` (first primary)."""
        for key in keys:
            _check_key(key)
        return "".join(base64.b64encode(k).decode("ascii") + "\n" for k in keys)

    # inspection -------------------------------------------------------------------------------

    @property
    def primary(self) -> bytes:
        return self._keys[0]

    @property
    def keys(self) -> tuple[bytes, ...]:
        return tuple(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:  # never print key material
        return f"Keyring(keys={len(self._keys)})"

    # rotation ---------------------------------------------------------------------------------

    def add_key(self, key: bytes) -> None:
        """Accept packets sealed under ``key`` (still sealing with the current primary)."""
        key = bytes(key)
        _check_key(key)
        if key not in self._keys:
            self._keys.append(key)
            self._ciphers.append(AESGCM(key))

    def use_key(self, key: bytes) -> None:
        """Make ``key`` (added before) the primary: new packets are sealed under it."""
        key = bytes(key)
        try:
            i = self._keys.index(key)
        except ValueError:
            raise KeyringError("use_key: the key is not in the keyring (add it first)") from None
        self._keys.insert(0, self._keys.pop(i))
        self._ciphers.insert(0, self._ciphers.pop(i))

    def remove_key(self, key: bytes) -> None:
        """Stop accepting ``key``. The primary cannot be removed."""
        key = bytes(key)
        if key == self._keys[0]:
            raise KeyringError("remove_key: cannot remove the primary key (use_key another first)")
        try:
            i = self._keys.index(key)
        except ValueError:
            return
        del self._keys[i]
        del self._ciphers[i]

    # sealing ----------------------------------------------------------------------------------

    def seal(self, plaintext: bytes) -> bytes:
        """Encrypt and authenticate ``plaintext`` under the primary key."""
        nonce = os.urandom(NONCE_SIZE)
        return self._aad[:1] + nonce + self._ciphers[0].encrypt(nonce, plaintext, self._aad)

    def open(self, packet: bytes) -> bytes:
        """Authenticate and decrypt a sealed packet with any key of the ring, or raise ``SealError``."""
        if len(packet) < OVERHEAD:
            raise SealError("packet too short")
        if packet[0] != VERSION:
            raise SealError(f"unknown packet version {packet[0]}")
        nonce = packet[1:_HEADER]
        body = packet[_HEADER:]
        for cipher in self._ciphers:
            try:
                return cipher.decrypt(nonce, body, self._aad)
            except InvalidTag:
                continue
        raise SealError("no key of the keyring opens the packet")


def load_keyring(
    *, path: str | os.PathLike[str] | None = None, keys_b64: Sequence[str] = (), cluster: str = ""
) -> Keyring:
    """A keyring from a key file and/or base64 keys from config (file keys first, file primary)."""
    keys: list[bytes] = []
    if path is not None:
        keys.extend(Keyring.from_file(path).keys)
    keys.extend(_decode_b64(k) for k in keys_b64)
    if not keys:
        raise KeyringError("no mesh keys configured (a key file or keys are required)")
    return Keyring(keys, cluster=cluster)
