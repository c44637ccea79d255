"""What several end-to-end suites (and tests/fuzz/test_fuzz_node.py) share to run a node over a mock
engine: the module-scoped fixtures ``tokenizer_dir`` (the byte-level tokenizer of
tests/e2e/test_node_tools.py, in a private directory) and ``http`` (a client with a 30 s timeout, which
only keeps a regression from hanging), and the flags of a node serving one model, ``qwen3``.

A suite takes a fixture by binding it to a module-level name (pytest finds fixtures among a module's
names): ``tokenizer_dir, http = node_fixtures.tokenizer_dir, node_fixtures.http``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.procs import MockEngineProc
from tests.e2e.test_node_tools import byte_tokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "assets" / "chat_templates"
QWEN3_TEMPLATE = TEMPLATES / "Qwen-Qwen3-0.6B.jinja"


@pytest.fixture(scope="module")
def tokenizer_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        yield byte_tokenizer(Path(tmp) / "bytes")


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as c:
        yield c


def qwen3_flags(engine: MockEngineProc, tokenizer_dir: Path) -> tuple[str, ...]:
    """``smg-node`` flags serving one model, ``qwen3``: ``engine`` over gRPC, the byte-level tokenizer of
    ``tokenizer_dir`` and Qwen3's chat template."""
    return (
        *("--worker-urls", f"grpc://127.0.0.1:{engine.grpc_port}", "--model-id", "qwen3"),
        *("--model-path", str(tokenizer_dir), "--chat-template", str(QWEN3_TEMPLATE)),
    )
