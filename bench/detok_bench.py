"""Output-side text CPU per token: detokenizer, stop matcher, logprobs. Prints figures, no asserts.

    .venv/bin/python bench/detok_bench.py [--rounds N]

A realistic ~500-token answer (prose, markdown, code, some CJK and emoji) is encoded with the real
qwen3 and llama-3.1 tokenizers, then fed back token by token (and 4 at a time, as SGLang's
``stream_interval`` sends them). Two detokenizer algorithms are compared:

- ``DecodeStream``: tokenizers' Rust prefix/read-offset stream (what ``IncrementalDetokenizer`` wraps);
- ``py offsets``: the same prefix/read-offset algorithm driven from Python (vLLM v0 / TGI style:
  ``decode`` of the window, and of the new prefix after each emission).

Figures are the median of ``--rounds`` runs (min in brackets), in µs per output token.
"""

from __future__ import annotations

import argparse
import lzma
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shepherd.node.openai.logprobs import TokenTextCache, chat_logprob_entries, completion_logprobs  # noqa: E402
from shepherd.node.output.stop import StopMatcher, StoppingDecoder  # noqa: E402
from shepherd.proto.engine_types import TokenLogprob  # noqa: E402
from shepherd.tokens.detokenizer import IncrementalDetokenizer  # noqa: E402

TOKENIZERS = {
    "qwen3": ROOT / "shepherd" / "tokens" / "assets" / "qwen3" / "tokenizer.json.xz",
    "llama-3.1": ROOT / "tests" / "assets" / "tokenizers" / "llama-3.1" / "tokenizer.json.xz",
}
STOPS = ["\n\nUser:", "</answer>", "###", "Observation:"]

ANSWER = """Sure! Here is a short overview of how incremental detokenization works in an LLM gateway.

## Why it matters

When a model streams tokens, the gateway must turn each new token id into text *as soon as* that
text is final. Some characters span several tokens: for example "你好" or an emoji like 🎉 may be
split into byte pieces, so the gateway holds those bytes until the character is complete.

## A minimal implementation

```python
def step(self, token_id: int) -> str:
    self.ids.append(token_id)
    text = tokenizer.decode(self.ids[self.prefix:])
    if text.endswith("\\ufffd"):
        return ""  # wait for the rest of the character
    new = text[len(self.prefix_text):]
    self.prefix, self.read = self.read, len(self.ids)
    return new
```

Key points:

1. Decode a small window, not the whole output, so each step costs O(1).
2. Keep one token of left context so that SentencePiece tokenizers keep their leading spaces.
3. Flush whatever is held when the stream ends; an invalid byte becomes U+FFFD.

| approach | cost per token |
|---|---|
| full decode each step | grows with the output |
| windowed decode | about a microsecond |

Stop sequences are checked on the text after detokenization; a partial match at the end of the
text is held back until it either completes (and the output is cut) or cannot match any more.
That is all there is to it — 就这样。 Let me know if you want the version with logprobs! 😊
"""


def load(path: Path) -> Tokenizer:
    with lzma.open(path) as f:
        return Tokenizer.from_str(f.read().decode())


def measure(fn: Callable[[], object], per: int, rounds: int) -> str:
    fn()  # warm up
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return f"{statistics.median(times) / per * 1e6:7.2f} [{min(times) / per * 1e6:5.2f}]"


def report(cases: list[tuple[str, Callable[[], object]]], per: int, rounds: int) -> None:
    for label, fn in cases:
        print(f"  {label:<44} {measure(fn, per, rounds)}")


