"""Test-only fault switches: environment variables a node reads once at start-up to break one thing on
purpose, so that the chaos suite can prove it sees the break (``python -m chaos.run --inject FAULT NAME``).
Never set them in production; a node that has one set logs a warning at start-up.

``SHEPHERD_FAULT_DISABLE_MESH=1``               the node ignores its ``--mesh-*`` flags and runs alone
``SHEPHERD_FAULT_DISABLE_RATELIMIT=1``          no admission: rate limits are not enforced at all
``SHEPHERD_FAULT_DISABLE_RATELIMIT_GOSSIP=1``   the limiter counts only this node's shard (never sent)
``SHEPHERD_FAULT_IGNORE_PARTITION_RULE=1``      the limiter's N counts only the members it reaches: each side
                                                of a partition admits the whole limit, not limit x R / N
``SHEPHERD_FAULT_DISABLE_INDEX_GOSSIP=1``       the prefix index is never sent to peers (deltas, joins)
``SHEPHERD_FAULT_DISABLE_REFUTATION=1``         SWIM: an accused node never refutes (stays suspect/dead)
``SHEPHERD_FAULT_STRICT_WIRE=1``                 the mesh wire decoded as before versioning: another minor, an
                                                unknown message type or field refused (``wire_version``)
"""

from __future__ import annotations

import os
from collections.abc import Mapping

PREFIX = "SHEPHERD_FAULT_"
DISABLE_MESH = "DISABLE_MESH"
DISABLE_RATELIMIT = "DISABLE_RATELIMIT"
DISABLE_RATELIMIT_GOSSIP = "DISABLE_RATELIMIT_GOSSIP"
IGNORE_PARTITION_RULE = "IGNORE_PARTITION_RULE"
DISABLE_INDEX_GOSSIP = "DISABLE_INDEX_GOSSIP"
DISABLE_REFUTATION = "DISABLE_REFUTATION"
STRICT_WIRE = "STRICT_WIRE"
KNOWN = (
    DISABLE_MESH,
    DISABLE_RATELIMIT,
    DISABLE_RATELIMIT_GOSSIP,
    IGNORE_PARTITION_RULE,
    DISABLE_INDEX_GOSSIP,
    DISABLE_REFUTATION,
    STRICT_WIRE,
)


def env_name(fault: str) -> str:
    """The environment variable of ``fault`` (one of ``KNOWN``)."""
    if fault not in KNOWN:
        raise ValueError(f"unknown fault {fault!r} (known: {', '.join(KNOWN)})")
    return PREFIX + fault


def injected(fault: str, environ: Mapping[str, str] | None = None) -> bool:
    """Is ``fault`` switched on (its variable set to ``1``)?"""
    env = os.environ if environ is None else environ
    return env.get(env_name(fault), "") == "1"


def active(environ: Mapping[str, str] | None = None) -> list[str]:
    """Every fault switched on (for the start-up warning)."""
    return [f for f in KNOWN if injected(f, environ)]
