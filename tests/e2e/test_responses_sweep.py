"""End to end: what a sweep of the stateful Responses API with the official openai SDK found, on real
``smg-node`` processes over one mock engine (qwen3's template and parsers over the byte-level tokenizer,
a context of ``CONTEXT`` tokens), on loopback ports 44000-44999:

- in a mesh with an embedded backend, output items a node stored sent back as input (or named by an
  ``item_reference``) to another node without ``previous_response_id``: the turn's owner refused its
  record (a 500 "refers to unknown items"); they are now stored again with the turn, under its ids;
- ``truncation: "auto"`` was accepted and echoed but ignored (the 400 of ``disabled``): the oldest
  turns of the history are now dropped until the prompt fits;
- with auth on, an ``item_reference`` to another tenant's item put that item in the caller's prompt and
  input items: now a 404, as the other tenant's response is.

Every process is stopped by its pid, also on failure; every wait is a bounded poll.
"""

from __future__ import annotations

import os
import random
import signal
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from shepherd.auth.certs import write_dev_pki
from shepherd.mesh.keyring import Keyring, generate_key
from shepherd.storage.ids import node_tag, tag_of
from tests.e2e import node_fixtures
from tests.e2e.node_fixtures import QWEN3_TEMPLATE
from tests.e2e.node_procs import NodeProc, http_status, reserved_port, spawn_node, start_node
from tests.e2e.procs import MockEngineProc, start_mock_engine
from tests.e2e.responses_fixtures import MODEL, TOOLS, script
from tests.e2e.test_mesh_cluster import mesh_flags

pytestmark = pytest.mark.timeout(180)

tokenizer_dir, http = node_fixtures.tokenizer_dir, node_fixtures.http

CONTEXT = 2048
NAMES = ("a", "b", "c")
ADMIN_KEY = "sk-smg-e2e-sweep-admin-" + os.urandom(16).hex()
ADMIN_ENV = "SMG_E2E_SWEEP_ADMIN_KEY"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
_PORTS = list(range(44000, 45000))
random.shuffle(_PORTS)


def port() -> int:
    """A loopback port free now (below the ephemeral range: ``node_procs.reserved_port``)."""
    return reserved_port()


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll ``cond`` (the deadline only guards against a hang: nothing is timed)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        time.sleep(0.05)


def sdk(node: NodeProc, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=node.url + "/v1", api_key=key, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def engine(tokenizer_dir: Path) -> Iterator[MockEngineProc]:
    with start_mock_engine(
        "--zero-latency", "--output-len", "16", "--tokenizer", str(tokenizer_dir),
        "--context-length", str(CONTEXT), "--grpc-port", str(port()), "--http-port", str(port()),
    ) as e:  # fmt: skip
        yield e


def config(engine: MockEngineProc, tokenizer_dir: Path, where: Path) -> str:
    """A node's YAML: ``MODEL`` from ``engine``, qwen3's template, reasoning and tool-call parsers."""
    model = {
        "name": MODEL,
        "model_path": str(tokenizer_dir),
        "worker_urls": [f"grpc://127.0.0.1:{engine.grpc_port}"],
        "chat_template": str(QWEN3_TEMPLATE),
        "reasoning_parser": "qwen3",
        "tool_call_parser": "hermes",
        "context_length": CONTEXT,
    }
    where.write_text(yaml.safe_dump({"models": [model], "tokenizer_workers": 0}))
    return str(where)


@pytest.fixture(scope="module")
def node(engine: MockEngineProc, tokenizer_dir: Path) -> Iterator[NodeProc]:
    """One node, API keys on (``ADMIN_KEY`` its admin's), the memory backend."""
    old = os.environ.get(ADMIN_ENV)
    os.environ[ADMIN_ENV] = ADMIN_KEY
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = config(engine, tokenizer_dir, Path(tmp) / "node.yaml")
            n = start_node(
                "--config", cfg, "--auth-mode", "api_key", "--auth-admin-key-env", ADMIN_ENV, port=port()
            )
            try:
                yield n
            finally:
                n.stop()
    finally:
        if old is None:
            os.environ.pop(ADMIN_ENV, None)
        else:
            os.environ[ADMIN_ENV] = old


@pytest.fixture(scope="module")
def mesh(
    engine: MockEngineProc, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, NodeProc]]:
    """Three nodes in a mesh (mTLS, a key file, short SWIM intervals), the memory backend each."""
    pki = tmp_path_factory.mktemp("sweep-pki")
    files = write_dev_pki(pki, NAMES)
    keyring = pki / "mesh.keyring"
    keyring.write_text(Keyring.format_file([generate_key()]))
    cfg = config(engine, tokenizer_dir, pki / "node.yaml")
    mesh_ports = {n: port() for n in NAMES}
    nodes: dict[str, NodeProc] = {}
    try:
        for name in NAMES:
            flags = [
                "--config", cfg, "--no-kv-events", "--health-check-interval-secs", "1",
                *mesh_flags(name, mesh_ports[name], files[name], keyring),
            ]  # fmt: skip
            seeds = [] if name == "a" else [f"127.0.0.1:{mesh_ports['a']}"]
            nodes[name] = spawn_node(
                "join" if seeds else "serve", *seeds, *flags, port=port(), log_prefix="smg-sweep-"
            )
        for name, n in nodes.items():
            wait_for(
                lambda n=n: n.proc.poll() is not None or http_status(n.url + "/readiness") == 200,  # type: ignore[misc]
                f"node {name} ready",
                timeout=90,
            )
            assert n.proc.poll() is None, n.log()

        def members(n: NodeProc) -> dict[str, str]:
            rows = httpx.get(n.url + "/mesh/members", timeout=10).json()["members"]
            return {m["name"]: m["state"] for m in rows}

        for name, n in nodes.items():
            wait_for(lambda n=n: members(n) == dict.fromkeys(NAMES, "alive"), f"{name}: 3 alive")  # type: ignore[misc]
        yield nodes
    finally:
        for n in nodes.values():
            n.stop(signal.SIGKILL if n.proc.poll() is None else signal.SIGTERM, timeout=10)


