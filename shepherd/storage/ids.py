"""Record ids as OpenAI shapes them (``resp_``, ``conv_``, ``msg_``, ``fc_``, ``rs_`` ... + hex) that
also name the node owning the record: with an embedded backend in a mesh, any node learns from an id
which node to ask for it (docs/DESIGN.md §12).

An id is ``prefix`` + 8 hex digits of the owner's tag + 40 random hex digits. The tag is the first 4
bytes of SHA-256 of the owner node's mesh name; ``tag_of`` reads it back (None: not one of our ids,
e.g. a record SMG stored in a shared database).
"""

from __future__ import annotations

import hashlib
import os
import re

TAG_HEX = 8
_RANDOM_BYTES = 20
_ID_RE = re.compile(r"^([a-z]+)_([0-9a-f]{8})([0-9a-f]{40})$")


def node_tag(node_name: str) -> str:
    """The 8-hex-digit tag of a node (by its mesh name)."""
    return hashlib.sha256(node_name.encode()).hexdigest()[:TAG_HEX]


def new_id(prefix: str, tag: str) -> str:
    """A fresh id: ``prefix`` (without its ``_``) + ``_`` + ``tag`` + 40 random hex digits."""
    if len(tag) != TAG_HEX:
        raise ValueError(f"an owner tag has {TAG_HEX} hex digits, not {tag!r}")
    return f"{prefix}_{tag}{os.urandom(_RANDOM_BYTES).hex()}"


def tag_of(record_id: str) -> str | None:
    """The owner tag an id carries (None: not an id this scheme made)."""
    m = _ID_RE.match(record_id)
    return m.group(2) if m else None


def prefix_of(record_id: str) -> str | None:
    m = _ID_RE.match(record_id)
    return m.group(1) if m else None
