"""Reasoning and tool-call parser CPU per output token, per family. Prints figures, no asserts.

    .venv/bin/python bench/parser_bench.py [--rounds N] [--tokens N]

Each family gets a realistic output of about ``--tokens`` tokens (a long reasoning block and answer
for the reasoning parsers; prose, then two tool calls with sizeable arguments, for the tool parsers).
The text is cut into token deltas with the real qwen3 tokenizer (its offsets: the exact pieces a
detokenizer emits; markers that are not qwen3 special tokens arrive split, the harder case), then fed
to a fresh parser delta by delta, plus ``finish``. Figures: µs per output token, median of
``--rounds`` runs (min in brackets). Bar: ≤ 5 µs/token.
"""

from __future__ import annotations

import argparse
import json
import lzma
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shepherd.parsers import get_reasoning_parser, get_tool_parser  # noqa: E402

PROSE = (
    "Let me think about this carefully. The user wants the weather in Paris and the local time, "
    "so I should call both tools; the units should be metric because they wrote in French earlier. "
    "Also check whether 3 < 4 and {braces} or [brackets] in the text confuse anything. "
)
ARGS = {"location": "Paris, France", "unit": "celsius", "note": PROSE * 2, "days": 3, "flags": [1, 2, 3]}
AJ = json.dumps(ARGS)
DS = "<｜tool▁sep｜>"
HARMONY = f"<|constrain|>json<|message|>{AJ}<|call|>"


