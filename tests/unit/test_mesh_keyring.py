"""Keyring: AES-GCM seal/open of mesh packets, rotation, and rejection of anything not sealed by us."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.mesh.keyring import (
    OVERHEAD,
    VERSION,
    Keyring,
    KeyringError,
    SealError,
    generate_key,
    load_keyring,
)

K1 = bytes(range(32))
K2 = bytes(range(100, 116))
K3 = bytes(range(50, 74))


def test_round_trip_all_key_sizes() -> None:
    for key in (K1, K2, K3):
        ring = Keyring([key])
        packet = ring.seal(b"hello mesh")
        assert packet[0] == VERSION
        assert len(packet) == len(b"hello mesh") + OVERHEAD
        assert ring.open(packet) == b"hello mesh"


def test_empty_payload_round_trip() -> None:
    ring = Keyring([K1])
    assert ring.open(ring.seal(b"")) == b""


def test_fresh_nonce_per_packet() -> None:
    ring = Keyring([K1])
    packets = {ring.seal(b"same") for _ in range(50)}
    assert len(packets) == 50
    assert len({p[1:13] for p in packets}) == 50


def test_wrong_key_rejected() -> None:
    packet = Keyring([K1]).seal(b"secret")
    with pytest.raises(SealError):
        Keyring([K2]).open(packet)


def test_other_cluster_rejected() -> None:
    packet = Keyring([K1], cluster="prod").seal(b"x")
    assert Keyring([K1], cluster="prod").open(packet) == b"x"
    with pytest.raises(SealError):
        Keyring([K1], cluster="staging").open(packet)
    with pytest.raises(SealError):
        Keyring([K1]).open(packet)


def test_plaintext_truncated_and_unknown_version_rejected() -> None:
    ring = Keyring([K1])
    packet = ring.seal(b"payload")
    for bad in (b"", b"payload", b"\x01" * 10, packet[:-1], packet[: OVERHEAD - 1], bytes([2]) + packet[1:]):
        with pytest.raises(SealError):
            ring.open(bad)


@settings(max_examples=200, deadline=None)
@given(
    payload=st.binary(max_size=1400),
    pos=st.integers(min_value=0),
    flip=st.integers(min_value=1, max_value=255),
)
def test_any_single_byte_tamper_rejected(payload: bytes, pos: int, flip: int) -> None:
    ring = Keyring([K1])
    packet = bytearray(ring.seal(payload))
    packet[pos % len(packet)] ^= flip
    with pytest.raises(SealError):
        ring.open(bytes(packet))


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=2000))
def test_random_bytes_never_open(data: bytes) -> None:
    with pytest.raises(SealError):
        Keyring([K1]).open(data)


def test_rotation_accepts_old_and_new_during_rollout() -> None:
    old_node = Keyring([K1])
    new_node = Keyring([K1])
    # step 1: everyone adds the new key; still sealing with the old one
    new_node.add_key(K2)
    old_node.add_key(K2)
    assert new_node.primary == K1
    # step 2: one node switches primary first; both directions still open
    new_node.use_key(K2)
    assert new_node.primary == K2
    assert old_node.open(new_node.seal(b"a")) == b"a"
    assert new_node.open(old_node.seal(b"b")) == b"b"
    # step 3: all switched, old key removed: packets under the old key are now refused
    old_node.use_key(K2)
    stale = Keyring([K1]).seal(b"stale")
    new_node.remove_key(K1)
    assert new_node.keys == (K2,)
    with pytest.raises(SealError):
        new_node.open(stale)
    assert new_node.open(old_node.seal(b"c")) == b"c"


def test_rotation_guards() -> None:
    ring = Keyring([K1, K2])
    with pytest.raises(KeyringError):
        ring.remove_key(K1)  # primary
    with pytest.raises(KeyringError):
        ring.use_key(K3)  # never added
    ring.remove_key(K3)  # absent: no-op
    ring.add_key(K2)  # duplicate: no-op
    assert ring.keys == (K1, K2)


def test_bad_key_material() -> None:
    with pytest.raises(KeyringError):
        Keyring([])
    with pytest.raises(KeyringError):
        Keyring([b"short"])
    with pytest.raises(KeyringError):
        Keyring.from_b64(["not base64!!"])
    with pytest.raises(KeyringError):
        generate_key(20)
    assert len(generate_key()) == 32
    assert repr(Keyring([K1])) == "Keyring(keys=1)"


def test_key_file_first_is_primary(tmp_path: Path) -> None:
    path = tmp_path / "mesh.keys"
    path.write_text("# mesh keys\n\n" + Keyring.format_file([K2, K1]))
    ring = Keyring.from_file(path, cluster="c")
    assert ring.keys == (K2, K1)
    assert Keyring([K1, K2], cluster="c").open(ring.seal(b"z")) == b"z"


def test_key_file_empty_rejected(tmp_path: Path) -> None:
    path = tmp_path / "empty.keys"
    path.write_text("# nothing\n")
    with pytest.raises(KeyringError):
        Keyring.from_file(path)


def test_load_keyring_file_then_config(tmp_path: Path) -> None:
    path = tmp_path / "k"
    path.write_text(Keyring.format_file([K1]))
    ring = load_keyring(path=path, keys_b64=[base64.b64encode(K2).decode()])
    assert ring.keys == (K1, K2)
    assert load_keyring(keys_b64=[base64.b64encode(K3).decode()]).primary == K3
    with pytest.raises(KeyringError):
        load_keyring()
