"""Control-plane config document (pycrdt): typed records, merges in any order, repair, bad updates."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pycrdt import Doc, Map

from shepherd.mesh.state_config import (
    ApiKeyRecord,
    ConfigDoc,
    LimitRecord,
    ModelPolicyRecord,
    TenantRecord,
    hash_secret,
)
from shepherd.proto.state_decode import StateDecodeError


def test_typed_records_round_trip() -> None:
    d = ConfigDoc(client_id=1)
    key = ApiKeyRecord("k1", hash_secret("sk-secret"), "acme", "admin", "ci", 10.0, 99.5, False)
    d.set_api_key(key)
    d.set_tenant(TenantRecord("acme", ("llama", "qwen"), 8))
    d.set_limit(LimitRecord("tenant:acme", 600, 100_000))
    d.set_policy(ModelPolicyRecord("qwen", "cache_aware", (("cache_threshold", 0.5), ("spill", True))))
    assert d.get_api_key("k1") == key and d.find_api_key("sk-secret") == key and d.find_api_key("x") is None
    assert d.get_tenant("acme") == TenantRecord("acme", ("llama", "qwen"), 8)
    assert d.get_limit("tenant:acme") == LimitRecord("tenant:acme", 600, 100_000)
    assert d.get_policy("qwen") == ModelPolicyRecord(
        "qwen", "cache_aware", (("cache_threshold", 0.5), ("spill", True))
    )
    assert [r.key_id for r in d.api_keys()] == ["k1"] and len(d.tenants()) == len(d.limits()) == 1
    assert d.delete_api_key("k1") and not d.delete_api_key("k1") and d.api_keys() == []
    assert "sk-secret" not in str(d.to_py())
    with pytest.raises(TypeError):
        d.put("tenants", key)


def test_deltas_relay_changes_and_stop_when_nothing_changes() -> None:
    a, b, c = ConfigDoc(client_id=1), ConfigDoc(client_id=2), ConfigDoc(client_id=3)
    a.set_tenant(TenantRecord("t"))
    u = a.take_delta()
    assert u is not None and a.take_delta() is None
    assert b.apply_update(u)
    relay = b.take_delta()  # b relays what changed it
    assert relay is not None and c.apply_update(relay)
    assert not a.apply_update(relay) and a.take_delta() is None  # nothing new: the rumor stops
    assert a.to_py() == b.to_py() == c.to_py()


ops = st.lists(
    st.tuples(
        st.integers(0, 2),
        st.sampled_from(["key", "tenant", "limit", "policy", "del_key", "del_tenant"]),
        st.sampled_from(["x", "y", "z"]),
        st.integers(0, 1000),
    ),
    max_size=15,
)


def apply_op(d: ConfigDoc, kind: str, name: str, n: int) -> None:
    if kind == "key":
        d.set_api_key(ApiKeyRecord(name, hash_secret(f"s{n}"), f"t{n % 3}"))
    elif kind == "tenant":
        d.set_tenant(TenantRecord(name, (f"m{n % 4}",), n))
    elif kind == "limit":
        d.set_limit(LimitRecord(f"tenant:{name}", n, n * 10))
    elif kind == "policy":
        d.set_policy(ModelPolicyRecord(name, "round_robin" if n % 2 else "cache_aware", (("k", n),)))
    elif kind == "del_key":
        d.delete_api_key(name)
    else:
        d.delete_tenant(name)


@settings(max_examples=100, deadline=None)
@given(ops=ops, seed=st.integers(0, 1 << 30), loss=st.floats(0, 0.6))
def test_documents_converge_whatever_the_order_duplicates_and_losses(
    ops: list[tuple[int, str, str, int]], seed: int, loss: float
) -> None:
    rng = random.Random(seed)
    docs = [ConfigDoc(client_id=i + 1) for i in range(3)]
    inflight: list[tuple[int, bytes]] = []
    for i, kind, name, n in ops:
        apply_op(docs[i], kind, name, n)
        u = docs[i].take_delta()
        if u is None:  # deleting what was not there changes nothing
            continue
        for j in range(3):
            if j != i and rng.random() >= loss:
                inflight += [(j, u)] * rng.choice([1, 1, 2])
        rng.shuffle(inflight)
        while inflight and rng.random() < 0.5:
            j, upd = inflight.pop()
            docs[j].apply_update(upd)
    for j, upd in inflight:
        docs[j].apply_update(upd)
    for a in docs:  # repair by state vectors
        for b in docs:
            b.apply_update(a.update_since(b.state_vector()))
    assert docs[0].to_py() == docs[1].to_py() == docs[2].to_py()
    assert docs[0].digest() == docs[1].digest() == docs[2].digest()


@settings(max_examples=100, deadline=None)
@given(ops=ops, perm=st.permutations([0, 1, 2]))
def test_update_merge_is_commutative_associative_idempotent(
    ops: list[tuple[int, str, str, int]], perm: list[int]
) -> None:
    docs = [ConfigDoc(client_id=i + 1) for i in range(3)]
    for i, kind, name, n in ops:
        apply_op(docs[i], kind, name, n)
    ups = [d.update_since(None) for d in docs]
    x, y = ConfigDoc(client_id=10), ConfigDoc(client_id=11)
    for u in ups:
        x.apply_update(u)
    for k in perm:
        y.apply_update(ups[k])
        y.apply_update(ups[k])
    bc = ConfigDoc(client_id=12)
    bc.apply_update(ups[1])
    bc.apply_update(ups[2])
    z = ConfigDoc(client_id=13)
    z.apply_update(ups[0])
    z.apply_update(bc.update_since(None))
    assert x.to_py() == y.to_py() == z.to_py()
    assert x.digest() == y.digest() == z.digest()


def test_a_malformed_update_raises_and_changes_nothing() -> None:
    d = ConfigDoc(client_id=1)
    d.set_tenant(TenantRecord("t"))
    before, version = d.to_py(), d.version
    for bad in (b"", b"\x00", b"\x01\x02\x03", b"\xff" * 30):
        with pytest.raises(StateDecodeError):
            d.apply_update(bad)
    # a well-formed Yjs update that writes a value the typed layer cannot read
    rogue: Doc[Any] = Doc(client_id=99)
    rogue.get("api_keys", type=Map)["k"] = "not json"
    with pytest.raises(StateDecodeError):
        d.apply_update(rogue.get_update())
    rogue2: Doc[Any] = Doc(client_id=98)
    rogue2.get("limits", type=Map)["x"] = '{"scope": 5}'
    with pytest.raises(StateDecodeError):
        d.apply_update(rogue2.get_update())
    assert d.to_py() == before and d.version == version
    with pytest.raises(StateDecodeError):
        d.update_since(b"\xff\xfe")
