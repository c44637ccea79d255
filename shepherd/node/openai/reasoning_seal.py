"""A reasoning item's ``encrypted_content`` (``include: ["reasoning.encrypted_content"]``): its text
sealed for the client to send back in a later turn's ``input``, where it is opened into the item's
text, which the template renders as the model's past reasoning. This is what lets ``store: false``
agents keep their reasoning across turns: Codex CLI sends the item back whole, but the Vercel AI SDK,
pydantic-ai and others keep only the blob and the summary (empty here: the models behind this gateway
write no summary), so without a blob that opens, their reasoning would be lost between tool calls.

A blob is ``shp1.`` then base64url (unpadded) of ``nonce (12 bytes) | AES-GCM(zlib(text))``; the
associated data names the format, the mesh's cluster and the caller's owner (the tenant's subject when
auth is on), so that one tenant's blob does not open for another. Keys: HKDF-SHA256 of each key of the
mesh's keyring, so that any node of the mesh opens what another sealed; the primary seals, every key
opens (a blob outlives a keyring rotation as long as its key stays in the ring), and a blob and a sealed
mesh packet never open as one another (keys of their own). ``reasoning_keyring_file`` gives the keys
instead (the same file format), for a node whose blobs must open after its restart or on plain nodes
behind one load balancer. A node with neither seals under a key of its process: its blobs open there
only. Not a secret from the client, who has the text in ``content`` too (and may send any text there):
what the seal gives is that a blob opens only as a node of this mesh made it, so a damaged or foreign
one is told apart, never rendered as garbage.

``open`` gives None for a blob that does not open (another server's, such as OpenAI's; a key rotated
out; another node without a mesh; tampered): the caller ignores it, as SMG ignores a foreign blob,
rather than refusing the turn (vLLM's 400), so that an agent that comes from another server keeps its
session, with the item's text or summary.
"""

from __future__ import annotations

import base64
import binascii
import os
import zlib
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = ["PREFIX", "ReasoningSeal"]

PREFIX = "shp1."
_INFO = b"shepherd reasoning encrypted_content v1"
_NONCE = 12
_TAG = 16


def _derive(key: bytes) -> AESGCM:
    return AESGCM(HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_INFO).derive(key))


class ReasoningSeal:
    """Seals reasoning text into an opaque blob and opens such blobs (module doc)."""

    __slots__ = ("_aad", "_ciphers", "_max_bytes")

    def __init__(self, keys: Sequence[bytes], *, cluster: str = "", max_chars: int = 4 << 20) -> None:
        if not keys:
            raise ValueError("a reasoning seal needs at least one key")
        self._ciphers = [_derive(bytes(k)) for k in keys]
        self._aad = PREFIX.encode() + cluster.encode("utf-8")
        self._max_bytes = 4 * max_chars  # (UTF-8: 4 bytes a character at most)

    @classmethod
    def ephemeral(cls) -> ReasoningSeal:
        """A seal under a fresh key of this process (a node without a mesh)."""
        return cls([os.urandom(32)])

    def _aad_of(self, owner: str | None) -> bytes:
        return self._aad if not owner else self._aad + b"\x00" + owner.encode("utf-8")

    def seal(self, text: str, owner: str | None = None) -> str:
        """``text`` sealed for ``owner`` (the caller's owner; None: auth is off)."""
        nonce = os.urandom(_NONCE)
        sealed = self._ciphers[0].encrypt(nonce, zlib.compress(text.encode("utf-8")), self._aad_of(owner))
        return PREFIX + base64.urlsafe_b64encode(nonce + sealed).rstrip(b"=").decode("ascii")

    def open(self, blob: str, owner: str | None = None) -> str | None:
        """The text ``blob`` seals, or None when it is not one of this mesh's blobs sealed for
        ``owner``."""
        if not blob.startswith(PREFIX):
            return None
        body = blob[len(PREFIX) :]
        try:
            raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        except (binascii.Error, ValueError):
            return None
        if len(raw) < _NONCE + _TAG:
            return None
        nonce, sealed = raw[:_NONCE], raw[_NONCE:]
        aad = self._aad_of(owner)
        for cipher in self._ciphers:
            try:
                packed = cipher.decrypt(nonce, sealed, aad)
            except InvalidTag:
                continue
            try:  # (ours, so well-formed; bounded all the same)
                inflate = zlib.decompressobj()
                data = inflate.decompress(packed, self._max_bytes)
                if inflate.unconsumed_tail or not inflate.eof:
                    return None
                return data.decode("utf-8")
            except (zlib.error, UnicodeDecodeError):
                return None
        return None
