"""Reasoning blobs (``include: ["reasoning.encrypted_content"]``) of nodes without a mesh, under
``reasoning_keyring_file``: a blob a node sealed opens after the node restarts, and on another node given
the same file (plain nodes behind one load balancer); a node with other keys, or with none (a key of its
process), ignores it, as any foreign blob. Opening shows in the prompt: the next turn renders the sealed
reasoning as the model's past think block, which the mock engine's script matches."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx

from shepherd.mesh.keyring import Keyring, generate_key
from tests.e2e import node_fixtures, responses_fixtures
from tests.e2e.node_procs import NodeProc
from tests.e2e.procs import MockEngineProc
from tests.e2e.responses_fixtures import MODEL, qwen3_node, script, sdk

# the shared module-scoped fixtures, by their names
tokenizer_dir, http = node_fixtures.tokenizer_dir, node_fixtures.http
engine = responses_fixtures.engine


def key_file(path: Path, *keys: bytes) -> str:
    path.write_text(Keyring.format_file(list(keys)))
    return str(path)


def sealed_turn(node: NodeProc, engine: MockEngineProc, http: httpx.Client) -> tuple[str, str]:
    """A first turn with ``store: false``: the reasoning the engine wrote and the blob sealing it."""
    thought = f"plan-{uuid.uuid4().hex[:10]}"
    marker = script(engine, http, f"<think>{thought}</think>It is done.")
    with sdk(node) as c:
        r = c.responses.create(
            model=MODEL, input=f"plan {marker}", store=False, include=["reasoning.encrypted_content"]
        )
    reasoning = r.output[0]
    assert reasoning.type == "reasoning" and isinstance(reasoning.encrypted_content, str)
    assert thought not in reasoning.encrypted_content
    return thought, reasoning.encrypted_content


def opens(node: NodeProc, engine: MockEngineProc, http: httpx.Client, thought: str, blob: str) -> bool:
    """Whether ``node`` renders the reasoning ``blob`` seals when the item comes back as the blob alone
    (the Vercel AI SDK, pydantic-ai)."""
    answer = f"seen-{uuid.uuid4().hex[:8]}"
    script(engine, http, answer, match=f"<think>\n{thought}\n</think>")
    item: Any = {"type": "reasoning", "summary": [], "encrypted_content": blob}
    turn: Any = [{"role": "user", "content": "plan"}, item, {"role": "assistant", "content": "It is done."}]
    with sdk(node) as c:
        r = c.responses.create(model=MODEL, input=turn, store=False, max_output_tokens=64)
    return r.output_text == answer


def test_a_blob_opens_after_a_restart_and_on_nodes_given_the_same_keys(
    engine: MockEngineProc, http: httpx.Client, tokenizer_dir: Path, tmp_path: Path
) -> None:
    old, new = generate_key(), generate_key()
    keys = key_file(tmp_path / "reasoning.keys", old)
    with qwen3_node(engine, tokenizer_dir, reasoning_keyring_file=keys) as node:
        thought, blob = sealed_turn(node, engine, http)
        assert opens(node, engine, http, thought, blob)
    # the same node started again (another process, the same file): the blob still opens
    with qwen3_node(engine, tokenizer_dir, reasoning_keyring_file=keys) as node:
        assert opens(node, engine, http, thought, blob)
    # a rotation: a new primary seals, the old key still opens
    rotated = key_file(tmp_path / "rotated.keys", new, old)
    with qwen3_node(engine, tokenizer_dir, reasoning_keyring_file=rotated) as node:
        assert opens(node, engine, http, thought, blob)
        thought2, blob2 = sealed_turn(node, engine, http)
    # other keys, or none (a key of the process): foreign blobs, ignored (the turn is still answered)
    other = key_file(tmp_path / "other.keys", generate_key())
    with qwen3_node(engine, tokenizer_dir, reasoning_keyring_file=other) as node:
        assert not opens(node, engine, http, thought, blob)
    with qwen3_node(engine, tokenizer_dir) as node:
        assert not opens(node, engine, http, thought2, blob2)
    # the old key alone does not open what the new primary sealed
    with qwen3_node(engine, tokenizer_dir, reasoning_keyring_file=keys) as node:
        assert not opens(node, engine, http, thought2, blob2)
        assert "Traceback" not in node.log()
