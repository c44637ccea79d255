"""The node's history over the mesh: ``RoutedStore`` + ``RpcServer`` between three in-process memory stores
linked by a fake RPC channel (the mesh's ``RpcError`` reasons), retention, the key journal and the
history settings' checks."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import msgpack  # type: ignore[import-untyped]
import pytest

from shepherd.auth.keys import ApiKeyRecord, MemoryKeyStore, create_key
from shepherd.mesh.runtime import RpcError
from shepherd.node.api.common import History
from shepherd.node.cluster import history as history_mod
from shepherd.node.cluster.history import (
    OwnerGone,
    OwnerUnavailable,
    Retention,
    RoutedStore,
    build_history,
    cancel_on_peers,
)
from shepherd.node.cluster.key_journal import KIND, KeyJournal
from shepherd.node.config import ConfigError, NodeConfig, build_config
from shepherd.proto.openai_errors import ApiError
from shepherd.storage.ids import new_id, node_tag
from shepherd.storage.memory import MemoryStore
from shepherd.storage.types import (
    ChainError,
    IntegrityError,
    NotFound,
    StorageUnavailable,
    StoredConversation,
    StoredItem,
    StoredResponse,
)

Status = Literal["alive", "suspect", "dead", "left"]
Handler = Callable[[str, bytes], Awaitable[bytes]]


class Net:
    """The fake mesh: members, their states, their RPC handlers; ``fail`` makes RPCs to a name fail."""

    def __init__(self) -> None:
        self.status: dict[str, Status] = {}
        self.handlers: dict[str, Handler | None] = {}
        self.fail: set[str] = set()
        self.calls: list[tuple[str, str, str]] = []  # (from, to, method)


class FakeLink:
    def __init__(self, name: str, net: Net) -> None:
        self.name = name
        self.net = net
        net.status[name] = "alive"
        net.handlers.setdefault(name, None)

    async def rpc(self, name: str, payload: bytes, timeout: float | None = None) -> bytes:
        st = self.net.status.get(name)
        if st in (None, "dead", "left"):
            raise RpcError("unknown", f"no live member {name!r}")
        if st == "suspect":
            raise RpcError("suspect", f"{name!r} is suspected")
        if name in self.net.fail:
            raise RpcError("failed", f"rpc to {name!r}: connection refused")
        handler = self.net.handlers.get(name)
        if handler is None:
            raise RpcError("refused", "no rpc handler")
        self.net.calls.append((self.name, name, msgpack.unpackb(payload)["m"]))
        return await handler(self.name, payload)

    def set_rpc_handler(self, handler: Handler | None) -> None:
        self.net.handlers[self.name] = handler

    def member_status(self, name: str) -> Status | None:
        return self.net.status.get(name)

    def members(self) -> list[dict[str, Any]]:
        return [{"name": n, "state": s} for n, s in self.net.status.items()]


def mesh(*names: str) -> tuple[Net, dict[str, RoutedStore]]:
    net = Net()
    stores = {}
    for n in names:
        s = RoutedStore(MemoryStore(), FakeLink(n, net), max_chain_depth=100)
        s.install()
        stores[n] = s
    return net, stores


def msg(tag: str, text: str, now: float = 100.0, response_id: str | None = None) -> StoredItem:
    iid = new_id("msg", tag)
    data = {"type": "message", "id": iid, "role": "user", "content": [{"type": "input_text", "text": text}]}
    return StoredItem(iid, "message", data, now, response_id, "user", "completed")


def response(rid: str, prev: str | None, items: list[StoredItem], conv: str | None = None) -> StoredResponse:
    return StoredResponse(
        id=rid,
        created_at=100.0,
        model="m",
        body={"id": rid, "object": "response"},
        input_item_ids=tuple(i.id for i in items),
        previous_response_id=prev,
        conversation_id=conv,
    )


T = {n: node_tag(n) for n in ("a", "b", "c")}


async def test_conversation_made_on_a_is_read_and_appended_on_b_and_c() -> None:
    net, s = mesh("a", "b", "c")
    cid = new_id("conv", T["a"])
    await s["a"].create_conversation(StoredConversation(cid, 100.0, {"k": "v"}, "alice"), [msg(T["a"], "hi")])
    got = await s["b"].get_conversation(cid)
    assert got is not None and got.metadata == {"k": "v"} and got.owner == "alice"
    await s["b"].add_items(cid, [msg(T["a"], "from b", 101.0)])
    await s["c"].add_items(cid, [msg(T["a"], "from c", 102.0)])
    page = await s["c"].list_items(cid, limit=10, order="asc")
    assert [i.data["content"][0]["text"] for i in page.items] == ["hi", "from b", "from c"]
    assert not page.has_more
    first = await s["b"].list_items(cid, limit=2, order="desc")
    assert first.has_more and [i.data["content"][0]["text"] for i in first.items] == ["from c", "from b"]
    rest = await s["b"].list_items(cid, after=first.items[-1].id, limit=2, order="desc")
    assert [i.data["content"][0]["text"] for i in rest.items] == ["hi"]
    one = page.items[1]
    assert await s["c"].get_item(cid, one.id) == one
    assert await s["c"].delete_item(cid, one.id)
    assert await s["b"].get_item(cid, one.id) is None
    updated = await s["c"].update_conversation(cid, {"x": "y"})
    assert updated is not None and updated.metadata == {"x": "y"}
    # everything lives on a: b and c hold nothing
    assert await s["b"].local.get_conversation(cid) is None
    assert await s["c"].local.get_conversation(cid) is None
    with pytest.raises(NotFound):
        await s["b"].add_items(new_id("conv", T["a"]), [msg(T["a"], "x")])
    with pytest.raises(IntegrityError):
        await s["c"].add_items(cid, [page.items[0]])
    assert await s["b"].delete_conversation(cid)
    assert await s["c"].get_conversation(cid) is None
    assert {(f, t) for f, t, _ in net.calls} == {("b", "a"), ("c", "a")}


async def test_owner_gone_is_not_found_and_suspect_or_failed_is_unavailable() -> None:
    net, s = mesh("a", "b")
    cid = new_id("conv", T["a"])
    await s["a"].create_conversation(StoredConversation(cid, 100.0))
    net.status["a"] = "suspect"
    with pytest.raises(OwnerUnavailable) as un:
        await s["b"].get_conversation(cid)
    # the owner's trouble is not this node's store down: its other turns are not refused for it (a
    # chain held by a suspected node used to refuse every stored turn on the node for a second)
    hist = History(s["b"], T["b"])
    hist.store_failed(un.value)
    hist.refuse_while_down()
    hist.store_failed(StorageUnavailable("this node's own store"))
    with pytest.raises(ApiError) as refused:
        hist.refuse_while_down()
    assert refused.value.status == 503
    net.status["a"] = "alive"
    net.fail.add("a")
    with pytest.raises(OwnerUnavailable):
        await s["b"].list_items(cid)
    net.fail.clear()
    assert await s["b"].get_conversation(cid) is not None
    gone: Status
    for gone in ("dead", "left"):
        net.status["a"] = gone
        with pytest.raises(OwnerGone) as e:
            await s["b"].get_conversation(cid)
        assert isinstance(e.value, NotFound) and "'a'" in str(e.value)
    with pytest.raises(OwnerGone):  # a tag no member has (a node that never joined, or was reaped)
        await s["b"].get_response(new_id("resp", node_tag("zz")))
    # an id without an owner tag (a record another gateway wrote) is looked up locally
    assert await s["b"].get_response("resp_foreign") is None


async def test_chain_spanning_owners_with_depth_bound_and_items() -> None:
    _, s = mesh("a", "b", "c")
    chain: list[str] = []
    items: list[StoredItem] = []
    prev = None
    for owner in ("a", "b", "c", "a", "b"):  # each turn on another node
        rid = new_id("resp", T[owner])
        it = msg(T[owner], f"turn {len(chain)}", response_id=rid)
        await s["c"].put_response(response(rid, prev, [it]), [it])  # c routes each to its owner
        assert await s[owner].local.get_response(rid) is not None
        chain.append(rid)
        items.append(it)
        prev = rid
    got = await s["c"].get_chain(chain[-1], 100)
    assert [r.id for r in got] == chain
    # the newest whole, the others (each owner's newest included) without their bodies: ids and items
    assert got[-1].body and not any(r.body for r in got[:-1])
    assert [r.input_item_ids for r in got] == [(i.id,) for i in items]
    got = await s["a"].get_chain(chain[2], 100)
    assert [r.id for r in got] == chain[:3]
    assert [r.id for r in await s["b"].get_chain(chain[-1], 5)] == chain
    with pytest.raises(ChainError):
        await s["b"].get_chain(chain[-1], 4)
    with pytest.raises(ChainError):
        await s["b"].get_chain(chain[-1], 2)
    # the chain's items, fetched where their responses live (client-given ids carry no tag)
    got_items = await s["a"].get_items([i.id for i in items] + ["msg_missing"])
    assert [i.id for i in got_items] == [i.id for i in items]
    # an unknown start: empty; a link to a response nobody holds ends the walk
    assert await s["a"].get_chain(new_id("resp", T["b"]), 10) == []
    dangling = new_id("resp", T["c"])
    rid = new_id("resp", T["b"])
    await s["b"].put_response(response(rid, dangling, []), [])
    assert [r.id for r in await s["a"].get_chain(rid, 10)] == [rid]


async def test_chain_owner_gone_midway_is_an_error_not_a_short_history() -> None:
    net, s = mesh("a", "b")
    r1 = new_id("resp", T["a"])
    r2 = new_id("resp", T["b"])
    await s["a"].put_response(response(r1, None, []), [])
    await s["b"].put_response(response(r2, r1, []), [])
    net.status["a"] = "dead"
    with pytest.raises(OwnerGone):
        await s["b"].get_chain(r2, 10)


async def test_chain_cycle_across_owners() -> None:
    _, s = mesh("a", "b")
    r1 = new_id("resp", T["a"])
    r2 = new_id("resp", T["b"])
    await s["a"].put_response(response(r1, r2, []), [])
    await s["b"].put_response(response(r2, r1, []), [])
    with pytest.raises(ChainError, match="loops"):
        await s["a"].get_chain(r2, 100)
    with pytest.raises(ChainError, match="loops"):
        await s["b"].get_chain(r1, 100)


async def test_response_in_a_conversation_is_stored_by_the_conversation_owner() -> None:
    _, s = mesh("a", "b")
    cid = new_id("conv", T["a"])
    await s["b"].create_conversation(StoredConversation(cid, 100.0))  # routed: a owns it by its id
    assert await s["a"].local.get_conversation(cid) is not None
    rid = new_id("resp", T["a"])  # History.new_id("resp", owner_tag=tag_of(cid)) on b
    it = msg(T["a"], "q", response_id=rid)
    await s["b"].put_response(response(rid, None, [it], conv=cid), [it], cid)
    page = await s["b"].list_items(cid)
    assert [i.id for i in page.items] == [it.id]
    got = await s["b"].get_response(rid)
    assert got is not None and got.conversation_id == cid
    assert await s["b"].update_response(StoredResponse.from_dict({**got.to_dict(), "status": "cancelled"}))
    again = await s["b"].get_response(rid)
    assert again is not None and again.status == "cancelled"
    # the owner keeps an end another writer stored: a running_only update over the mesh says so
    done = StoredResponse.from_dict({**got.to_dict(), "status": "completed"})
    assert await s["b"].update_response(done, running_only=True) is False
    assert (await s["a"].get_response(rid)).status == "cancelled"  # type: ignore[union-attr]
    assert await s["b"].delete_response(rid)
    assert await s["a"].get_response(rid) is None


async def test_cancel_reaches_the_node_that_runs_the_response_whatever_its_id_names() -> None:
    net, s = mesh("a", "b", "c")
    cancelled: list[tuple[str, str]] = []

    def registry(node: str, running: set[str]) -> Callable[[str], Awaitable[bool]]:
        async def cancel(rid: str) -> bool:
            if rid in running:
                cancelled.append((node, rid))
                return True
            return False

        return cancel

    # c runs a response whose id names a (a response stored in a's conversation)
    rid = new_id("resp", T["a"])
    s["a"].server.cancel_handler = registry("a", set())
    s["c"].server.cancel_handler = registry("c", {rid})
    links = {n: s[n].link for n in s}
    assert await cancel_on_peers(links["b"], rid)
    assert cancelled == [("c", rid)]
    assert not await cancel_on_peers(links["b"], new_id("resp", T["b"]))  # nobody runs it
    net.status["c"] = "suspect"  # only alive members are asked
    assert not await cancel_on_peers(links["b"], rid)
    assert cancelled == [("c", rid)]


async def test_rpc_server_checks_what_comes_from_the_wire() -> None:
    net, s = mesh("a", "b")
    server = s["a"].server
    cid = new_id("conv", T["a"])
    await s["a"].create_conversation(StoredConversation(cid, 100.0))

    async def call(obj: Any, raw: bytes | None = None) -> dict[str, Any]:
        out: dict[str, Any] = msgpack.unpackb(await server.handle("b", raw or msgpack.packb(obj)))
        return out

    assert (await call({"m": "get_conversation", "a": {"id": cid}}))["ok"]["id"] == cid
    bad = [
        {"m": "put_record", "a": {"kind": "api_key", "key": "k", "value": b"x"}},  # never over the wire
        {"m": "purge", "a": {"older_than": 1e12}},
        {"m": "__init__", "a": {}},
        {"m": "get_conversation", "a": {"id": new_id("conv", T["b"])}},  # not ours
        {"m": "get_conversation", "a": {"id": "conv_x\n"}},
        {"m": "get_conversation", "a": {"id": cid + "\n"}},  # ours, but for the line break
        {"m": "get_conversation", "a": {"id": 5}},
        {"m": "list_items", "a": {"id": cid, "limit": 10**9, "order": "asc"}},
        {"m": "list_items", "a": {"id": cid, "limit": 10, "order": "sideways"}},
        {"m": "get_chain", "a": {"id": new_id("resp", T["a"]), "max_depth": 10**6}},
        {"m": "add_items", "a": {"id": cid, "items": [{"id": "msg_1", "type": "message", "data": []}]}},
        {"m": "add_items", "a": {"id": cid, "items": "no"}},
        {"m": "update_conversation", "a": {"id": cid, "metadata": {"k": 1}}},
        ["not", "a", "map"],
    ]
    for obj in bad:
        assert (await call(obj))["err"] == "bad", obj
    assert (await call(None, b"\xc1garbage"))["err"] == "bad"
    assert (await call({"m": "add_items", "a": {"id": new_id("conv", T["a"]), "items": []}}))["err"] == (
        "not_found"
    )
    assert server.refused == len(bad) + 1
    assert (await s["a"].get_conversation(cid)) is not None and not net.calls


async def test_rpc_bodies_decode_within_bounds_with_the_loop_running() -> None:
    """What a peer sends decodes within ``REQUEST_LIMITS`` (more than an array or map per 8 bytes, or
    any bytes, is refused before the call), a slice at a time with the loop running between (a body can
    be MBs); a member's reply the same way (``REPLY_LIMITS``)."""
    net, s = mesh("a", "b")
    server = s["a"].server
    cid = new_id("conv", T["a"])
    await s["a"].create_conversation(StoredConversation(cid, 100.0))

    async def call(obj: Any) -> dict[str, Any]:
        out: dict[str, Any] = msgpack.unpackb(await server.handle("b", msgpack.packb(obj)))
        return out

    get = {"m": "get_conversation", "a": {"id": cid}}
    refused = server.refused
    junks: list[Any] = [[[]] * 200_000, [{}] * 200_000, b"x"]
    for junk in junks:  # 200 KB of empty arrays: 200,000 lists
        out = await call({**get, "junk": junk})
        assert out["err"] == "bad" and "msgpack" in out["msg"], out
    assert server.refused == refused + 3
    # a legitimate large write (~2 MB, many slices) goes through, and the loop ran while it decoded
    items = [msg(T["a"], f"turn {i} " + "x" * 150) for i in range(10_000)]
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        for _ in range(10_000):  # (bounded: cancelled once the call is answered)
            ticks += 1
            await asyncio.sleep(0)

    ticker = asyncio.get_running_loop().create_task(tick())
    await asyncio.sleep(0)
    before = ticks
    out = await call({"m": "add_items", "a": {"id": cid, "items": [i.to_dict() for i in items]}})
    during = ticks - before
    ticker.cancel()
    assert out == {"ok": None} and during > 1
    assert (await s["a"].list_items(cid, limit=1)).items[0].id == items[0].id

    # a reply of empty arrays from the owner: unreadable (503), not decoded
    async def hostile(peer: str, payload: bytes) -> bytes:
        return bytes(msgpack.packb({"ok": [[]] * 200_000}))

    net.handlers["a"] = hostile
    with pytest.raises(StorageUnavailable, match="unreadable"):
        await s["b"].get_conversation(cid)


