"""The grpcio transport's channel reconnects as the lean client does: its back-off capped at a few
seconds (gRPC's default grows to 120 s, so an engine back from a long outage waited minutes)."""

from __future__ import annotations

from shepherd.node.engines.backoff import Backoff
from shepherd.node.engines.grpcio import CHANNEL_OPTIONS


def test_reconnect_backoff_is_capped_like_the_lean_clients() -> None:
    opts = dict(CHANNEL_OPTIONS)
    assert opts["grpc.max_reconnect_backoff_ms"] <= Backoff().maximum * 1000
    assert opts["grpc.initial_reconnect_backoff_ms"] <= opts["grpc.max_reconnect_backoff_ms"]
    assert opts["grpc.min_reconnect_backoff_ms"] <= opts["grpc.initial_reconnect_backoff_ms"]