def texts(items: Any) -> list[str]:
    return [str(i.content[0].text) for i in items if i.type == "message"]


# ---- a mesh: items another node stored, sent back -------------------------------------------------------


def test_output_items_of_another_node_sent_back_as_input(
    mesh: dict[str, NodeProc], engine: MockEngineProc, http: httpx.Client
) -> None:
    """A function call made on a, sent back with its output to b (no previous_response_id: the client
    keeps the history), and a reasoning + message output of a sent back to c: each turn is answered and
    stored by its node, its input items (a's items copied under the new owner's ids) listed anywhere."""
    a, b, c = (sdk(mesh[n]) for n in NAMES)
    marker = script(engine, http, CALL)
    r1 = a.responses.create(model=MODEL, input=f"weather? {marker}", tools=TOOLS)
    [call] = [o for o in r1.output if o.type == "function_call"]
    assert tag_of(call.id or "") == node_tag("a")
    history: list[Any] = [
        {"role": "user", "content": f"weather? {marker}"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    r2 = b.responses.create(model=MODEL, input=history, tools=TOOLS)
    assert r2.status == "completed" and tag_of(r2.id) == node_tag("b")
    got = list(c.responses.input_items.list(r2.id, order="asc"))
    assert [i.type for i in got] == ["message", "function_call", "function_call_output"]
    assert all(tag_of(i.id or "") == node_tag("b") for i in got)  # b holds every item its record names
    assert got[1].call_id == call.call_id and got[1].arguments == call.arguments  # type: ignore[union-attr]

    think = script(engine, http, "<think>pondering</think>The answer.")
    r3 = a.responses.create(model=MODEL, input=f"think {think}")
    assert [o.type for o in r3.output] == ["reasoning", "message"]
    sent: Any = [*(o.model_dump(exclude_none=True) for o in r3.output), {"role": "user", "content": "more"}]
    r4 = c.responses.create(model=MODEL, input=sent)
    assert r4.status == "completed"
    got = list(b.responses.input_items.list(r4.id, order="asc"))
    assert [i.type for i in got] == ["reasoning", "message", "message"]
    assert texts(got) == ["The answer.", "more"]
    # an item_reference to a's item, on c: the item it names, stored with c's record
    ref: Any = [{"type": "item_reference", "id": r3.output[1].id}, {"role": "user", "content": "?"}]
    r5 = c.responses.create(model=MODEL, input=ref)
    assert texts(a.responses.input_items.list(r5.id, order="asc")) == ["The answer.", "?"]
    # and the chain goes on from any of them, on any node
    r6 = a.responses.create(model=MODEL, input="next", previous_response_id=r2.id, tools=TOOLS)
    assert r6.status == "completed" and r6.usage is not None and r2.usage is not None
    assert r6.usage.input_tokens > r2.usage.input_tokens


# ---- truncation -----------------------------------------------------------------------------------------


def admin(node: NodeProc) -> openai.OpenAI:
    return sdk(node, ADMIN_KEY)


def test_truncation_auto_drops_the_oldest_turns_disabled_refuses(node: NodeProc) -> None:
    """A chain whose history no longer fits the context: ``disabled`` (the default) is a 400
    ``context_length_exceeded``; ``auto`` answers with the oldest turn dropped, the newer one kept."""
    client = admin(node)
    turn = "x" * (CONTEXT // 3)
    r1 = client.responses.create(model=MODEL, input=f"one {turn}", max_output_tokens=8)
    r2 = client.responses.create(
        model=MODEL, input=f"two {turn}", previous_response_id=r1.id, max_output_tokens=8
    )
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=f"three {turn}", previous_response_id=r2.id)
    assert e.value.code == "context_length_exceeded"
    r3 = client.responses.create(
        model=MODEL, input=f"three {turn}", previous_response_id=r2.id, truncation="auto", max_output_tokens=8
    )
    assert r3.status in ("completed", "incomplete") and r3.truncation == "auto"
    assert r3.usage is not None and r2.usage is not None
    # turn one dropped (r2's prompt held it), turn two and three kept
    assert 2 * len(turn) < r3.usage.input_tokens + 8 <= CONTEXT
    # the stored chain is whole: a turn with less history to fit needs no truncation
    r4 = client.responses.create(model=MODEL, input="four", previous_response_id=r1.id)
    assert r4.status == "completed"


def test_truncation_auto_in_a_conversation_keeps_the_stored_items(node: NodeProc) -> None:
    client = admin(node)
    turn = "y" * (CONTEXT // 3)
    conv = client.conversations.create(
        items=[{"role": "user", "content": f"old {turn}"}, {"role": "assistant", "content": "ok"}]
    )
    client.responses.create(model=MODEL, input=f"mid {turn}", conversation=conv.id, max_output_tokens=8)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input=f"new {turn}", conversation=conv.id)
    r = client.responses.create(model=MODEL, input=f"new {turn}", conversation=conv.id, truncation="auto")
    assert r.status in ("completed", "incomplete")
    every = list(client.conversations.items.list(conv.id, order="asc"))
    first: Any = every[0]
    assert len(every) == 6 and str(first.content[0].text).startswith("old ")


# ---- ownership ------------------------------------------------------------------------------------------


def key(node: NodeProc, name: str) -> str:
    r = httpx.post(
        node.url + "/admin/keys",
        json={"name": f"{name}-{uuid.uuid4().hex[:6]}", "role": "user"},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=10,
    )
    assert r.status_code in (200, 201), r.text
    k: str = r.json()["key"]
    return k


def test_item_reference_to_another_tenants_item_is_404(node: NodeProc) -> None:
    alice, bob = sdk(node, key(node, "alice")), sdk(node, key(node, "bob"))
    secret = alice.responses.create(model=MODEL, input="alice's secret question")
    item = secret.output[-1].id
    ref: Any = [{"type": "item_reference", "id": item}, {"role": "user", "content": "repeat it"}]
    with pytest.raises(openai.NotFoundError) as e:
        bob.responses.create(model=MODEL, input=ref)
    assert e.value.code == "item_not_found"
    inputs = list(alice.responses.input_items.list(secret.id))
    conv = alice.conversations.create(items=[{"role": "user", "content": "alice's note"}])
    note = alice.conversations.items.list(conv.id).data[0].id
    with pytest.raises(openai.NotFoundError):  # nor the items of a conversation (no response to own them)
        bob.responses.create(model=MODEL, input=[{"type": "item_reference", "id": note}])  # type: ignore[misc,list-item]
    # its owner and an admin may
    mine = alice.responses.create(model=MODEL, input=ref)
    assert texts(alice.responses.input_items.list(mine.id, order="asc"))[-1] == "repeat it"
    assert alice.responses.create(model=MODEL, input=[{"type": "item_reference", "id": inputs[0].id}]).status
    assert admin(node).responses.create(model=MODEL, input=ref).status in ("completed", "incomplete")


def test_context_error_names_the_responses_fields(node: NodeProc) -> None:
    """A prompt that fits but not with ``max_output_tokens``: the 400 names Responses' own fields
    (``input``, ``max_output_tokens``), not chat's ``messages``."""
    with pytest.raises(openai.BadRequestError) as e:
        admin(node).responses.create(model=MODEL, input="short", max_output_tokens=CONTEXT)
    assert e.value.code == "context_length_exceeded"
    body: Any = e.value.body
    assert body["param"] == "input", body
    assert "'max_output_tokens'" in body["message"] and "messages" not in body["message"], body
