"""API keys: generation, hashing, the in-memory store, merge of replicated records, bootstrap keys."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.auth.config import AuthConfigError, auth_config
from shepherd.auth.keys import (
    ApiKeyRecord,
    BootstrapError,
    MemoryKeyStore,
    bootstrap_records,
    create_key,
    generate_key,
    hash_key,
    key_hint,
    merge_record,
    principal_for,
)


def test_generated_keys_have_the_prefix_and_enough_entropy() -> None:
    keys = {generate_key() for _ in range(50)}
    assert len(keys) == 50
    for k in keys:
        assert k.startswith("sk-smg-") and len(k) >= len("sk-smg-") + 43
    assert generate_key("sk-x-").startswith("sk-x-")


def test_hash_is_sha256_hex() -> None:
    assert hash_key("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_hint_never_reveals_the_key() -> None:
    k = generate_key()
    h = key_hint(k)
    assert h.startswith("sk-smg-...") and h.endswith(k[-4:]) and len(h) < 16
    assert key_hint("short") == "..."


def test_create_find_list_revoke() -> None:
    store = MemoryKeyStore()
    seen: list[ApiKeyRecord] = []
    store.subscribe(seen.append)
    key, rec = create_key(store, "ci", "user", tenant="team-a", models=["qwen3"], now=100.0)
    assert store.find(hash_key(key)) == rec
    assert store.find(hash_key(key + "x")) is None
    assert store.get(rec.id) == rec
    assert rec.role == "user" and rec.tenant == "team-a" and rec.models == ("qwen3",) and rec.created == 100.0
    listed = store.records()
    assert [r.id for r in listed] == [rec.id]
    public = rec.public()
    assert key not in repr(public) and "digest" not in public and public["hint"].endswith(key[-4:])
    assert key not in repr(store.export())  # only the digest is exported
    revoked = store.revoke(rec.id)
    assert revoked is not None and revoked.revoked
    found = store.find(hash_key(key))
    assert found is not None and found.revoked and not found.usable(101.0)
    assert store.revoke("key_nope") is None
    assert [r.revoked for r in seen] == [False, True]  # local changes reach subscribers
    store.revoke(rec.id)
    assert len(seen) == 2  # revoking twice is one change


def test_expiry() -> None:
    store = MemoryKeyStore()
    _, rec = create_key(store, "t", expires=200.0, now=100.0)
    assert rec.usable(199.0) and not rec.usable(200.0)
    # shown in whole seconds, rounded up: a key's expires_at is never before its real end (rounded down, a
    # key asked to live 4 s showed an end 0.8 s early)
    _, rec = create_key(store, "u", expires=1004.2, now=1000.2)
    assert rec.public()["expires_at"] == 1005 and rec.usable(1004.1) and not rec.usable(1004.2)


def test_same_digest_under_another_id_is_refused() -> None:
    store = MemoryKeyStore()
    _, rec = create_key(store, "a")
    with pytest.raises(ValueError):
        store.add(dataclasses.replace(rec, id="key_other"))


def test_apply_merges_without_callbacks_and_revocation_wins() -> None:
    a, b = MemoryKeyStore(), MemoryKeyStore()
    calls: list[ApiKeyRecord] = []
    b.subscribe(calls.append)
    key, rec = create_key(a, "shared")
    b.apply(a.export())
    assert b.find(hash_key(key)) == rec
    a.revoke(rec.id)
    b.apply(a.export())
    got = b.get(rec.id)
    assert got is not None and got.revoked
    b.apply([rec.to_dict()])  # an old, unrevoked copy arriving late
    got = b.get(rec.id)
    assert got is not None and got.revoked
    assert calls == []


def test_from_dict_rejects_bad_records() -> None:
    with pytest.raises(ValueError):
        ApiKeyRecord.from_dict({"id": "k", "role": "root", "digest": "0" * 64})
    with pytest.raises(ValueError):
        ApiKeyRecord.from_dict({"id": "k", "role": "user", "digest": "short"})


_records = st.builds(
    ApiKeyRecord,
    id=st.sampled_from(["k1", "k2"]),
    name=st.text(max_size=10),
    role=st.sampled_from(["admin", "user"]),
    digest=st.sampled_from(["a" * 64, "b" * 64]),
    tenant=st.none() | st.text(min_size=1, max_size=5),
    created=st.floats(0, 1e9),
    revoked=st.booleans(),
    expires=st.none() | st.floats(1, 1e10),
    models=st.none() | st.lists(st.text(min_size=1, max_size=5), max_size=3).map(tuple),
)


@settings(max_examples=150, deadline=None)
@given(_records)
def test_record_round_trips_through_plain_dicts(r: ApiKeyRecord) -> None:
    assert ApiKeyRecord.from_dict(r.to_dict()) == r


@settings(max_examples=150, deadline=None)
@given(_records, _records)
def test_merge_keeps_revocation_and_the_earliest_expiry_in_any_order(
    x: ApiKeyRecord, y: ApiKeyRecord
) -> None:
    y = dataclasses.replace(y, id=x.id)
    for m in (merge_record(x, y), merge_record(y, x)):
        assert m.revoked == (x.revoked or y.revoked)
        exps = [e for e in (x.expires, y.expires) if e is not None]
        assert m.expires == (min(exps) if exps else None)
    assert merge_record(x, x) == x


@settings(max_examples=60, deadline=None)
@given(st.lists(_records, max_size=6), st.randoms())
def test_stores_fed_the_same_records_in_any_order_agree_on_revocation(
    records: list[ApiKeyRecord], rnd: Any
) -> None:
    records = [dataclasses.replace(r, digest=("a" if r.id == "k1" else "b") * 64) for r in records]
    shuffled = list(records)
    rnd.shuffle(shuffled)
    a, b = MemoryKeyStore(), MemoryKeyStore()
    a.apply(r.to_dict() for r in records)
    b.apply(r.to_dict() for r in shuffled)
    assert {r.id: (r.revoked, r.expires) for r in a.records()} == {
        r.id: (r.revoked, r.expires) for r in b.records()
    }


def test_bootstrap_from_env_and_digest() -> None:
    secret = "sk-smg-bootstrap-secret-value-000000000000"
    cfg = auth_config(
        {
            "mode": "api_key",
            "admin_key_env": ["ADMIN_KEY"],
            "keys": [
                {"name": "batch", "role": "user", "tenant": "t1", "sha256": hash_key("other"), "models": "m"}
            ],
        }
    )
    recs = bootstrap_records(cfg, {"ADMIN_KEY": secret})
    store = MemoryKeyStore(recs)
    admin = store.find(hash_key(secret))
    user = store.find(hash_key("other"))
    assert admin is not None and admin.role == "admin" and admin.tenant is None
    assert user is not None and user.role == "user" and user.tenant == "t1" and user.models == ("m",)
    assert secret not in repr(recs)
    p = principal_for(admin, "default")
    assert (p.role, p.tenant, p.method, p.key_id) == ("admin", "default", "api_key", admin.id)
    with pytest.raises(BootstrapError) as e:
        bootstrap_records(cfg, {})
    assert "ADMIN_KEY" in str(e.value)


def test_a_config_key_keeps_its_id_and_records_when_other_keys_go() -> None:
    """A configuration key's id owns what its callers store (responses, conversations): removing or
    reordering the other keys (a reload, a restart) must not give one key another's id, and so its
    records."""

    def owners(*names: str) -> dict[str, str]:
        cfg = auth_config(
            {
                "mode": "api_key",
                "keys": [{"name": n, "role": "user", "sha256": hash_key(n + "-secret")} for n in names],
            }
        )
        return {r.name: principal_for(r, "default").owner for r in bootstrap_records(cfg, {})}

    both = owners("alice", "bob")
    assert both["alice"] != both["bob"]
    assert owners("bob") == {"bob": both["bob"]}  # alice removed: bob is still bob, not alice
    assert owners("bob", "alice") == both  # reordered


def test_config_keys_need_distinct_ids() -> None:
    two = [{"name": "k", "role": "user", "sha256": hash_key(s)} for s in ("a", "b")]
    with pytest.raises(AuthConfigError, match="'k' and 'k'"):
        auth_config({"mode": "api_key", "keys": two})
    with pytest.raises(AuthConfigError):
        auth_config(
            {
                "mode": "api_key",
                "keys": [{**two[0], "name": "x", "id": "i"}, {**two[1], "name": "y", "id": "i"}],
            }
        )
