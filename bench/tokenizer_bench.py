"""Where the tokenizer layer's CPU goes: prints µs per operation, no asserts.

    .venv/bin/python bench/tokenizer_bench.py [--quick] [--asyncio] [--no-pin]
    .venv/bin/python bench/tokenizer_bench.py --fast-bpe [--quick] [--no-pin]   # only FastBPE sections
    .venv/bin/python bench/tokenizer_bench.py --fast-bpe-verify [family...]      # slow exhaustive checks
    .venv/bin/python bench/tokenizer_bench.py --node [--quick]   # only the node's per-request call
    .venv/bin/python bench/tokenizer_bench.py --kinds [--quick]  # only the encode cost by kind of text

By default the process (and the pool workers it forks) is pinned to one CPU, so that CPU times of
the parent and of a worker are comparable (the two vCPUs here are not equally loaded by neighbours);
``--no-pin`` lets them spread, which adds the cross-CPU wake-up to the wall times.

Sections: FastBPE against tokenizers (µs per encode of 150/1,500/8,000-token texts; with --fast-bpe
also which tokenizers get it and why, with identical ids on a corpus); inline encode by size; pool
round trip by size (wall, parent CPU, worker CPU, one call in flight and many); cache hits (L0, L1
with only the last turn new); chat template renders (sandbox flavours, cache hit); the service's
render_and_encode; and the inline threshold that follows.

The threshold: a pool call costs the event loop ``parent CPU`` and the machine ``parent + worker``
CPU beyond the encode itself. Encoding inline is right while the encode costs less than that overhead;
above it, sending the work away frees more loop time than the hop burns. ``inline_max_chars`` is the
size where inline encode CPU equals the pool's total overhead (both are printed). Inline encodes
and pool workers both go through ``TokenCache.encode_pieces`` (FastBPE when the tokenizer has one).

``--fast-bpe-verify`` runs what is too slow for a build or a test, per family (default: qwen3,
llama-3.1, gpt2): every code point of planes 0-16 in a dozen contexts through both encoders (regex
classes, NFC), and for tokenizers whose merges tie (several splits of one token), a search over
adversarial words (each such token twice, overlapping at its borders, around another token) for a
state where HF's merge order and tiktoken's leftmost rule would pick different pairs.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shepherd.loadgen.prompts import PromptConfig, PromptFactory  # noqa: E402
from shepherd.tokens.cache import CacheLimits, TokenCache  # noqa: E402
from shepherd.tokens.chat_env import make_environment  # noqa: E402
from shepherd.tokens.chat_template import ChatTemplate  # noqa: E402
from shepherd.tokens.fast_bpe_core import byte_level_decoder  # noqa: E402
from shepherd.tokens.pool import TokenizerPool  # noqa: E402
from shepherd.tokens.service import (  # noqa: E402
    DEFAULT_INLINE_MAX_ASCII_CHARS,
    DEFAULT_INLINE_MAX_CHARS,
    TokenizerService,
)
from shepherd.tokens.tokenizer import Tokenizer, load_chat_templates  # noqa: E402

QWEN3 = ROOT / "shepherd" / "tokens" / "assets" / "qwen3"
TOK = ROOT / "tests" / "assets" / "tokenizers"
SHARED = Path("/work/shared/assets/tokenizers")
QUICK = "--quick" in sys.argv
SIZES = [50, 200, 500, 1000, 1500, 2000, 3000, 4000, 8000, 16000, 32000]
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
    """What an inline encode costs now (``TokenCache.encode_pieces``: FastBPE when there is one),
    with plain tokenizers beside it."""
    section("inline encode (qwen3, no cache), CPU µs per call: tokenizers / the inline path (FastBPE)")
    out: dict[int, float] = {}
    print(f"{'chars':>7} {'tokens':>7} {'HF µs':>9} {'inline µs':>10} {'µs/char':>8} {'HF/inline':>10}")
    encode = tok.cache.encode_pieces
    for n, text in text_at.items():
        probe = best_us(lambda t=text: tok.encode_uncached(t, False), 3, 1)  # type: ignore[misc]
        hf = best_us(lambda t=text: tok.encode_uncached(t, False), calls_for(probe))  # type: ignore[misc]
        us = best_us(lambda t=text: encode([t], False), calls_for(probe / 4))  # type: ignore[misc]
        out[n] = us
        tokens = len(tok.encode_uncached(text, False))
        print(f"{n:>7} {tokens:>7} {hf:>9.1f} {us:>10.1f} {us / n:>8.3f} {hf / us:>10.2f}")
    return out


def realistic_texts(tok: Tokenizer) -> dict[str, dict[int, str]]:
    """Texts of about 150 / 1,500 / 8,000 qwen3 tokens: the benchmark's user messages (distinct
    sentences and a reference number), source code, and prose in several scripts."""
    factory = PromptFactory(PromptConfig(prompt_tokens=400))
    chat = " ".join(factory.user_message(i) for i in range(400))
    code = corpus()[20000:]
    mixed = (
        "Die Lieferung kam zwei Tage zu spät, und die Verpackung war beschädigt. "
        "La réunion est reportée à jeudi prochain, merci de confirmer votre présence. "
        "Наш сервер перезапускается каждую ночь в 3:00 по московскому времени. "
        "会議の議事録を明日までに共有してください。予算は約120万円です。 "
        "我们需要在下周五之前完成测试，并提交最终报告。 "
        "¿Podrías revisar el contrato antes de firmarlo? Gracias 🙏 "
        "Η παράδοση θα γίνει τη Δευτέρα. "
        "नमस्ते, मेरा ऑर्डर अभी तक नहीं आया है। "
        "\n\n- item one\n- item two\n\n"
    ) * 300
    out: dict[str, dict[int, str]] = {}
    for name, text in (("chat", chat), ("code", code), ("mixed", mixed)):
        ids = tok.hf.encode(text, add_special_tokens=False)
        sized: dict[int, str] = {}
        for n in (150, 1500, 8000):
            end = ids.offsets[min(n, len(ids.ids)) - 1][1]
            sized[n] = text[:end]
        out[name] = sized
    return out


def fast_vs_hf(tok: Tokenizer, family: str) -> None:
    """µs per encode of realistic texts, tokenizers vs FastBPE (both exact)."""
    fast = tok.cache.fast
    if fast is None:
        print(f"{family}: no FastBPE ({tok.cache.fast_reason})")
        return
    print(f"{'text':<6} {'tokens':>7} {'chars':>7} {'HF µs':>10} {'fast µs':>10} {'HF/fast':>8}  same ids")
    for kind, sized in realistic_texts(tok).items():
        for text in sized.values():
            want = tok.hf.encode(text, add_special_tokens=False).ids
            same = fast.encode(text, False) == want
            probe = best_us(lambda t=text: tok.hf.encode(t, add_special_tokens=False), 3, 1)  # type: ignore[misc]
            hf = best_us(lambda t=text: tok.hf.encode(t, add_special_tokens=False), calls_for(probe))  # type: ignore[misc]
            us = best_us(lambda t=text: fast.encode(t, False), calls_for(probe / 4))  # type: ignore[misc]
            print(f"{kind:<6} {len(want):>7} {len(text):>7} {hf:>10.1f} {us:>10.1f} {hf / us:>8.2f}  {same}")


def load_family(family: str) -> Tokenizer | None:
    """A family from the repo copies, else from /work/shared (None if neither has it)."""
    for d in (QWEN3 if family == "qwen3" else TOK / family, SHARED / family):
        if (d / "tokenizer.json").is_file() or (d / "tokenizer.json.xz").is_file():
            return Tokenizer.load(d, family)
    return None


FAMILIES = ("qwen3", "llama-3.1", "gpt2", "qwen2.5", "deepseek-v3", "gpt-oss", "mistral-nemo")


def fast_bpe_families() -> None:
    section("FastBPE per tokenizer family: accelerated or why not; ids on a mixed corpus; load time")
    factory = PromptFactory(PromptConfig(prompt_tokens=300))
    probe_texts = [factory.user_message(i) for i in range(200)]
    probe_texts += [corpus()[i : i + 3000] for i in range(0, 60000, 3000)]
    for sized in realistic_texts(Tokenizer.load(QWEN3, "qwen3")).values():
        probe_texts += list(sized.values())
    for family in FAMILIES:
        t0 = time.perf_counter()
        tok = load_family(family)
        took = time.perf_counter() - t0
        if tok is None:
            print(f"{family:<13} not found")
            continue
        fast = tok.cache.fast
        plain = Tokenizer.load(tok.path, family, fast_bpe=False)
        t1 = time.perf_counter()
        Tokenizer.load(tok.path, family, fast_bpe=False)
        plain_took = time.perf_counter() - t1
        if fast is None:
            print(f"{family:<13} HF only: {tok.cache.fast_reason}")
            continue
        added = list(tok.hf.get_added_tokens_decoder().values())[:40]
        texts = probe_texts + [t.content.join(probe_texts[:3]) for t in added]
        mismatches = sum(
            fast.encode(t, add) != plain.hf.encode(t, add_special_tokens=add).ids
            for t in texts
            for add in (False, True)
        )
        print(
            f"{family:<13} FastBPE: {fast.description}; {2 * len(texts)} encodes, {mismatches} mismatches; "
            f"load {took:.2f} s (without FastBPE {plain_took:.2f} s)"
        )


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
        us = (time.perf_counter() - t0) / n * 1e6
        print(f"identical request (skeleton fill or render cache, then L0 hit): {us:.1f}")
        print(f"stats: {svc.stats()}")
    finally:
        await svc.close()


def _drive(coro: Any) -> Any:
    """Run a coroutine that never suspends (the inline path) without an event loop hop."""
    try:
        coro.send(None)
    except StopIteration as e:
        return e.value
    raise RuntimeError("the coroutine suspended: not the inline path")


def node_call() -> None:
    """What the node does per chat request before the engine: ``render_and_encode`` through
    ``TokenizerService`` and its caches (inline path: every remainder is under the pool thresholds,
    so ``workers=0`` runs the same code as the node's pool-backed service; a follow-up turn's render is
    over the 8-message threshold, but once the pool has rendered its shape the node fills the
    skeleton the worker sent back, as here). Messages are the load generator's (``smg-bench
    gateway``): the shared system prompt plus a distinct ~190-token user message per call, parsed from
    JSON as the node parses them. CPU µs per call (process time, collector off), best of ``rounds``
    runs over ``n`` distinct requests; "tiktoken" is ``encode_ordinary`` alone on the new turn's text
    (what any exact encoder pays), "rest" the tokenizer layer's own work around it."""
    import orjson

    from shepherd.loadgen.prompts import load_qwen3_tokenizer

    section("node call: TokenizerService.render_and_encode (qwen3), CPU µs per call, best of rounds")
    factory = PromptFactory(PromptConfig(prompt_tokens=250), load_qwen3_tokenizer())
    n = 300 if QUICK else 1500
    rounds = 5 if QUICK else 9
    svc = TokenizerService({"qwen3": QWEN3}, workers=0)
    _drive(svc.start())
    tok = svc.get("qwen3")
    fast = tok.cache.fast
    base = 1_000_000  # distinct from anything else this process encoded

    def requests(start: int, history: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        out = []
        for i in range(start, start + n):
            body = orjson.dumps(
                {"messages": [*history, {"role": "user", "content": factory.user_message(base + i)}]}
            )
            out.append(orjson.loads(body)["messages"])
        return out

    def measure(label: str, history: list[dict[str, Any]], offset: int) -> None:
        call = svc.render_and_encode
        _drive(call("qwen3", [*history, {"role": "user", "content": "warm up"}], None, True, False, {}))
        best = best_tt = float("inf")
        for r in range(rounds):
            batch = requests(offset + r * n, history)
            gc.disable()  # the collector's pauses are the node's gc_tuning's business, not this path's
            try:
                t0 = time.process_time()
                for msgs in batch:
                    _drive(call("qwen3", msgs, None, True, False, {}))
                best = min(best, (time.process_time() - t0) / n * 1e6)
            finally:
                gc.enable()
            if fast is not None:  # tiktoken on what was encoded: the user turn's gap text
                gaps = [f"user\n{m[-1]['content']}" for m in requests(offset + (r + rounds) * n, history)]
                enc = fast._encode_ordinary
                t0 = time.process_time()
                for g in gaps:
                    enc(g)
                best_tt = min(best_tt, (time.process_time() - t0) / n * 1e6)
        print(f"{label:<44} total {best:7.1f}   tiktoken {best_tt:6.1f}   rest {best - best_tt:6.1f}")

    system = [{"role": "system", "content": factory.system_prompt}]
    measure("[system, new user] (the benchmark's request)", system, 0)
    convo = list(system)
    for i in range(12):
        role = "user" if i % 2 == 0 else "assistant"
        convo.append({"role": role, "content": factory.user_message(base // 2 + i)})
    measure("follow-up turn: 12 earlier turns + new user", convo, 10 * n * rounds)
    ids = tok.encode(factory.user_message(7), False)[:32]
    us = best_us(lambda: tok.decode(ids), calls_for(3.0))
    print(f"Tokenizer.decode of 32 ids (a non-stream answer): {us:.2f}")
    print(f"stats: {svc.stats()}")


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


def sched_ns(pid: int) -> int:
    """CPU time of ``pid`` so far, in ns (``/proc/<pid>/schedstat``: finer than the 10 ms ticks of
    ``/proc/<pid>/stat``)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


async def _interleaved(
    tok: Tokenizer, pool: TokenizerPool, pid: int, text: str, k: int, rounds: int
) -> tuple[list[float], list[float], list[float]]:
    """``rounds`` of (``k`` inline encodes of ``text``, ``k`` pool encodes), alternating: µs per call of
    each round, inline, the pool's parent and its worker (``sched_ns``)."""
    encode = tok.cache.encode_pieces
    inline_r, parent_r, worker_r = [], [], []
    for _ in range(rounds):
        t0 = time.thread_time_ns()
        for _ in range(k):
            encode([text], False)
        inline_r.append((time.thread_time_ns() - t0) / k / 1000)
        w0, p0 = sched_ns(pid), time.thread_time_ns()
        for _ in range(k):
            await pool.encode("qwen3", text, False)
        parent_r.append((time.thread_time_ns() - p0) / k / 1000)
        worker_r.append((sched_ns(pid) - w0) / k / 1000)
    return inline_r, parent_r, worker_r


async def encode_threshold(tok: Tokenizer, text_at: dict[int, str]) -> None:
    """The encode break-even, measured interleaved: for each size, rounds of (inline batch, pool
    batch) alternate, and each figure is the minimum over the rounds (the lower envelope: noise from
    neighbours on a shared machine only ever adds). Inline and worker run the same code
    (``TokenCache.encode_pieces``)."""
    section("encode threshold, interleaved rounds, lower envelope (min over rounds), CPU µs per call")
    rounds = 5 if QUICK else 15
    pool = TokenizerPool([tok], workers=1)
    await pool.start()
    encode = tok.cache.encode_pieces
    print(
        f"{'chars':>7} {'inline':>8} {'parent':>8} {'worker':>8} {'loop saved':>11} {'CPU added':>10}  "
        f"verdict   (medians: inline / parent / worker)"
    )
    first_pool: int | None = None
    try:
        (pid,) = pool.pids()
        for n in sorted(text_at):
            text = text_at[n]
            per = encode([text], False)  # warm
            k = max(20, min(2000, int(60_000 / max(1.0, n * 0.15))))  # ~60 ms of encoding per batch
            inline_r, parent_r, worker_r = await _interleaved(tok, pool, pid, text, k, rounds)
            inline, parent, worker = min(inline_r), min(parent_r), min(worker_r)
            saved, added = inline - parent, parent + worker - inline
            pays = saved >= added
            if pays and first_pool is None:
                first_pool = n
            elif not pays:
                first_pool = None
            meds = f"{statistics.median(inline_r):.1f} / {statistics.median(parent_r):.1f} / "
            meds += f"{statistics.median(worker_r):.1f}"
            print(
                f"{n:>7} {inline:>8.1f} {parent:>8.1f} {worker:>8.1f} {saved:>11.1f} {added:>10.1f}  "
                f"{'pool' if pays else 'inline':<8}  ({meds})"
            )
            del per
    finally:
        await pool.close()
    print(f"=> encode: the pool pays from about {first_pool} chars on (lower envelope)")


def kinds_of_text() -> dict[str, str]:
    """Texts of each kind the encode bounds tell apart: ASCII (the C split) typical and worst, and not."""
    rng = random.Random(1)
    factory = PromptFactory(PromptConfig(prompt_tokens=2000))
    prose = "".join(factory.user_message(i) for i in range(12))
    code = "".join(c for c in corpus()[20_000:] if c.isascii())
    return {
        "ASCII prose": prose,
        "ASCII code": code,
        "ASCII, words of rare letters": " ".join(
            "".join(rng.choice("qxzjkvwy") for _ in range(rng.randint(8, 40))) for _ in range(3000)
        ),
        "ASCII, letters without a space": "".join(
            rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(40_000)
        ),
        "French": "Les caches évitent de refaire le travail; la passerelle découpe le texte. " * 600,
        "Japanese": "日本語のテキストも少し含まれています。トークナイザーの速度を測ります。" * 1200,
    }


async def encode_by_kind(tok: Tokenizer) -> None:
    """The encode bounds (``TokenizerService``: ``inline_max_ascii_chars`` for ASCII text, else
    ``inline_max_chars``): at each bound, by kind of text, the inline encode (the event loop's stall)
    against a pool round trip's parent + worker CPU for the same text (lower envelope of interleaved
    rounds, as ``encode_threshold``)."""
    section("encode cost by kind of text (qwen3), CPU µs per call, at the service's bounds")
    print(
        f"{'text':<32} {'chars':>6} {'inline':>8} {'ns/char':>8} {'parent':>8} {'worker':>8} "
        f"{'pool total':>10}  cheaper"
    )
    rounds = 3 if QUICK else 7
    pool = TokenizerPool([tok], workers=1)
    await pool.start()
    encode = tok.cache.encode_pieces
    try:
        (pid,) = pool.pids()
        for name, full in kinds_of_text().items():
            sizes = [DEFAULT_INLINE_MAX_ASCII_CHARS] if full.isascii() else []
            sizes.append(DEFAULT_INLINE_MAX_CHARS)
            for n in sorted(sizes):
                text = full[:n]
                encode([text], False)
                k = max(3, min(200, int(30_000 / n * 4)))
                inline_r, parent_r, worker_r = await _interleaved(tok, pool, pid, text, k, rounds)
                inline, parent, worker = min(inline_r), min(parent_r), min(worker_r)
                cheaper = "inline" if inline < parent + worker else "pool"
                print(
                    f"{name:<32} {len(text):>6} {inline:>8.1f} {1000 * inline / len(text):>8.1f} "
                    f"{parent:>8.1f} {worker:>8.1f} {parent + worker:>10.1f}  {cheaper}"
                )
    finally:
        await pool.close()


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


# ---- --fast-bpe-verify: the slow checks ------------------------------------------------------------

GPT2_CONTEXTS = "a{c}1{c} {c}{c}\n{c}x {c}  {c}'s{c}'{c} '{c}{c}|'{c}e {c}\r\n{c}a\u0316{c}\u0301"


def verify_code_points(tok: Tokenizer) -> None:
    """Every code point (but surrogates) in a dozen contexts: FastBPE == tokenizers; bisects to the
    code points that differ."""
    fast, hf = tok.cache.fast, tok.hf
    assert fast is not None
    bad: list[int] = []

    def check(cps: list[int]) -> None:
        text = "".join(GPT2_CONTEXTS.replace("{c}", chr(c)) for c in cps)
        if fast.encode(text, False) == hf.encode(text, add_special_tokens=False).ids:
            return
        if len(cps) == 1:
            bad.append(cps[0])
            return
        half = len(cps) // 2
        check(cps[:half])
        check(cps[half:])

    t0 = time.perf_counter()
    cps = [c for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    for i in range(0, len(cps), 2048):
        check(cps[i : i + 2048])
    print(
        f"  code points: {len(cps)} checked, {len(bad)} differ {[hex(c) for c in bad[:20]]} "
        f"({time.perf_counter() - t0:.0f} s)"
    )


def verify_merge_ties(tok: Tokenizer) -> None:
    """For tokens with several splits among the merges: words where two splits of one token could be
    candidates at once (the token twice, overlapping at a border, around another token), BPE'd with
    HF's merge order while checking at each step that tiktoken's rule (lowest result id, leftmost)
    would pick the same pair. (The candidate sets are the same: the build checked that the merges are
    all the splits.) No differing step on a word means both give the same ids for it."""
    import json as _json
    import random as _random

    d = _json.loads(tok.hf.to_str())
    dec = byte_level_decoder()
    model = d["model"]
    ranks: dict[bytes, int] = {}
    for t, i in model["vocab"].items():
        if all(ch in dec for ch in t):
            ranks[bytes(dec[ch] for ch in t)] = i
    mrank: dict[tuple[bytes, bytes], int] = {}
    raw_merges = model["merges"]
    for k, m in enumerate(raw_merges):
        a, b = m.split(" ") if isinstance(m, str) else m
        mrank[(bytes(dec[ch] for ch in a), bytes(dec[ch] for ch in b))] = k
    splits: dict[bytes, int] = {}
    for a, b in mrank:
        splits[a + b] = splits.get(a + b, 0) + 1
    multi = [t for t, n in splits.items() if n > 1]
    if not multi:
        verify_non_merge_splits(tok, ranks, mrank)
        return
    lookup = bool(model.get("ignore_merges"))

    def hf_bpe(word: bytes, events: list[bytes]) -> list[bytes]:
        if lookup and word in ranks:
            return [word]
        toks = [word[i : i + 1] for i in range(len(word))]
        while True:
            cands = [
                (mrank[(toks[j], toks[j + 1])], j)
                for j in range(len(toks) - 1)
                if (toks[j], toks[j + 1]) in mrank
            ]
            if not cands:
                return toks
            _, i = min(cands)
            _, leftmost = min((ranks[toks[j] + toks[j + 1]], j) for _, j in cands)
            if leftmost != i:
                events.append(word)
            toks[i : i + 2] = [toks[i] + toks[i + 1]]

    rng = _random.Random(0)
    vocab_tokens = list(ranks)
    words: list[bytes] = []
    for t in multi:
        words += [t + t, t + rng.choice(vocab_tokens) + t]
        words += [t + t[k:] for k in range(1, len(t)) if t[:k] == t[len(t) - k :]]
    if QUICK:
        words = words[:20000]
    events: list[bytes] = []
    t0 = time.perf_counter()
    for w in words:
        hf_bpe(w, events)
    print(
        f"  merge ties: {len(multi)} tokens with several splits, {len(words)} adversarial words, "
        f"{len(events)} states where HF's merge order and tiktoken's rule pick different pairs "
        f"({time.perf_counter() - t0:.0f} s)"
    )


def verify_non_merge_splits(
    tok: Tokenizer, ranks: dict[bytes, int], mrank: dict[tuple[bytes, bytes], int]
) -> None:
    """One merge per token: tiktoken also merges splits that are not merges. For each such split
    (l, r) of a token t, words where l and r could meet (t twice, t between random tokens, l and r
    apart): HF's model against tiktoken's BPE of the same word (no regex split), ids compared."""
    import random as _random

    import tiktoken

    enc = {b: ch for ch, b in byte_level_decoder().items()}
    added = {t.content.encode() for t in tok.hf.get_added_tokens_decoder().values()}
    core = tiktoken.Encoding(
        "verify",
        pat_str=r"(?s:.+)",
        mergeable_ranks={t: i for t, i in ranks.items() if t not in added},
        special_tokens={},
    )
    model = tok.hf.model
    missing = [
        (t[:i], t[i:], t)
        for t in ranks
        for i in range(1, len(t))
        if t[:i] in ranks and t[i:] in ranks and (t[:i], t[i:]) not in mrank
    ]
    rng = _random.Random(2)
    pool = [t for t in ranks if t not in added]
    if QUICK:
        missing = missing[:5000]
    t0 = time.perf_counter()
    words = 0
    differ = 0
    for left, right, t in missing:
        for w in (
            left + right + left + right,
            rng.choice(pool) + t,
            t + rng.choice(pool),
            rng.choice(pool) + t + rng.choice(pool),
            left[-1:] + t,
            t + right[:1],
            rng.choice(pool) + left + rng.choice(pool) + right,
        ):
            words += 1
            hf_ids = [x.id for x in model.tokenize("".join(enc[b] for b in w))]
            if hf_ids != core._encode_single_piece(w):
                differ += 1
    print(
        f"  non-merge splits: {len(missing)} splits that are not merges, {words} adversarial words, "
        f"{differ} with different ids ({time.perf_counter() - t0:.0f} s)"
    )


def fast_bpe_verify(families: list[str]) -> None:
    for family in families:
        section(f"FastBPE verification: {family}")
        tok = load_family(family)
        if tok is None or tok.cache.fast is None:
            print(f"  no FastBPE: {tok.cache.fast_reason if tok else 'not found'}")
            continue
        verify_code_points(tok)
        verify_merge_ties(tok)


async def main() -> None:
    if "--fast-bpe-verify" in sys.argv:
        families = [a for a in sys.argv[1:] if not a.startswith("--")] or ["qwen3", "llama-3.1", "gpt2"]
        fast_bpe_verify(families)
        return
    if "--node" in sys.argv:
        node_call()
        return
    if "--kinds" in sys.argv:  # only the encode cost by kind of text, at the service's bounds
        await encode_by_kind(Tokenizer.load(QWEN3, "qwen3"))
        return
    if "--no-pin" not in sys.argv:
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        print(f"pinned to CPU {cpu} (workers inherit it)")
    text = corpus()
    tok = Tokenizer.load(QWEN3, "qwen3")
    text_at = {n: text[1000 : 1000 + n] for n in SIZES}
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    section("FastBPE vs tokenizers (qwen3), realistic texts, CPU µs per encode")
    fast_vs_hf(tok, "qwen3")
    if "--fast-bpe" in sys.argv:
        for family in ("llama-3.1", "gpt2"):
            section(f"FastBPE vs tokenizers ({family}), CPU µs per encode")
            other = load_family(family)
            if other is not None:
                fast_vs_hf(other, family)
        fast_bpe_families()
    inline = inline_encode(tok, text_at)
    overhead = await pool_round_trips(tok, text_at, inline)
    if "--fast-bpe" in sys.argv:
        await encode_threshold(tok, text_at)
        return
    cache_hits(tok, text_at)
    node_call()
    renders()
    render_inline, render_costs = await pool_renders(tok)
    await service_path(text_at)
    section("inline thresholds")
    break_even("encode", "chars", inline, {n: c for n, c in overhead.items() if n})
    break_even("render", "messages", render_inline, render_costs)
    await encode_threshold(tok, text_at)
    await encode_by_kind(tok)
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
