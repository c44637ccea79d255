"""Index replication that does not grow with the fleet, on a node: the models a node routes in its SWIM
metadata (``index_scope``), a model's deltas sent only to the members routing it, the
``--mesh-index-replication`` modes (auto: workers with a live KV-event stream are quiet; none; all),
and the setting's validation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest

from shepherd.mesh.index_scope import (
    MAX_MODELS,
    IndexScope,
    control_authenticated,
    model_key,
    routed_keys,
    routes_meta,
)
from shepherd.mesh.state import MeshState
from shepherd.mesh.state_types import MeshStateConfig
from shepherd.node.cli import config_from_args
from shepherd.node.cluster.mesh_node import MeshNode
from shepherd.node.config import ConfigError, build_config
from shepherd.node.dispatch.gateway import Gateway
from shepherd.policies.prefix_replica_native import make_replica
from shepherd.proto.mesh_messages import MAX_META_LEN, Member, MemberState


def test_metadata_names_the_models_a_node_routes() -> None:
    meta = routes_meta(["llama", "qwen", "llama"])
    assert len(meta) <= MAX_META_LEN
    assert routed_keys(meta) == frozenset({model_key("llama"), model_key("qwen")})
    scope = IndexScope()
    assert scope.routes(meta, "qwen") and not scope.routes(meta, "mistral")
    assert scope.models_for(meta, ["mistral", "qwen"]) == ["qwen"]
    none = routes_meta([])  # routes nothing with an index: no index deltas
    assert routed_keys(none) == frozenset() and not scope.routes(none, "llama")
    # a member that does not say (an older node, other metadata, garbage, too many models) gets all
    many = routes_meta(f"m{i}" for i in range(MAX_MODELS + 1))
    assert len(many) <= MAX_META_LEN
    for meta in (b"", b"\xc1", msgpack.packb({"other": 1}), msgpack.packb({"ix": b"abc"}), many):
        assert routed_keys(meta) is None and scope.routes(meta, "llama")
    assert len(routes_meta(f"m{i}" for i in range(MAX_MODELS))) <= MAX_META_LEN


@dataclass
class FakeRuntime:
    members: list[Member]
    sent: dict[str, list[bytes]] = field(default_factory=dict)
    running: bool = True

    @property
    def swim(self) -> FakeRuntime:
        return self

    def alive_members(self) -> list[Member]:
        return self.members

    def send_user(self, dest: tuple[str, int], payloads: Sequence[bytes]) -> int:
        name = next(m.name for m in self.members if m.addr == dest)
        self.sent.setdefault(name, []).extend(payloads)
        return len(payloads)


@dataclass
class FakeWorker:
    id: str
    model: str


@dataclass
class FakeFeed:
    live_workers: set[str]

    def live(self, worker: str) -> bool:
        return worker in self.live_workers


@dataclass
class FakeRegistry:
    workers: dict[str, FakeWorker]


@dataclass
class FakeGateway:
    registry: FakeRegistry
    kv_feed: FakeFeed


def node(tmp_path: Path, mode: str, **extra: object) -> MeshNode:
    cfg = build_config(
        {},
        {
            "tokenizer_workers": 0,
            "model_id": "m",
            "policy": "cache_aware",
            "mesh_port": 0,
            "mesh_name": "a",
            "mesh_dev_pki": str(tmp_path),
            "mesh_index_replication": mode,
            **extra,
        },
    )
    return MeshNode(cfg, Gateway(cfg))


def member(name: str, meta: bytes) -> Member:
    return Member(name, "127.0.0.1", 10_000 + ord(name[0]), 1, MemberState.ALIVE, meta)


def decoded_models(payloads: list[bytes]) -> list[str]:
    out = []
    for p in payloads:
        _, tag, body = msgpack.unpackb(p, raw=False)
        if tag == "i":
            out.append(body[0])
    return out


def test_a_models_deltas_go_only_to_the_members_routing_it(tmp_path: Path) -> None:
    n = node(tmp_path, "all")
    assert n.routed_models == ["m"]
    other = n.state.index("other")  # a model this node indexes too (e.g. from a peer's payload)
    n.state.index("m").insert(list(range(320)), "w1", n.clock())
    other.insert(list(range(500, 820)), "w9", n.clock())
    rt = FakeRuntime(
        [
            member("a", routes_meta(["m"])),  # itself: skipped
            member("b", routes_meta(["m"])),
            member("c", routes_meta(["other"])),
            member("d", routes_meta([])),  # routes nothing with an index
            member("e", b""),  # says nothing: everything
        ]
    )
    n.runtime = rt  # type: ignore[assignment]
    assert n.flush_index() > 0
    assert sorted(rt.sent) == ["b", "c", "e"]  # d got nothing at all (no owned deltas pending)
    assert decoded_models(rt.sent["b"]) == ["m"]
    assert decoded_models(rt.sent["c"]) == ["other"]
    assert sorted(decoded_models(rt.sent["e"])) == ["m", "other"]


def test_auto_quiets_the_workers_with_a_live_kv_stream_and_none_quiets_all(tmp_path: Path) -> None:
    n = node(tmp_path, "auto")
    ix = n.state.index("m")
    fake: Any = FakeGateway(
        FakeRegistry({"w1": FakeWorker("w1", "m"), "w2": FakeWorker("w2", "m"), "x": FakeWorker("x", "z")}),
        FakeFeed({"w1", "x"}),
    )
    n.gw = fake
    n.sync_index_quiet()
    assert ix.quiet_workers == {"w1"}
    ix.insert(list(range(320)), "w1", n.clock())  # the engine's events tell every node: not sent
    assert ix.take_groups() == []
    ix.insert(list(range(320)), "w2", n.clock())  # no live stream: sent
    assert [w for w, _, _ in ix.take_groups()] == ["w2"]
    fake.kv_feed.live_workers = set()  # w1's stream broke: its decisions are sent again
    n.sync_index_quiet()
    assert ix.quiet_workers == frozenset()
    n.index_replication = "none"
    n.sync_index_quiet()
    assert ix.quiet_workers == {"w1", "w2"}
    n.index_replication = "all"
    n.sync_index_quiet()
    assert ix.quiet_workers == frozenset()


def test_none_sends_no_index_deltas(tmp_path: Path) -> None:
    n = node(tmp_path, "none")
    ix = n.state.index("m")
    ix.queue_repair({"w1": {0}})  # nothing held: nothing queued
    ix.insert(list(range(320)), "w1", n.clock())  # before the first tick: buffered, then dropped
    rt = FakeRuntime([member("b", routes_meta(["m"]))])
    n.runtime = rt  # type: ignore[assignment]
    n.flush_index()
    assert decoded_models(rt.sent.get("b", [])) == [] and n.index_deltas_dropped == 1
    assert ix.pending == 0


def test_ends_sends_one_turn_end_per_decision_and_no_blocks(tmp_path: Path) -> None:
    n = node(tmp_path, "ends")
    ix = n.state.index("m")
    fake: Any = FakeGateway(
        FakeRegistry({"w1": FakeWorker("w1", "m"), "w2": FakeWorker("w2", "m")}), FakeFeed({"w1"})
    )
    n.gw = fake
    n.sync_index_quiet()
    assert ix.quiet_workers == ix.turn_workers == {"w1", "w2"}  # with or without a live KV stream
    ix.insert(list(range(320)), "w1", n.clock())
    ix.insert(list(range(1000, 1640)), "w2", n.clock())
    rt = FakeRuntime([member("b", routes_meta(["m"])), member("c", routes_meta(["other"]))])
    n.runtime = rt  # type: ignore[assignment]
    assert n.flush_index() == 1 and list(rt.sent) == ["b"]  # scoped as the blocks are
    (p,) = rt.sent["b"]
    _, tag, body = msgpack.unpackb(p, raw=False)
    assert tag == "t" and body[2] == ["w1", "w2"] and len(body[3]) == 2  # two records, no "i" payload
    peer = MeshState("b", n.clock, MeshStateConfig(), new_index=make_replica)
    peer.apply(p, "a")
    assert peer.index("m").match(list(range(320)) + [7] * 40) == {"w1": 320}
    n.index_replication = "all"
    n.sync_index_quiet()
    assert ix.quiet_workers == ix.turn_workers == frozenset()


def test_the_setting_is_validated(tmp_path: Path) -> None:
    assert build_config({}, {}).mesh_index_replication == "auto"
    assert build_config({"mesh_index_replication": "none"}, {}).mesh_index_replication == "none"
    with pytest.raises(ConfigError, match="mesh_index_replication 'some' is unknown"):
        build_config({"mesh_index_replication": "some"}, {})
    cfg = config_from_args(["serve", "--mesh-index-replication", "all"])
    assert cfg.mesh_index_replication == "all"
    assert config_from_args(["serve", "--mesh-index-replication", "ends"]).mesh_index_replication == "ends"
    with pytest.raises(SystemExit):
        config_from_args(["serve", "--mesh-index-replication", "sometimes"])
    assert build_config({}, {}).mesh_index_turn_ends == 1 << 23
    assert config_from_args(["serve", "--mesh-index-turn-ends", "4096"]).mesh_index_turn_ends == 4096
    with pytest.raises(ConfigError, match="mesh_index_turn_ends"):
        build_config({"mesh_index_turn_ends": 100}, {})


def test_the_turn_ends_kept_follow_the_setting(tmp_path: Path) -> None:
    n = node(tmp_path, "ends", mesh_index_turn_ends=4096)
    assert n.state.index("m").repl.turn_ends_max == 4096


def test_the_replicas_quiet_flag_survives_a_slot_reuse() -> None:
    state = MeshState("a", lambda: 1_800_000_000.0, new_index=make_replica)
    ix = state.index("m")
    ix.set_quiet("w", True)  # before it holds anything (no slot yet)
    ix.insert(list(range(320)), "w", 1_800_000_000.0)
    assert ix.take_groups() == [] and ix.worker_blocks("w") == 20
    ix.clear_worker("w")
    ix.insert(list(range(320)), "v", 1_800_000_000.0)  # another worker in the freed slot: not quiet
    assert [w for w, _, _ in ix.take_groups()] == ["v"]


def test_the_metadata_says_whether_the_control_plane_is_authenticated() -> None:
    assert control_authenticated(routes_meta(["m"], True)) is True
    assert control_authenticated(routes_meta(["m"], False)) is False
    assert control_authenticated(routes_meta(["m"])) is None  # a node of an older build says nothing
    assert control_authenticated(b"") is None and control_authenticated(b"\xc1junk") is None
    many = [f"model-{i}" for i in range(MAX_MODELS)]
    meta = routes_meta(many, True)
    assert len(meta) <= MAX_META_LEN and routed_keys(meta) is not None
