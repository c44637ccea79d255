"""A reasoning item's ``encrypted_content`` (``shepherd.node.openai.reasoning_seal``): what one node seals,
any holder of the mesh's keys opens (a keyring rotation included); anything else (another cluster's,
another server's, damaged, a sealed mesh packet) does not open, and is told apart rather than raising.
"""

from __future__ import annotations

import base64

from shepherd.mesh.keyring import Keyring, generate_key
from shepherd.node.openai.items import parse_items
from shepherd.node.openai.reasoning_seal import PREFIX, ReasoningSeal

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
