"""Where the tokenizer layer's CPU goes: prints µs per operation, no asserts.

    .venv/bin/python bench/tokenizer_bench.py [--quick] [--asyncio] [--no-pin]

By default the process (and the pool workers it forks) is pinned to one CPU, so that CPU times of
the parent and of a worker are comparable (the two vCPUs here are not equally loaded by neighbours);
``--no-pin`` lets them spread, which adds the cross-CPU wake-up to the wall times.

Sections: inline encode by size; pool round trip by size (wall, parent CPU, worker CPU, one call in
flight and many); cache hits (L0, L1 with only the last turn new); chat template renders (sandbox
flavours, cache hit); the service's render_and_encode; and the inline threshold that follows.

The threshold: a pool call costs the event loop ``parent CPU`` and the machine ``parent + worker``
CPU beyond the encode itself. Encoding inline is right while the encode costs less than that overhead;
above it, sending the work away frees more loop time than the hop burns. ``inline_max_chars`` is the
size where inline encode CPU equals the pool's total overhead (both are printed).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shepherd.node.chat_template import ChatTemplate, make_environment  # noqa: E402
from shepherd.node.token_cache import CacheLimits, TokenCache  # noqa: E402
from shepherd.node.tokenizer import Tokenizer, load_chat_templates  # noqa: E402
from shepherd.node.tokenizer_pool import TokenizerPool, TokenizerService  # noqa: E402

QWEN3 = ROOT / "shepherd" / "node" / "assets" / "qwen3"
TOK = ROOT / "tests" / "assets" / "tokenizers"
QUICK = "--quick" in sys.argv
SIZES = [50, 200, 500, 1000, 2000, 4000, 8000, 16000, 32000]
CLK = os.sysconf("SC_CLK_TCK")


def corpus() -> str:
    files = sorted((ROOT / "shepherd").rglob("*.py"))
    files += sorted((ROOT / "tests" / "assets" / "chat_templates").glob("*.jinja"))
    parts = [p.read_text(encoding="utf-8") for p in files]
    text = "\n".join(parts)
    prose = (
        "The gateway renders the chat template, tokenizes the prompt and routes it to a worker. "
        "Les caches évitent de refaire le travail; 日本語のテキストも少し含まれています。 "
    )
    return (prose * 50 + text) * 3


def best_us(fn: Callable[[], object], n: int, repeat: int = 5) -> float:
    """Median over ``repeat`` runs of the mean µs per call over ``n`` calls (CPU time of this thread)."""
    runs = []
    for _ in range(repeat):
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        runs.append((time.thread_time() - t0) / n * 1e6)
    return statistics.median(runs)


def proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def calls_for(us: float) -> int:
    budget = 0.15 if QUICK else 0.6  # seconds per measurement
    return max(5, min(5000, int(budget * 1e6 / max(us, 1.0))))


def section(title: str) -> None:
    print(f"\n== {title}")


def inline_encode(tok: Tokenizer, text_at: dict[int, str]) -> dict[int, float]:
    section("inline encode (qwen3, tokenizers encode, no cache), CPU µs per call")
    out: dict[int, float] = {}
    print(f"{'chars':>7} {'tokens':>7} {'µs':>9} {'µs/char':>8}")
    for n, text in text_at.items():
        probe = best_us(lambda t=text: tok.encode_uncached(t, False), 3, 1)  # type: ignore[misc]
        us = best_us(lambda t=text: tok.encode_uncached(t, False), calls_for(probe))  # type: ignore[misc]
        out[n] = us
        print(f"{n:>7} {len(tok.encode_uncached(text, False)):>7} {us:>9.1f} {us / n:>8.3f}")
    return out


async def pool_round_trips(
    tok: Tokenizer, text_at: dict[int, str], inline: dict[int, float]
) -> dict[int, tuple[float, float]]:
    section("pool round trip (qwen3, 1 worker, one call in flight), µs per call")
    print(
        f"{'chars':>7} {'wall':>9} {'parent CPU':>11} {'worker CPU':>11} {'inline':>9} "
        f"{'overhead (parent+worker-inline)':>32}"
    )
    pool = TokenizerPool([tok], workers=1)
    await pool.start()
    overhead: dict[int, tuple[float, float]] = {}
    try:
        (pid,) = pool.pids()
        for n in [0, *text_at]:
            text = text_at.get(n, "")
            calls = calls_for(inline.get(n, 5.0) + 40.0) * (2 if n == 0 else 1)
            for _ in range(3):
                await pool.encode("qwen3", text, False)
            w0, p0, t0 = proc_cpu(pid), time.process_time(), time.perf_counter()
            for _ in range(calls):
                await pool.encode("qwen3", text, False)
            wall = (time.perf_counter() - t0) / calls * 1e6
            parent = (time.process_time() - p0) / calls * 1e6
            worker = (proc_cpu(pid) - w0) / calls * 1e6
            extra = parent + worker - inline.get(n, 0.0)
            overhead[n] = (parent, worker)
            cells = f"{n:>7} {wall:>9.1f} {parent:>11.1f} {worker:>11.1f} {inline.get(n, 0.0):>9.1f}"
            print(f"{cells} {extra:>32.1f}")
        section("pool, many calls in flight (2 workers, 64 concurrent 200-char encodes), µs per call")
        await pool.close()
        pool = TokenizerPool([tok], workers=2)
        await pool.start()
        text = text_at[200]
        total = 1000 if QUICK else 4000
        p0, t0 = time.process_time(), time.perf_counter()
        sem = asyncio.Semaphore(64)

        async def one() -> None:
            async with sem:
                await pool.encode("qwen3", text, False)

        await asyncio.gather(*(one() for _ in range(total)))
        wall = (time.perf_counter() - t0) / total * 1e6
        parent = (time.process_time() - p0) / total * 1e6
        print(f"wall {wall:.1f}  parent CPU {parent:.1f}  (inline encode of the same: {inline[200]:.1f})")
    finally:
        await pool.close()
    return overhead


def cache_hits(tok: Tokenizer, text_at: dict[int, str]) -> None:
    section("cache hits (qwen3), CPU µs per call")
    cache = TokenCache(tok.hf)
    for n in (200, 2000, 32000):
        text = text_at[n]
        cache.encode(text, False)
        us = best_us(lambda t=text: cache.encode(t, False), calls_for(2.0))  # type: ignore[misc]
        print(f"L0 hit, {n:>6} chars ({len(cache.encode(text, False))} ids, a list copy): {us:8.2f}")
    # a multi-turn chat where only the last turn is new: L1 hits for the old turns
    turns = [text_at[500][i * 40 : i * 40 + 400] for i in range(8)]
    convo = "<|im_start|>system\n" + text_at[2000] + "<|im_end|>\n"
    for i, t in enumerate(turns):
        convo += f"<|im_start|>{'user' if i % 2 == 0 else 'assistant'}\n{t}<|im_end|>\n"
    l1 = TokenCache(tok.hf, CacheLimits(exact_entries=0))
    l1.encode(convo, False)
    counter = [0]

    def new_turn() -> object:
        counter[0] += 1
        return l1.encode(convo + f"<|im_start|>user\nquestion number {counter[0]}?<|im_end|>\n", False)

    full_text = convo + "<|im_start|>user\nquestion number 0?<|im_end|>\n"
    us_l1 = best_us(new_turn, calls_for(100.0))
    us_full = best_us(lambda: tok.encode_uncached(full_text, False), calls_for(2000.0))
    print(
        f"L1, {len(full_text)}-char chat, only the last turn new: {us_l1:.1f}"
        f"  (full encode: {us_full:.1f}, {len(tok.encode_uncached(full_text, False))} ids)"
    )
    splitter_us = best_us(lambda: l1._splitter.split(full_text), calls_for(20.0))
    print(f"  of which finding the special-token boundaries: {splitter_us:.1f}")


def renders() -> None:
    section("chat template render, CPU µs per call")
    msgs = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello! Who are you?"},
        {"role": "assistant", "content": "I am an assistant."},
    ]
    families = {
        "qwen3": load_chat_templates(QWEN3)["default"],
        "llama-3.1": load_chat_templates(TOK / "llama-3.1")["default"],
        "deepseek-v3.1": load_chat_templates(TOK / "deepseek-v3")["v3_1"],
        "mistral-nemo": load_chat_templates(TOK / "mistral-nemo")["default"],
        "gpt-oss": load_chat_templates(TOK / "gpt-oss")["default"],
    }
    print(f"{'template':<14} {'immutable sandbox':>18} {'sandbox':>9} {'compile':>9}")
    src = families["qwen3"].source
    for name, t in families.items():
        sandboxed = ChatTemplate(
            t.source, special_tokens=t.special_tokens, env=make_environment(immutable=False)
        )
        a = best_us(lambda t=t: t.render_uncached(msgs), calls_for(200.0))  # type: ignore[misc]
        b = best_us(lambda s=sandboxed: s.render_uncached(msgs), calls_for(200.0))  # type: ignore[misc]
        c = best_us(lambda s=t.source: ChatTemplate(s), 5 if QUICK else 20, 3)  # type: ignore[misc]
        print(f"{name:<14} {a:>18.1f} {b:>9.1f} {c:>9.0f}")
    qwen = families["qwen3"]
    qwen.render(msgs)
    hit = best_us(lambda: qwen.render(msgs), calls_for(5.0))
    key = best_us(lambda: qwen.serialize(msgs, None, True, False, None), calls_for(2.0))
    print(f"render cache hit (qwen3, 3 messages): {hit:.1f}  (of which the key: {key:.1f})")
    big = [*msgs, *[{"role": "user" if i % 2 else "assistant", "content": "word " * 200} for i in range(20)]]
    us = best_us(lambda: qwen.render_uncached(big), calls_for(1000.0))
    size = len(qwen.serialize(big, None, True, False, None) or b"")
    print(
        f"render of a 23-message chat ({size} bytes serialized): {us:.1f}  ({us / size * 1000:.1f} ns/byte)"
    )
    small = len(qwen.serialize(msgs, None, True, False, None) or b"")
    print(f"render of the 3-message chat ({small} bytes serialized): see qwen3 above")
    del src


async def service_path(text_at: dict[int, str]) -> None:
    section("TokenizerService.render_and_encode (qwen3, defaults), µs wall per call on the event loop")
    svc = TokenizerService({"qwen3": QWEN3}, workers=2)
    await svc.start()
    try:
        history: list[dict[str, Any]] = [{"role": "system", "content": text_at[2000]}]
        history += [
            {"role": "user" if i % 2 == 0 else "assistant", "content": text_at[500][i * 50 :]}
            for i in range(6)
        ]
        n = 200 if QUICK else 1000
        t0, p0 = time.perf_counter(), time.process_time()
        for i in range(n):
            await svc.render_and_encode("qwen3", [*history, {"role": "user", "content": f"new question {i}"}])
        wall = (time.perf_counter() - t0) / n * 1e6
        cpu = (time.process_time() - p0) / n * 1e6
        print(f"7-turn chat, last turn new each time: wall {wall:.1f}, parent CPU {cpu:.1f}")
        same = [*history, {"role": "user", "content": "repeated"}]
        await svc.render_and_encode("qwen3", same)
        t0 = time.perf_counter()
        for _ in range(n):
            await svc.render_and_encode("qwen3", same)
        print(f"identical request (render cache + L0 hit): {(time.perf_counter() - t0) / n * 1e6:.1f}")
        print(f"stats: {svc.stats()}")
    finally:
        await svc.close()


async def pool_renders(tok: Tokenizer) -> tuple[dict[int, float], dict[int, tuple[float, float]]]:
    section("chat render (qwen3): inline vs pool round trip, by number of messages, µs per call")
    print(f"{'msgs':>7} {'bytes':>7} {'inline':>9} {'pool wall':>10} {'parent CPU':>11} {'worker CPU':>11}")
    tpl = tok.chat_template()
    pool = TokenizerPool([tok], workers=1)
    await pool.start()
    inline: dict[int, float] = {}
    costs: dict[int, tuple[float, float]] = {}
    try:
        (pid,) = pool.pids()
        for count in (1, 3, 7, 15, 31, 63):
            msgs = [
                {"role": "system", "content": "You are a helpful assistant."},
                *[
                    {"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 40}
                    for i in range(count)
                ],
            ]
            key = tpl.serialize(msgs, None, True, False, None)
            assert key is not None
            size = len(key)
            us = best_us(lambda m=msgs: tpl.render_uncached(m), calls_for(300.0))  # type: ignore[misc]
            calls = calls_for(us + 60.0)
            for _ in range(3):
                await pool.render("qwen3", tpl.name, key)
            w0, p0, t0 = proc_cpu(pid), time.process_time(), time.perf_counter()
            for _ in range(calls):
                await pool.render("qwen3", tpl.name, key)
            wall = (time.perf_counter() - t0) / calls * 1e6
            parent = (time.process_time() - p0) / calls * 1e6
            worker = (proc_cpu(pid) - w0) / calls * 1e6
            inline[len(msgs)], costs[len(msgs)] = us, (parent, worker)
            print(f"{len(msgs):>7} {size:>7} {us:>9.1f} {wall:>10.1f} {parent:>11.1f} {worker:>11.1f}")
    finally:
        await pool.close()
    return inline, costs


def break_even(what: str, unit: str, inline: dict[int, float], costs: dict[int, tuple[float, float]]) -> None:
    """Sending work away pays when the event-loop time it saves (inline - parent CPU) is at least the
    CPU the hop adds to the machine (parent + worker - inline)."""
    print(f"{what}: {'size':>7} {'loop time saved':>16} {'CPU added':>10}  verdict")
    first_pool: int | None = None
    for n in sorted(inline):
        parent, worker = costs[n]
        saved, added = inline[n] - parent, parent + worker - inline[n]
        pays = saved >= added
        if pays and first_pool is None:
            first_pool = n
        elif not pays:
            first_pool = None
        print(f"{'':>{len(what) + 1}} {n:>7} {saved:>16.1f} {added:>10.1f}  {'pool' if pays else 'inline'}")
    print(f"=> {what}: the pool pays from about {first_pool} {unit} on")


async def main() -> None:
    if "--no-pin" not in sys.argv:
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        print(f"pinned to CPU {cpu} (workers inherit it)")
    text = corpus()
    tok = Tokenizer.load(QWEN3, "qwen3")
    text_at = {n: text[1000 : 1000 + n] for n in SIZES}
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    inline = inline_encode(tok, text_at)
    overhead = await pool_round_trips(tok, text_at, inline)
    cache_hits(tok, text_at)
    renders()
    render_inline, render_costs = await pool_renders(tok)
    await service_path(text_at)
    section("inline thresholds")
    break_even("encode", "chars", inline, {n: c for n, c in overhead.items() if n})
    break_even("render", "messages", render_inline, render_costs)
    print(f"\nload at the end {os.getloadavg()[0]:.2f}")


def run() -> None:
    """On uvloop, as the node runs (``--asyncio`` for the default loop)."""
    if "--asyncio" not in sys.argv:
        try:
            import uvloop

            print("event loop: uvloop")
            uvloop.run(main())
            return
        except ImportError:
            pass
    print("event loop: asyncio")
    asyncio.run(main())


if __name__ == "__main__":
    run()
