"""What the Responses API's end-to-end suites share (tests/e2e/test_node_responses.py,
test_responses_sdk.py): one mock engine over the byte-level tokenizer (``node_fixtures.tokenizer_dir``)
and a node serving ``qwen3`` with its real chat template, the qwen3 reasoning parser and the hermes
tool-call parser; the module-scoped fixtures ``engine`` and ``client`` (bound by name in the suite, as
``node_fixtures`` says) and the mock's per-request script (``/mock/responses``, matched on a marker in
the rendered prompt). Each suite keeps its own ``node`` fixture (its settings), built with ``qwen3_node``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.node_fixtures import QWEN3_TEMPLATE
from tests.e2e.node_procs import NodeProc, node_of_models
from tests.e2e.procs import MockEngineProc, start_mock_engine

MODEL = "qwen3"
TOOLS: Any = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    }
]


@pytest.fixture(scope="module")
def engine(tokenizer_dir: Path) -> Iterator[MockEngineProc]:
    with start_mock_engine(
        "--zero-latency", "--output-len", "16", "--tokenizer", str(tokenizer_dir), "--context-length", "65536"
    ) as e:
        yield e


def sdk(node: NodeProc) -> openai.OpenAI:
    """The official SDK on ``node`` (no retries: each call once)."""
    return openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def client(node: NodeProc) -> Iterator[openai.OpenAI]:
    with sdk(node) as c:
        yield c


@contextmanager
def qwen3_node(engine: MockEngineProc, tokenizer_dir: Path, **settings: Any) -> Iterator[NodeProc]:
    """A node serving ``MODEL`` from ``engine`` (``settings``: more of the node's YAML config)."""
    model = {
        "name": MODEL,
        "model_path": str(tokenizer_dir),
        "worker_urls": [f"grpc://127.0.0.1:{engine.grpc_port}"],
        "chat_template": str(QWEN3_TEMPLATE),
        "reasoning_parser": "qwen3",
        "tool_call_parser": "hermes",
    }
    with node_of_models([model], **settings) as n:
        yield n


def script(engine: MockEngineProc, http: httpx.Client, text: str, match: str | None = None) -> str:
    """Queue ``text`` as the answer to the next request whose prompt holds ``match`` (default: a fresh
    marker, returned)."""
    marker = match or f"case-{uuid.uuid4().hex[:12]}"
    r = http.post(f"http://127.0.0.1:{engine.http_port}/mock/responses", json={"text": text, "match": marker})
    assert r.status_code < 300, r.text
    return marker
