"""A real node over replay servers, for the contract tests: start both, stop both by pid/handle."""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
from tokenizers import Tokenizer

from tests.contract.replay import EngineFacts, ReplayServer
from tests.e2e.node_procs import NodeProc, start_node
from tests.e2e.test_node_tools import byte_tokenizer

MODEL = "m"


@contextlib.contextmanager
def tokenizer_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        yield byte_tokenizer(Path(tmp) / "bytes")


def ids(tok_dir: Path, text: str) -> list[int]:
    """``text`` in the byte tokenizer's ids (one per byte)."""
    return list(
        Tokenizer.from_file(str(tok_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    )


def token_id(tok_dir: Path, token: str) -> int:
    tid = Tokenizer.from_file(str(tok_dir / "tokenizer.json")).token_to_id(token)
    assert tid is not None
    return int(tid)


@contextlib.contextmanager
def replay(dialect: str, facts: EngineFacts | None = None) -> Iterator[ReplayServer]:
    s = ReplayServer(dialect, facts).start()
    try:
        yield s
    finally:
        s.stop()


@contextlib.contextmanager
def node_over(
    servers: Sequence[ReplayServer], tok_dir: Path, *extra: str, timeout: float = 60.0
) -> Iterator[NodeProc]:
    """A node serving model ``m`` from ``servers`` (each by its dialect's URL scheme)."""
    args = [
        "--worker-urls",
        *(s.url for s in servers),
        "--model-id",
        MODEL,
        "--model-path",
        str(tok_dir),
        "--tokenizer-workers",
        "0",
        *extra,
    ]
    node = start_node(*args, timeout=timeout)
    try:
        yield node
    finally:
        node.stop()


def complete(http: httpx.Client, node: NodeProc, **body: Any) -> httpx.Response:
    return http.post(node.url + "/v1/completions", json={"model": MODEL, "max_tokens": 32, **body})


def sse_events(text: str) -> list[Any]:
    """The JSON events of an SSE body (``[DONE]`` left out)."""
    return [
        json.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def streamed_text(events: list[Any], index: int = 0) -> str:
    return "".join(c.get("text", "") for e in events for c in e.get("choices", []) if c.get("index") == index)


def text_and_tokens(r: httpx.Response, stream: bool) -> tuple[str, str]:
    """A completion answer's (streamed or not) text of choice 0 and its logprobs' tokens, joined (streamed:
    every event's)."""
    if stream:
        ev = sse_events(r.text)
        tokens = [t for e in ev for c in e["choices"] if c.get("logprobs") for t in c["logprobs"]["tokens"]]
        return streamed_text(ev), "".join(tokens)
    c = r.json()["choices"][0]
    return c["text"], "".join(c["logprobs"]["tokens"])