def _reasoning_samples(n_chars: int) -> dict[str, tuple[dict[str, bool], str]]:
    body = (PROSE * (n_chars // len(PROSE) + 1))[: n_chars // 2]
    answer = (PROSE * (n_chars // len(PROSE) + 1))[: n_chars // 2]
    think = f"<think>\n{body}\n</think>\n\n{answer}"
    return {
        "deepseek_r1": ({}, f"{body}\n</think>\n\n{answer}"),
        "qwen3": ({}, think),
        "qwen3_thinking": ({}, f"{body}\n</think>\n\n{answer}"),
        "kimi": ({}, f"◁think▷{body}◁/think▷{answer}"),
        "kimi_k2": ({}, think),
        "glm45": ({}, think),
        "gpt_oss": (
            {},
            f"<|channel|>analysis<|message|>{body}<|end|><|start|>assistant<|channel|>final<|message|>"
            f"{answer}<|return|>",
        ),
        "deepseek_v3": ({"prompt_opened_think": True}, f"{body}</think>{answer}"),
        "minimax": ({}, f"{body}\n</think>\n\n{answer}"),
        "step3": ({}, f"{body}\n</think>\n\n{answer}"),
        "cohere": (
            {"prompt_opened_think": True},
            f"{body}<|END_THINKING|><|START_TEXT|>{answer}<|END_TEXT|>",
        ),
        "nemotron": ({"prompt_opened_think": True}, f"{body}\n</think>\n{answer}"),
        "(thinking off)": ({"thinking_enabled": False}, answer * 2),
    }


def _tool_samples(n_chars: int) -> dict[str, str]:
    prose = (PROSE * (n_chars // len(PROSE) + 1))[: max(0, n_chars - 2 * len(AJ))]
    xml_params = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
        for k, v in ARGS.items()
    )
    glm_params = "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}</arg_value>\n"
        for k, v in ARGS.items()
    )
    hermes_call = f'<tool_call>\n{{"name": "get_weather", "arguments": {AJ}}}\n</tool_call>\n'
    return {
        "hermes": f"{prose}\n{hermes_call}{hermes_call}",
        "llama3": f'<|python_tag|>{{"name": "get_weather", "parameters": {AJ}}}; '
        f'{{"name": "t", "parameters": {AJ}}}' + prose,
        "mistral": f"{prose}[TOOL_CALLS]get_weather[ARGS]{AJ}[TOOL_CALLS]get_time[ARGS]{AJ}",
        "qwen3_coder": f"{prose}\n"
        + f"<tool_call>\n<function=get_weather>\n{xml_params}</function>\n</tool_call>\n" * 2,
        "deepseek_v3": f"{prose}<｜tool▁calls▁begin｜>"
        + f"<｜tool▁call▁begin｜>function{DS}get_weather\n```json\n{AJ}\n```<｜tool▁call▁end｜>" * 2
        + "<｜tool▁calls▁end｜>",
        "deepseek_v31": f"{prose}<｜tool▁calls▁begin｜>"
        + f"<｜tool▁call▁begin｜>get_weather{DS}{AJ}<｜tool▁call▁end｜>" * 2
        + "<｜tool▁calls▁end｜>",
        "kimi_k2": f"{prose}<|tool_calls_section_begin|>"
        + f"<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{AJ}<|tool_call_end|>" * 2
        + "<|tool_calls_section_end|>",
        "glm45": f"{prose}\n" + f"<tool_call>get_weather\n{glm_params}</tool_call>\n" * 2,
        "gpt_oss": f"{prose}"
        + f"<|start|>assistant<|channel|>commentary to=functions.get_weather {HARMONY}" * 2,
        "pythonic": "[get_weather(location='Paris', note="
        + repr(PROSE * 4)
        + "), get_time(tz='CET')]"
        + prose,
        "json": f'[{{"name": "a", "arguments": {AJ}}}, {{"name": "b", "arguments": {AJ}}}]' + prose,
        "cohere": f"{prose}<|START_ACTION|>["
        + f'{{"tool_call_id": "0", "tool_name": "a", "parameters": {AJ}}}, '
        + f'{{"tool_call_id": "1", "tool_name": "b", "parameters": {AJ}}}]<|END_ACTION|>',
        "(hermes, no calls)": prose + prose,
        "(hermes, 1 long call)": '<tool_call>\n{"name": "write_file", "arguments": '
        + json.dumps({"path": "a.py", "content": PROSE * (n_chars // len(PROSE))})
        + "}\n</tool_call>",
        "(qwen3_coder, long)": "<tool_call>\n<function=write_file>\n<parameter=content>\n"
        + PROSE * (n_chars // len(PROSE))
        + "\n</parameter>\n</function>\n</tool_call>",
    }


def _deltas(tok: Tokenizer, text: str) -> list[str]:
    enc = tok.encode(text, add_special_tokens=False)
    out = []
    prev = 0
    for _, end in enc.offsets:
        if end > prev:
            out.append(text[prev:end])
            prev = end
    if prev < len(text):
        out.append(text[prev:])
    return out


def _time(run: Callable[[], None], n_tokens: int, rounds: int) -> tuple[float, float]:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        run()
        samples.append((time.perf_counter() - t0) * 1e6 / n_tokens)
    return statistics.median(samples), min(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=1000, help="approximate output tokens per sample")
    args = ap.parse_args()
    raw = lzma.decompress(
        (ROOT / "shepherd" / "tokens" / "assets" / "qwen3" / "tokenizer.json.xz").read_bytes()
    )
    tok = Tokenizer.from_str(raw.decode())
    n_chars = args.tokens * 4

    print(f"reasoning parsers: µs per output token, median [min] of {args.rounds} rounds")
    for family, (kwargs, text) in _reasoning_samples(n_chars).items():
        deltas = _deltas(tok, text)
        name = "qwen3" if family.startswith("(") else family

        def run_r(name: str = name, kwargs: dict[str, bool] = kwargs, deltas: list[str] = deltas) -> None:
            p = get_reasoning_parser(name, **kwargs)
            for d in deltas:
                p.feed(d)
            p.finish()

        med, lo = _time(run_r, len(deltas), args.rounds)
        print(f"  {family:<22} {len(deltas):>6} tokens  {med:6.2f} [{lo:5.2f}]")

    print(f"tool parsers: µs per output token, median [min] of {args.rounds} rounds")
    for family, text in _tool_samples(n_chars).items():
        deltas = _deltas(tok, text)
        name = family.strip("(").split(",")[0] if family.startswith("(") else family

        def run_t(name: str = name, deltas: list[str] = deltas) -> None:
            p = get_tool_parser(name, id_factory=lambda: "call_x")
            for d in deltas:
                p.feed(d)
            p.finish()

        med, lo = _time(run_t, len(deltas), args.rounds)
        print(f"  {family:<22} {len(deltas):>6} tokens  {med:6.2f} [{lo:5.2f}]")


if __name__ == "__main__":
    main()
