"""A reasoning item's ``encrypted_content`` (``shepherd.node.openai.reasoning_seal``): what one node seals,
any holder of the mesh's keys opens (a keyring rotation included); anything else (another cluster's,
another server's, damaged, a sealed mesh packet) does not open, and is told apart rather than raising.
"""

from __future__ import annotations

import base64

import pytest

from shepherd.mesh.keyring import Keyring, generate_key
from shepherd.node.openai.items import MAX_OPENED_CHARS, parse_items
from shepherd.node.openai.reasoning_seal import PREFIX, ReasoningSeal
from shepherd.proto.openai_errors import ApiError
from shepherd.storage.types import StoredItem

TEXT = "The user wants the files listed: call the shell tool with ls. 中文 ✓"


def test_a_blob_opens_under_the_same_keys_and_hides_its_text() -> None:
    key = generate_key()
    blob = ReasoningSeal([key]).seal(TEXT)
    assert blob.startswith(PREFIX) and "shell" not in blob and blob.isascii()
    assert ReasoningSeal([key]).open(blob) == TEXT  # another node with the mesh's keyring
    assert ReasoningSeal([key]).open(ReasoningSeal([key]).seal("")) == ""


def test_a_rotated_keyring_still_opens_blobs_of_its_old_key() -> None:
    old, new = generate_key(), generate_key()
    blob = ReasoningSeal([old]).seal(TEXT)
    assert ReasoningSeal([new, old]).open(blob) == TEXT  # new primary, old key kept
    assert ReasoningSeal([new]).open(blob) is None  # old key removed


def test_what_is_not_a_blob_of_this_mesh_does_not_open() -> None:
    key = generate_key()
    seal = ReasoningSeal([key], cluster="prod")
    blob = seal.seal(TEXT)
    raw = bytearray(base64.urlsafe_b64decode(blob[len(PREFIX) :] + "=" * (-len(blob) % 4)))
    raw[-1] ^= 1
    damaged = PREFIX + base64.urlsafe_b64encode(bytes(raw)).decode().rstrip("=")
    for other in (
        damaged,
        blob[:-6],
        PREFIX,
        PREFIX + "!!not base64!!",
        "gAAAAABoZ-openai-encrypted-content",  # another server's
        ReasoningSeal([key], cluster="staging").seal(TEXT),  # another cluster under the same key
        ReasoningSeal.ephemeral().seal(TEXT),  # a node without a mesh
    ):
        assert seal.open(other) is None, other
    # the keys are the mesh's, not its packets': a sealed mesh packet is no blob
    packet = Keyring([key], cluster="prod").seal(TEXT.encode())
    assert seal.open(PREFIX + base64.urlsafe_b64encode(packet).decode()) is None


def test_an_input_reasoning_item_gets_the_text_of_its_blob_unless_it_has_one() -> None:
    seal = ReasoningSeal.ephemeral()
    blob = seal.seal(TEXT)
    ids = iter(range(100))

    def parse(item: dict[str, object]) -> object:
        [it] = parse_items(
            [item], param="input", new_id=lambda p: f"{p}_{next(ids)}", now=0.0, unseal=seal.open
        )
        return it.data["content"]

    only_blob: dict[str, object] = {
        "type": "reasoning",
        "summary": [],
        "content": None,
        "encrypted_content": blob,
    }
    assert parse(only_blob) == [{"type": "reasoning_text", "text": TEXT}]
    given = [{"type": "reasoning_text", "text": "the client's"}]
    assert parse({**only_blob, "content": given}) == given
    assert parse({**only_blob, "encrypted_content": "gAAAA-foreign"}) == []


def test_a_blob_opens_only_for_the_owner_it_was_sealed_for() -> None:
    seal = ReasoningSeal.ephemeral()
    mine = seal.seal(TEXT, owner="tenant-a/alice")
    assert seal.open(mine, owner="tenant-a/alice") == TEXT
    assert seal.open(mine, owner="tenant-b/bob") is None  # another tenant's blob is a foreign one
    assert seal.open(mine) is None
    assert seal.open(seal.seal(TEXT), owner="tenant-a/alice") is None
    assert seal.open(seal.seal(TEXT)) == TEXT  # auth off: no owner


def test_what_the_blobs_of_one_request_open_into_is_bounded() -> None:
    seal = ReasoningSeal.ephemeral()
    big = seal.seal("a" * (MAX_OPENED_CHARS // 3))  # a few KB that open into ~2.8 M characters
    assert len(big) < 20_000
    ids = iter(range(100))

    def items(n: int) -> list[dict[str, object]]:
        return [{"type": "reasoning", "summary": [], "encrypted_content": big} for _ in range(n)]

    def parse(n: int) -> list[StoredItem]:
        return parse_items(
            items(n), param="input", new_id=lambda p: f"{p}_{next(ids)}", now=0.0, unseal=seal.open
        )

    assert len(parse(3)) == 3  # (3 x 1/3 of the budget: within it)
    with pytest.raises(ApiError) as e:
        parse(4)
    assert e.value.status == 400 and e.value.code == "string_above_max_length"