def chunks_of(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def run_one(name: str, tok: Tokenizer, rounds: int) -> None:
    ids = tok.encode(ANSWER * 2, add_special_tokens=False).ids[:500]
    n = len(ids)
    prompt = tok.encode("<|im_start|>user\nExplain detokenization.<|im_end|>\n<|im_start|>assistant\n").ids
    full = tok.decode(ids)
    singles = [[i] for i in ids]
    fours = chunks_of(ids, 4)
    print(f"\n== {name}: {n} output tokens, {len(full)} chars  (µs per token: median [min])")

    def raw_stream(chunks: list[list[int]]) -> str:
        stream = DecodeStream(skip_special_tokens=True)
        out = []
        for c in chunks:
            piece = stream.step(tok, c[0] if len(c) == 1 else c)
            if piece is not None:
                out.append(piece)
        return "".join(out)

    def py_offsets(chunks: list[list[int]]) -> str:
        all_ids: list[int] = []
        prefix = read = 0
        prefix_text = ""
        out = []
        decode = tok.decode
        for c in chunks:
            all_ids.extend(c)
            text = decode(all_ids[prefix:], skip_special_tokens=True)
            if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
                out.append(text[len(prefix_text) :])
                prefix, read = read, len(all_ids)
                prefix_text = decode(all_ids[prefix:read], skip_special_tokens=True)
        return "".join(out)

    def detok(chunks: list[list[int]]) -> str:
        d = IncrementalDetokenizer(tok, prompt_ids=prompt)
        for c in chunks:
            d.step(c)
        d.finish()
        return d.text

    report(
        [
            ("DecodeStream raw, 1/step", lambda: raw_stream(singles)),
            ("DecodeStream raw, 4/step", lambda: raw_stream(fours)),
            ("py offsets, 1/step", lambda: py_offsets(singles)),
            ("py offsets, 4/step", lambda: py_offsets(fours)),
            ("IncrementalDetokenizer, 1/step", lambda: detok(singles)),
            ("IncrementalDetokenizer, 4/step", lambda: detok(fours)),
        ],
        n,
        rounds,
    )

    def construct_many() -> None:
        for _ in range(100):
            IncrementalDetokenizer(tok, prompt_ids=prompt)

    print(
        f"  {'IncrementalDetokenizer(prompt_ids=...), once':<44} {measure(construct_many, 100, rounds)}  µs"
    )

    # stop matching on the detokenizer's real per-token pieces
    d = IncrementalDetokenizer(tok)
    pieces = [(d.step(c), c) for c in singles]

    def stop_only(stops: list[str], include: bool) -> None:
        m = StopMatcher(stops, include_stop_str_in_output=include, eos_token_ids=[151645, 128009])
        for text, c in pieces:
            m.feed(text, c)
        m.flush()

    def pipeline(chunks: list[list[int]]) -> None:
        sd = StoppingDecoder(
            IncrementalDetokenizer(tok, prompt_ids=prompt), StopMatcher(STOPS, eos_token_ids=[151645])
        )
        for c in chunks:
            sd.feed(c)
        sd.finish()

    report(
        [
            ("StopMatcher, no stop strings (ids only)", lambda: stop_only([], False)),
            ("StopMatcher, 4 stop strings", lambda: stop_only(STOPS, False)),
            ("StopMatcher, 4 stop strings, include", lambda: stop_only(STOPS, True)),
            ("StoppingDecoder (detok+stop), 1/step", lambda: pipeline(singles)),
            ("StoppingDecoder (detok+stop), 4/step", lambda: pipeline(fours)),
        ],
        n,
        rounds,
    )

    cache = TokenTextCache.for_tokenizer(tok)
    logprobs = [TokenLogprob(i, -0.5, tuple((i + k, -1.0 - k) for k in range(5))) for i in ids]
    report(
        [
            ("chat logprobs, top 5 (warm cache)", lambda: chat_logprob_entries(logprobs, cache, 5)),
            ("completion logprobs, top 5 (warm cache)", lambda: completion_logprobs(logprobs, cache, 5)),
        ],
        n,
        rounds,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    for name, path in TOKENIZERS.items():
        run_one(name, load(path), args.rounds)


if __name__ == "__main__":
    main()
