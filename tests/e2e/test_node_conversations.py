"""End to end: the Conversations API of a real node, driven by the official openai SDK; conversation
ownership with API keys; API keys and conversations surviving a restart of the node (``--data-dir``).
Every node is stopped by its pid, also when a test fails."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.node_procs import NodeProc, running_node, start_node

pytestmark = pytest.mark.timeout(120)

ADMIN_KEY = "sk-smg-e2e-conv-admin-" + os.urandom(16).hex()
ENV = "SMG_E2E_CONV_ADMIN_KEY"


@pytest.fixture(scope="module")
def node() -> Iterator[NodeProc]:
    with running_node("--model-id", "qwen3", "--tokenizer-workers", "0", wait_ready=False) as n:
        yield n


def sdk(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def text(item: Any) -> str:
    return str(item.content[0].text)


def iid(item: Any) -> str:
    assert isinstance(item.id, str)
    return item.id


def test_conversation_lifecycle_with_the_sdk(node: NodeProc) -> None:
    client = sdk(node.url)
    conv = client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "hello"}], metadata={"topic": "demo"}
    )
    assert conv.id.startswith("conv_") and conv.object == "conversation"
    assert conv.metadata == {"topic": "demo"} and conv.created_at > 0
    got = client.conversations.retrieve(conv.id)
    assert got.id == conv.id and got.metadata == {"topic": "demo"}
    upd = client.conversations.update(conv.id, metadata={"topic": "changed", "k": "v"})
    assert upd.metadata == {"topic": "changed", "k": "v"}
    added = client.conversations.items.create(
        conv.id,
        items=[
            {"type": "message", "role": "assistant", "content": "hi, how can I help?"},
            {"role": "user", "content": [{"type": "input_text", "text": "tell me more"}]},
            {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "42"},
        ],
    )
    assert added.object == "list" and len(added.data) == 4 and not added.has_more
    assert added.first_id == added.data[0].id and added.last_id == added.data[-1].id
    assert added.data[0].type == "message" and text(added.data[0]) == "hi, how can I help?"
    assert added.data[2].type == "function_call" and added.data[2].id.startswith("fc_")
    # default order: newest first; the SDK's paging follows after= until has_more is false
    page = client.conversations.items.list(conv.id, limit=2)
    assert len(page.data) == 2 and page.has_more and page.data[0].type == "function_call_output"
    every = list(client.conversations.items.list(conv.id, limit=2, order="asc"))
    assert [i.type for i in every] == [
        "message",
        "message",
        "message",
        "function_call",
        "function_call_output",
    ]
    assert text(every[0]) == "hello"
    one = client.conversations.items.retrieve(iid(every[1]), conversation_id=conv.id)
    assert one.id == every[1].id and text(one) == "hi, how can I help?"
    after = client.conversations.items.delete(iid(every[1]), conversation_id=conv.id)
    assert after.id == conv.id and after.object == "conversation"
    assert [i.id for i in client.conversations.items.list(conv.id, order="asc")] == [
        i.id for i in every if i.id != every[1].id
    ]
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(iid(every[1]), conversation_id=conv.id)
    deleted = client.conversations.delete(conv.id)
    assert deleted.id == conv.id and deleted.deleted and deleted.object == "conversation.deleted"
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.list(conv.id)


def test_conversation_errors_name_the_parameter(node: NodeProc) -> None:
    client = sdk(node.url)
    with pytest.raises(openai.NotFoundError) as nf:
        client.conversations.retrieve("conv_" + "0" * 48)
    assert nf.value.status_code == 404
    with pytest.raises(openai.BadRequestError) as e:
        client.conversations.retrieve("resp_123")
    assert e.value.body["param"] == "conversation_id"  # type: ignore[index]
    conv = client.conversations.create()
    assert conv.metadata == {}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata.k"),
        ({"items": [{"role": "user", "content": "x"}] * 21}, "items"),
        ({"items": [{"type": "message", "role": "robot", "content": "x"}]}, "items[0].role"),
        ({"items": "hello"}, "items"),
        ({"bogus": 1}, "bogus"),
    ]
    for body, param in cases:
        r = httpx.post(node.url + "/v1/conversations", json=body, timeout=10)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, r.text
    for query, param in [("limit=0", "limit"), ("limit=101", "limit"), ("order=up", "order")]:
        r = httpx.get(f"{node.url}/v1/conversations/{conv.id}/items?{query}", timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(f"{node.url}/v1/conversations/{conv.id}/items", json={"items": []}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "items"
    r = httpx.post(f"{node.url}/v1/conversations/{conv.id}", json={}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata"
    # a client's item id is kept; the same id twice is refused
    item: Any = {"id": "msg_client_1", "type": "message", "role": "user", "content": "x"}
    assert client.conversations.items.create(conv.id, items=[item]).data[0].id == "msg_client_1"
    with pytest.raises(openai.BadRequestError):
        client.conversations.items.create(conv.id, items=[item])


def admin_post(url: str, path: str, body: Any) -> dict[str, Any]:
    r = httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
    assert r.status_code in (200, 201), r.text
    out: dict[str, Any] = r.json()
    return out


def test_keys_and_conversations_survive_a_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, ADMIN_KEY)
    data = tmp_path / "data"
    flags = (
        *("--model-id", "qwen3", "--tokenizer-workers", "0"),
        *("--auth-mode", "api_key", "--auth-admin-key-env", ENV),
        *("--data-dir", str(data), "--history-backend", "sqlite"),
    )
    node = start_node(*flags, wait_ready=False)
    try:
        alice = admin_post(node.url, "/admin/keys", {"name": "alice", "role": "user"})
        bob = admin_post(node.url, "/admin/keys", {"name": "bob", "role": "user"})
        gone = admin_post(node.url, "/admin/keys", {"name": "revoked", "role": "user"})
        r = httpx.delete(
            f"{node.url}/admin/keys/{gone['id']}",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=10,
        )
        assert r.status_code == 200 and r.json()["revoked"]
        conv = sdk(node.url, alice["key"]).conversations.create(metadata={"owner": "alice"})
        with pytest.raises(openai.NotFoundError):  # another user's conversation does not exist for bob
            sdk(node.url, bob["key"]).conversations.retrieve(conv.id)
        assert sdk(node.url, ADMIN_KEY).conversations.retrieve(conv.id).id == conv.id  # an admin sees it
    finally:
        assert node.stop() == 0, node.log()
    assert (data / "node.db").exists() and (data / "history.db").exists()
    node = start_node(*flags, wait_ready=False)
    try:
        got = sdk(node.url, alice["key"]).conversations.retrieve(conv.id)  # the key and the conversation
        assert got.metadata == {"owner": "alice"}
        with pytest.raises(openai.NotFoundError):
            sdk(node.url, bob["key"]).conversations.retrieve(conv.id)
        with pytest.raises(openai.AuthenticationError):
            sdk(node.url, gone["key"]).conversations.retrieve(conv.id)
        with pytest.raises(openai.AuthenticationError):
            sdk(node.url, "sk-smg-never-minted").conversations.retrieve(conv.id)
    finally:
        node.stop()
