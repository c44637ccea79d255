"""CPU per streamed token of the node's chat output stage, with and without the parser layer.

    .venv/bin/python bench/chat_output_bench.py [--rounds N] [--tokens N] [--per-message K]

Function level, no HTTP: a realistic model turn (qwen3 tokenizer ids) is fed as engine messages of
``--per-message`` tokens each through ``Generation._drive`` — detokenizer → stop matcher → (reasoning
parser → tool parser) → SSE chunk bytes — exactly the code a streamed chat request runs per engine
message. Each configuration is the same request shape; "plain" is a model with no parser (the parser
layer is skipped entirely), the others add the parsers a model family gets. Figures: µs per output
token, median [min] of ``--rounds`` runs; "parser layer": the median over rounds of (this
configuration − plain), the configurations being measured in turn within each round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shepherd.node.api.generation import Generation, Job  # noqa: E402
from shepherd.node.config import EMBEDDED_MODEL_DIR, NodeConfig  # noqa: E402
from shepherd.node.metrics import NodeMetrics  # noqa: E402
from shepherd.node.openai.requests import parse_chat  # noqa: E402
from shepherd.node.output.chat import shape_chat  # noqa: E402
from shepherd.node.output.choice import ChoiceState  # noqa: E402
from shepherd.proto.engine_types import EngineChunk, EngineComplete, EngineEvent  # noqa: E402
from shepherd.tokens.tokenizer import Tokenizer  # noqa: E402

PROSE = (
    "The river ran slowly past the old mill, and the morning light settled on the water like a thin "
    "sheet of gold. A few boats were tied along the bank, their ropes creaking as the current pulled "
    "at them; near the bridge a woman sold bread and apples from a wooden cart (prices: 3 < 4). "
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": n,
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "note": {"type": "string"}},
            },
        },
    }
    for n in ("get_weather", "get_time")
]


def _call(name: str) -> str:
    args = json.dumps({"city": "Paris", "note": PROSE * 2})
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def outputs(n_chars: int) -> dict[str, tuple[tuple[str | None, str | None], dict[str, Any], str]]:
    prose = (PROSE * (n_chars // len(PROSE) + 1))[:n_chars]
    half = prose[: n_chars // 2]
    calls = f"{_call('get_weather')}\n{_call('get_time')}"
    return {
        "plain (no parser)": ((None, None), {}, prose),
        "qwen3 reasoning, text": (("qwen3", None), {}, f"<think>\n{half}\n</think>\n\n{half}"),
        "qwen3 + hermes, text": (
            ("qwen3", "hermes"),
            {"tools": TOOLS},
            f"<think>\n{half}\n</think>\n\n{half}",
        ),
        "qwen3 + hermes, calls": (
            ("qwen3", "hermes"),
            {"tools": TOOLS},
            f"<think>\n{half[: n_chars // 4]}\n</think>\n\n{half[: n_chars // 4]}\n{calls}",
        ),
        "gpt_oss harmony, text": (
            ("gpt_oss", "gpt_oss"),
            {"tools": TOOLS},
            f"<|channel|>analysis<|message|>{half}<|end|><|start|>assistant<|channel|>final<|message|>{half}",
        ),
    }


class _Gateway:
    def __init__(self) -> None:
        self.metrics = NodeMetrics()
        self.cfg = NodeConfig()


@dataclass
class _Stream:
    events: list[list[EngineEvent]]
    completed: bool = False

    async def batches(self) -> AsyncIterator[list[EngineEvent]]:
        for b in self.events:
            yield b


def build(
    tok: Tokenizer, families: tuple[str | None, str | None], body: dict[str, Any], ids: list[int], k: int
) -> tuple[Generation, Job, _Stream]:
    req = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, **body})
    prompt_ids = tok.encode(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    shaping = shape_chat(families, req, "<|im_start|>assistant\n")
    states = [ChoiceState(0, tok, shaping.sampling, prompt_ids)]
    g = Generation(
        None,  # type: ignore[arg-type]
        _Gateway(),  # type: ignore[arg-type]
        "m",
        tok,
        shaping.sampling,
        chat=True,
        rid="chatcmpl-bench",
        t0=time.perf_counter(),
        logprobs=None,
        shaping=shaping,
    )
    events: list[list[EngineEvent]] = [[EngineChunk(0, ids[i : i + k])] for i in range(0, len(ids), k)]
    events.append([EngineComplete(0, "stop")])
    return g, Job(prompt_ids, "", states, 0), _Stream(events)


async def _run(g: Generation, job: Job, stream: _Stream) -> int:
    size = 0

    async def emit(chunks: list[bytes], last: bool = False) -> None:
        nonlocal size
        size += len(chunks)

    await g._drive(stream, job, emit)  # type: ignore[arg-type]
    return size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=1000, help="approximate output tokens per sample")
    ap.add_argument("--per-message", type=int, default=1, help="tokens per engine message")
    args = ap.parse_args()
    tok = Tokenizer.load(EMBEDDED_MODEL_DIR, "qwen3")
    eos = tok.eos_token_ids[0]
    loop = asyncio.new_event_loop()
    print(
        f"chat output stage, CPU µs per streamed token ({args.per_message} token(s) per engine message), "
        f"median [min] of {args.rounds} rounds"
    )
    cases = outputs(args.tokens * 4)
    token_ids = {
        label: [*tok.encode(text, add_special_tokens=False), eos] for label, (_, _, text) in cases.items()
    }
    for label, (families, body, _) in cases.items():  # warm-up: caches, metric labels, first calls
        loop.run_until_complete(_run(*build(tok, families, body, token_ids[label], args.per_message)))
    samples: dict[str, list[float]] = {label: [] for label in cases}
    chunks: dict[str, int] = {}
    for _ in range(args.rounds):  # configurations interleaved: a noisy neighbour hits them alike
        for label, (families, body, _) in cases.items():
            ids = token_ids[label]
            g, job, stream = build(tok, families, body, ids, args.per_message)
            t0 = time.process_time()
            chunks[label] = loop.run_until_complete(_run(g, job, stream))
            samples[label].append((time.process_time() - t0) * 1e6 / len(ids))
    plain = samples["plain (no parser)"]
    for label, xs in samples.items():
        diff = statistics.median(x - p for x, p in zip(xs, plain, strict=True))
        extra = "" if xs is plain else f"  parser layer {diff:+5.2f}"
        print(
            f"  {label:<24} {len(token_ids[label]):>6} tokens {chunks[label]:>6} chunks"
            f"  {statistics.median(xs):6.2f} [{min(xs):5.2f}]{extra}"
        )
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


if __name__ == "__main__":
    main()