async def test_a_lease_lives_with_its_conversation_on_the_owners_clock() -> None:
    """b's turn on a's conversation claims its lease on a (routed); a peer's lease keeps its length on
    the owner's clock, and a peer cannot send a lease that never ends or one of another owner's."""
    net, s = mesh("a", "b")
    cid = new_id("conv", T["a"])
    name = f"conversation:{cid}"
    r1, r2 = new_id("resp", T["a"]), new_id("resp", T["a"])
    assert await s["b"].claim(name, r1, 1e9 + 60, 1e9)  # b's clock far behind a's: 60 s on a's
    assert net.calls  # (routed to a)
    assert not await s["a"].claim(name, r2, time.time() + 60, time.time())
    assert await s["a"].release(name, r1)
    server = s["a"].server

    async def call(args: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = msgpack.unpackb(
            await server.handle("b", msgpack.packb({"m": "claim", "a": args}))
        )
        return out

    for bad in (
        {"name": name, "holder": r2, "until": float("inf"), "now": 0.0},
        {"name": name, "holder": r2, "until": float("nan"), "now": 0.0},
        {"name": name, "holder": r2, "until": 5.0, "now": 10.0},
        {"name": f"conversation:{new_id('conv', T['b'])}", "holder": r2, "until": 60.0, "now": 0.0},
        {"name": "conversation", "holder": r2, "until": 60.0, "now": 0.0},
        {"name": name, "holder": "x\n", "until": 60.0, "now": 0.0},
    ):
        assert (await call(bad))["err"] == "bad", bad
    assert (await call({"name": name, "holder": r2, "until": 60.0, "now": 0.0}))["ok"] is True


async def test_a_missed_end_is_sent_again_once_the_owner_is_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """b runs a background turn on a's conversation; it ends while a is dead (a killed; its backend on disk
    keeps the record): the end fails, and once a is alive again (restarted, same name) b sends it again, so
    the record read on a is not in progress for good (only b knows how it ended)."""
    monkeypatch.setattr(history_mod, "RETRY_S", 0.01, raising=False)
    net, s = mesh("a", "b")
    cid = new_id("conv", T["a"])
    await s["a"].create_conversation(StoredConversation(cid, 100.0))
    r1 = new_id("resp", T["a"])
    running = dataclasses.replace(response(r1, None, [], cid), status="in_progress")
    await s["b"].put_response(running, [], cid)
    net.status["a"] = "dead"
    ended = dataclasses.replace(running, status="failed", body={"id": r1, "status": "failed"})
    with pytest.raises(OwnerGone):
        await s["b"].update_response(ended, [], running_only=True)
    net.status["a"] = "suspect"
    with pytest.raises(StorageUnavailable):  # (a second miss: one pending write still)
        await s["b"].update_response(ended, [], running_only=True)
    net.status["a"] = "alive"
    for _ in range(500):  # bounded poll: the retry runs every RETRY_S
        got = await s["a"].get_response(r1)
        if got is not None and got.status == "failed":
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError("the end of the turn was never stored on its owner")
    await s["b"].close()
    assert s["b"]._retry_task is None


async def test_retention_purges_the_local_backend_only() -> None:
    _, s = mesh("a", "b")
    old = new_id("conv", T["a"])
    await s["a"].create_conversation(StoredConversation(old, 1000.0))
    new = new_id("conv", T["a"])
    await s["a"].create_conversation(StoredConversation(new, 1000.0 + 86400 * 10))
    r = Retention(s["a"], 5, clock=lambda: 1000.0 + 86400 * 10)
    assert await r.run_once() == 1
    assert await s["b"].get_conversation(old) is None
    assert await s["b"].get_conversation(new) is not None


async def test_key_journal_keeps_keys_across_a_restart() -> None:
    records = MemoryStore()
    j = await KeyJournal.open(None, records)
    boot = ApiKeyRecord("boot-0", "boot", "admin", "ab" * 32)
    j.store.apply([boot.to_dict()])  # the configuration's key (not journaled while usable)
    j.attach(j.store, {"boot-0"})
    key, rec = create_key(j.store, "minted", "user", tenant="t1", now=10.0)
    other = ApiKeyRecord("key_peer", "from a peer", "user", "cd" * 32, created=5.0)
    j.store.apply([other.to_dict()])  # taken from the mesh's document
    await j.flush()
    assert sorted(k for k, _ in await records.list_records(KIND)) == sorted([rec.id, "key_peer"])
    j.store.revoke(rec.id)
    j.store.revoke("boot-0")  # a revocation of a bootstrap key is kept: revocation is final
    await j.close()
    assert sorted(k for k, _ in await records.list_records(KIND)) == sorted([rec.id, "key_peer", "boot-0"])
    # restart: a fresh journal on the same records
    j2 = await KeyJournal.open(None, records)
    got = j2.store.get(rec.id)
    assert got is not None and got.revoked and got.tenant == "t1" and j2.store.get("key_peer") is not None
    b = j2.store.get("boot-0")
    assert b is not None and b.revoked
    assert j2.loaded == 3
    await records.put_record(KIND, "junk", b"{not json")
    j3 = await KeyJournal.open(None, records)
    assert j3.skipped == 1 and j3.loaded == 3
    await j2.close()
    await j3.close()
    del key


async def test_key_journal_on_sqlite_in_data_dir(tmp_path: Any) -> None:
    j = await KeyJournal.open(str(tmp_path), MemoryStore())
    j.attach(j.store)
    _, rec = create_key(j.store, "k", "admin", now=1.0)
    await j.close()
    assert (tmp_path / "node.db").exists()
    j2 = await KeyJournal.open(str(tmp_path), MemoryStore())
    assert j2.store.get(rec.id) == rec
    await j2.close()


def test_memory_key_store_watch_sees_applied_changes_once() -> None:
    seen: list[str] = []
    st = MemoryKeyStore()
    st.watch(lambda r: seen.append(r.id))
    r = ApiKeyRecord("k1", "n", "user", "ef" * 32)
    st.apply([r.to_dict()])
    st.apply([r.to_dict()])  # no change: not seen again
    st.revoke("k1")
    assert seen == ["k1", "k1"]


# ---- configuration ------------------------------------------------------------------------------------


MESH = {"mesh_port": 7946, "mesh_dev_pki": "/tmp/x", "mesh_name": "a"}


def test_history_settings_are_checked() -> None:
    cfg = build_config({}, {})
    assert cfg.history_backend == "memory" and cfg.history_url is None
    with pytest.raises(ConfigError, match="history_allow_local") as e:
        build_config({"history_backend": "memory", **MESH}, {})
    assert "lost" in str(e.value)
    assert build_config({"history_backend": "memory", "history_allow_local": True, **MESH}, {})
    assert build_config(MESH, {}).history_backend == "memory"  # the default: a warning at start
    cfg = build_config({"history_backend": "sqlite", "data_dir": "/var/lib/smg"}, {})
    assert cfg.history_url == "sqlite:////var/lib/smg/history.db"
    cases: list[tuple[dict[str, Any], str]] = [
        ({"history_backend": "mongo"}, "unknown"),
        ({"history_backend": "sqlite"}, "data_dir"),
        ({"history_backend": "postgres"}, "history_url"),
        ({"history_backend": "postgres", "history_url": "redis://x"}, "postgres"),
        ({"history_backend": "memory", "history_url": "sqlite:///x.db"}, "not memory"),
        ({"history_retention_days": -1}, "retention"),
        ({"history_migrations": "maybe"}, "migrations"),
        ({"history_pool_size": 0}, "pool_size"),
        ({"history_chain_max_depth": 0}, "chain_max_depth"),
        ({"history_memory_max_items": 0}, "max_items"),
    ]
    for bad, what in cases:
        with pytest.raises(ConfigError, match=what):
            build_config(bad, {})


async def test_build_history_routes_only_embedded_backends_in_a_mesh() -> None:
    net = Net()
    cfg = NodeConfig(mesh_name="a", mesh_port=1, history_retention_days=0)
    h = build_history(cfg, FakeLink("a", net))
    assert isinstance(h.store, RoutedStore) and h.tag == node_tag("a") and h.retention is None
    await h.start()
    assert net.handlers["a"] is not None
    assert [m.name for m in h.metrics()] == ["smg_history_ops", "smg_history_rpc"]
    await h.close()
    shared = MemoryStore()
    shared.shared = True
    h2 = build_history(cfg, FakeLink("b", net), backend=shared)
    assert h2.store is shared and h2.router is None
    h3 = build_history(NodeConfig(history_retention_days=1))
    assert h3.store is h3.backend and h3.retention is not None
    await h3.start()
    await asyncio.sleep(0)
    await h3.close()


async def test_large_segments_come_in_several_replies(monkeypatch: pytest.MonkeyPatch) -> None:
    from shepherd.node.cluster import history

    monkeypatch.setattr(history, "REPLY_BUDGET", 1)  # one record per reply
    net, s = mesh("a", "b")
    chain: list[str] = []
    items: list[StoredItem] = []
    prev = None
    for owner in ("a", "a", "a", "b", "b", "a", "a"):
        rid = new_id("resp", T[owner])
        it = msg("0" * 8, f"turn {len(chain)}", response_id=rid)  # a tag no node has: asked where seen
        await s[owner].put_response(response(rid, prev, [it]), [it])
        chain.append(rid)
        items.append(it)
        prev = rid
    assert [r.id for r in await s["b"].get_chain(chain[-1], 100)] == chain
    with pytest.raises(ChainError):
        await s["b"].get_chain(chain[-1], 6)
    before = len(net.calls)
    got = await s["b"].get_items([i.id for i in items])
    assert [i.id for i in got] == [i.id for i in items]
    assert len(net.calls) - before == 5  # a's five items, one reply each
