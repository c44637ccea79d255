"""The tokenizer pool (forked workers on pipes) and the service façade the node uses."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator, Awaitable
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import pytest

from shepherd.tokens.chat_messages import ChatTemplateError
from shepherd.tokens.chat_template import ChatTemplate
from shepherd.tokens.pool import TokenizerPool, TokenizerPoolUnavailable, TokenizerWorkerError
from shepherd.tokens.service import DEFAULT_INLINE_MAX_ASCII_CHARS, TokenizerService
from shepherd.tokens.tokenizer import Tokenizer, load_chat_templates
from tests.unit.test_tokenizer_shared import llama, qwen3

ROOT = Path(__file__).resolve().parents[2]
QWEN3 = ROOT / "shepherd" / "tokens" / "assets" / "qwen3"
LLAMA = ROOT / "tests" / "assets" / "tokenizers" / "llama-3.1"
MISTRAL = ROOT / "tests" / "assets" / "tokenizers" / "mistral-nemo"
T = TypeVar("T")
HANG_GUARD = 60.0  # a bound on every await below, so a bug fails the test instead of hanging it


# the text of the pool (as it was in one file: ~34 KB, so that SAMPLE * 3 outgrows a pipe buffer)
SAMPLE = "".join(
    (ROOT / "shepherd" / "tokens" / name).read_text(encoding="utf-8")
    for name in ("pool.py", "pool_worker.py", "service.py")
)


def gone(pid: int) -> bool:
    """Reaped (not our child any more, no zombie left)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return not Path(f"/proc/{pid}").exists() or _not_zombie_of_ours(pid)
    return False


def _not_zombie_of_ours(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return int(stat.rsplit(")", 1)[1].split()[1]) != os.getpid()  # ppid: a recycled pid is someone else's


def kill_leftovers(pids: list[int]) -> None:
    """Belt and braces: nothing of ours survives a failed test (only unreaped children of this
    process are killed: a reaped pid may belong to someone else by now)."""
    for pid in pids:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        if done == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


@contextlib.asynccontextmanager
async def running(pool: TokenizerPool) -> AsyncIterator[TokenizerPool]:
    await pool.start()
    pids = pool.pids()
    try:
        yield pool
    finally:
        await pool.close()
        kill_leftovers(pids + pool.pids())


async def guarded(aw: Awaitable[T]) -> T:
    return await asyncio.wait_for(aw, HANG_GUARD)


async def test_pool_results_equal_inline() -> None:
    async with running(TokenizerPool([qwen3(), llama()], workers=2)) as pool:
        for model, tok in (("qwen3", qwen3()), ("llama", llama())):
            for add in (False, True):
                text = SAMPLE[:3000] + "<|im_start|><|eot_id|>"
                got = await guarded(pool.encode(model, text, add))
                assert got == tok.encode_uncached(text, add)
            pieces = ["<|im_start|>a", "", "b<|im_end|>", "日本語 🦙"]
            assert await guarded(pool.encode_pieces(model, pieces, False)) == [
                tok.encode_uncached(p, False) for p in pieces
            ]
        with pytest.raises(KeyError):
            await pool.encode("nope", "x")


async def test_many_calls_in_flight_including_big_ones() -> None:
    tok = qwen3()
    texts = [SAMPLE[i : i + 200 + 13 * i] for i in range(0, 6000, 100)]
    texts.append(SAMPLE * 3)  # ~80 KB, ~20k ids: bigger than a pipe buffer both ways
    async with running(TokenizerPool([tok], workers=2)) as pool:
        results = await guarded(asyncio.gather(*(pool.encode("qwen3", t, False) for t in texts)))
        assert results == [tok.encode_uncached(t, False) for t in texts]
        assert pool.calls == len(texts) and pool.failures == 0


async def test_a_killed_worker_fails_its_calls_and_the_pool_recovers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The only worker killed with calls in flight: each is asked again once, finds no worker yet (the
    respawn is the next loop turn's) and says so (the service then encodes inline)."""
    import shepherd.tokens.pool as pool_mod

    monkeypatch.setattr(pool_mod, "HEAVY_BYTES", 1 << 30)  # all three in flight at once, none held back
    tok = qwen3()
    async with running(TokenizerPool([tok], workers=1)) as pool:
        (pid,) = pool.pids()
        big = SAMPLE * 20  # long enough to still be running when the kill lands
        calls = [asyncio.ensure_future(pool.encode("qwen3", big, False)) for _ in range(3)]
        await asyncio.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        outcomes = await guarded(asyncio.gather(*calls, return_exceptions=True))
        want = tok.encode_uncached(big, False)
        assert all(isinstance(o, TokenizerPoolUnavailable) or o == want for o in outcomes), outcomes
        assert pool.retries == 3 and pool.failures == 3
        assert gone(pid)
        for _ in range(200):  # respawned at once; bounded wait
            if pool.pids():
                break
            await asyncio.sleep(0.01)
        assert pool.pids() and pool.pids() != [pid] and pool.restarts == 1
        assert await guarded(pool.encode("qwen3", "after", False)) == tok.encode_uncached("after", False)


async def test_a_worker_that_exits_mid_call() -> None:
    async with running(TokenizerPool([qwen3()], workers=2)) as pool:
        with pytest.raises(TokenizerWorkerError, match="exit status 3"):
            await guarded(pool.crash_worker_for_test())
        assert await guarded(pool.encode("qwen3", "still fine", False)) == qwen3().encode_uncached(
            "still fine", False
        )


async def test_a_killed_workers_calls_are_asked_again_of_another() -> None:
    """Tokenizing is a pure function: a call whose worker died under it (not because of it) is asked again
    once, of the pool as it is then: the client never sees the kill."""
    tok = qwen3()
    big = SAMPLE * 20
    async with running(TokenizerPool([tok], workers=2)) as pool:
        victim = pool.pids()[0]
        calls = [asyncio.ensure_future(pool.encode("qwen3", big, False)) for _ in range(4)]
        await asyncio.sleep(0.05)
        os.kill(victim, signal.SIGKILL)
        outcomes = await guarded(asyncio.gather(*calls, return_exceptions=True))
        assert outcomes == [tok.encode_uncached(big, False)] * 4, [type(o) for o in outcomes]
        assert pool.retries >= 1 and pool.failures >= 1 and gone(victim)


async def test_a_wedged_worker_is_seen_though_its_callers_gave_up() -> None:
    """A stopped worker whose callers all give up before the call timeout (clients with short deadlines):
    its calls stay on its books, so new calls go to the other worker and the watchdog kills it."""
    tok = qwen3()
    async with running(TokenizerPool([tok], workers=2, call_timeout=1.0)) as pool:
        stuck = pool.pids()[0]
        os.kill(stuck, signal.SIGSTOP)
        for _ in range(6):  # each gives up after 0.1 s: on the stuck worker or the other
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pool.encode("qwen3", SAMPLE[:2000], False), 0.1)
        # the stuck one holds more calls than the other: a new call is the other's, answered
        assert await guarded(pool.encode("qwen3", "next", False)) == tok.encode_uncached("next", False)
        for _ in range(100):  # bounded: the watchdog looks every call_timeout / 4
            if gone(stuck):
                break
            await asyncio.sleep(0.05)
        assert gone(stuck) and pool.restarts >= 1


async def test_a_worker_reading_nothing_is_not_buffered_for_without_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Requests a stopped worker does not read are bounded (WBUF_MAX): past it the worker takes no more
    calls, the others (or the service's inline path) do."""
    import shepherd.tokens.pool as pool_mod

    monkeypatch.setattr(pool_mod, "WBUF_MAX", 256 << 10)
    tok = qwen3()
    big = SAMPLE * 4  # ~140 KB a call
    async with running(TokenizerPool([tok], workers=2)) as pool:
        stuck = pool.pids()[0]
        os.kill(stuck, signal.SIGSTOP)
        held = next(w for w in pool._workers if w is not None and w.pid == stuck)
        waiting = [asyncio.ensure_future(pool.encode("qwen3", big, False)) for _ in range(12)]
        await asyncio.sleep(0.2)
        assert len(held.wbuf) <= (256 << 10) + len(big.encode()) + 64  # at most one call past the bound
        for _ in range(3):  # later calls: the other worker's
            assert await guarded(pool.encode("qwen3", "x", False)) == tok.encode_uncached("x", False)
        for t in waiting:
            t.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)


async def test_heavy_calls_leave_a_worker_to_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """Big prompts (long runs of letters: seconds of BPE a megabyte) take at most N - 1 workers: a second
    one waits in the parent (never sent if its caller gives up), and the small calls of everyone else go
    to the worker without one, also when several are in flight at once. A heavy call's slot comes back
    when its worker is done with it, not when its caller gives up (the worker grinds on)."""
    import shepherd.tokens.pool as pool_mod

    monkeypatch.setattr(pool_mod, "HEAVY_BYTES", 4096)
    tok = qwen3()
    heavy = "abcdefghij" * 1000  # 10 KB: heavy here
    async with running(TokenizerPool([tok], workers=2)) as pool:
        pids = pool.pids()
        for pid in pids:  # stopped before the heavy call reaches one: it cannot be done before it is held
            os.kill(pid, signal.SIGSTOP)
        first = asyncio.ensure_future(pool.encode("qwen3", heavy, False))
        await asyncio.sleep(0)
        (busy,) = [w for w in pool._workers if w is not None and w.heavy]
        for pid in pids:  # the heavy call's worker stays stopped, for as long as the test needs
            if pid != busy.pid:
                os.kill(pid, signal.SIGCONT)
        try:
            calls = pool.calls
            second = asyncio.ensure_future(pool.encode("qwen3", heavy, False))
            await asyncio.sleep(0.05)
            assert pool.calls == calls  # waiting for the heavy lane, not sent
            small = ["small " * n for n in range(1, 6)]
            got = await guarded(asyncio.gather(*(pool.encode("qwen3", t, False) for t in small)))
            assert got == [tok.encode_uncached(t, False) for t in small]
            second.cancel()
            await asyncio.gather(second, return_exceptions=True)
            assert pool.calls == calls + len(small)  # the one given up was never sent
            first.cancel()  # its caller gone: its worker is still at it, the lane still taken
            await asyncio.gather(first, return_exceptions=True)
            third = asyncio.ensure_future(pool.encode("qwen3", heavy, False))
            await asyncio.sleep(0.05)
            assert pool.calls == calls + len(small) and not third.done()
        finally:
            os.kill(busy.pid, signal.SIGCONT)
        assert await guarded(third) == tok.encode_uncached(heavy, False)  # sent once the first was done
        assert await guarded(pool.encode("qwen3", heavy, False)) == tok.encode_uncached(heavy, False)
        assert all(w.heavy == 0 for w in pool._workers if w is not None)


async def test_a_stuck_worker_is_killed_after_the_call_timeout() -> None:
    async with running(TokenizerPool([qwen3()], workers=1, call_timeout=0.3)) as pool:
        (pid,) = pool.pids()
        os.kill(pid, signal.SIGSTOP)  # a worker that never answers
        with pytest.raises(TokenizerWorkerError, match="ran over"):
            await guarded(pool.encode("qwen3", "hello", False))
        assert gone(pid)


async def test_close_leaves_no_child_and_refuses_calls() -> None:
    pool = TokenizerPool([qwen3()], workers=3)
    async with running(pool):
        pids = pool.pids()
        assert len(pids) == 3
        await guarded(pool.encode("qwen3", "x"))
    assert all(gone(pid) for pid in pids)
    assert pool.pids() == []
    with pytest.raises(TokenizerPoolUnavailable):
        await pool.encode("qwen3", "x")


# ---- the service ---------------------------------------------------------------------------------------


@cache
def mistral() -> Tokenizer:
    """Mistral's template and config over llama's vocabulary (the template needs only bos/eos strings)."""
    cfg = json.loads((MISTRAL / "tokenizer_config.json").read_text())
    return Tokenizer(
        llama().hf, name="mistral", path=MISTRAL, config=cfg, templates=load_chat_templates(MISTRAL)
    )


@contextlib.asynccontextmanager
async def service(**kw: Any) -> AsyncIterator[TokenizerService]:
    """A service over the tokenizers loaded once for this module (their caches persist across tests:
    each test uses texts of its own and looks at counter deltas)."""
    svc = TokenizerService({"qwen3": qwen3(), "llama": llama(), "mistral": mistral()}, **kw)
    await svc.start()
    pids = svc.pool.pids() if svc.pool else []
    try:
        yield svc
    finally:
        await svc.close()
        assert all(gone(pid) for pid in pids)


async def test_service_inline_small_pool_big_and_caches_in_the_parent() -> None:
    async with service(workers=1, inline_max_chars=1000) as svc:
        assert sorted(svc.models()) == ["llama", "mistral", "qwen3"]
        tok = svc.get("qwen3")
        small, big = "hello there, service", SAMPLE[100:5100]
        assert await guarded(svc.encode("qwen3", small)) == tok.encode_uncached(small)
        assert svc.stats()["inline_encodes"] == 1 and svc.stats()["pool_calls"] == 0
        assert await guarded(svc.encode("qwen3", big, False)) == tok.encode_uncached(big, False)
        s = svc.stats()
        assert s["pool_encodes"] == 1 and s["pool_calls"] == 1
        assert await guarded(svc.encode("qwen3", big, False)) == tok.encode_uncached(big, False)
        s2 = svc.stats()
        assert s2["pool_calls"] == 1 and s2["l0_hits"] == s["l0_hits"] + 1  # served from the parent's cache
        with pytest.raises(KeyError, match="unknown model"):
            svc.get("nope")


async def test_ascii_text_has_its_own_bigger_inline_bound() -> None:
    """ASCII text (the C split, ~3-30x cheaper to encode) stays here up to ``inline_max_ascii_chars``;
    text of the same size that is not ASCII goes to the pool; an ``inline_max_chars`` given alone
    holds for both."""
    ascii_text = " ".join(f"word{i} is plain ASCII, number {i * 7}." for i in range(200))  # ~6,000 chars
    other = ascii_text.replace("plain", "plein, déjà")
    assert ascii_text.isascii() and not other.isascii() and 3000 < len(ascii_text) < 8000
    async with service(workers=1, inline_max_chars=1000, inline_max_ascii_chars=8000) as svc:
        tok = svc.get("qwen3")
        assert svc.inline_max_ascii_chars == 8000
        assert await guarded(svc.encode("qwen3", ascii_text, False)) == tok.encode_uncached(ascii_text, False)
        assert svc.stats()["pool_calls"] == 0 and svc.stats()["inline_encodes"] == 1
        assert await guarded(svc.encode("qwen3", other, False)) == tok.encode_uncached(other, False)
        assert svc.stats()["pool_calls"] == 1 and svc.stats()["pool_encodes"] == 1
        longer = ascii_text + " " + ascii_text.replace("word", "term")  # over 8,000 ASCII characters
        assert await guarded(svc.encode("qwen3", longer, False)) == tok.encode_uncached(longer, False)
        assert svc.stats()["pool_calls"] == 2
    async with service(workers=1, inline_max_chars=1000) as svc:
        assert svc.inline_max_ascii_chars == 1000
        fresh = ascii_text.replace("word", "item")
        assert await guarded(svc.encode("qwen3", fresh, False)) == tok.encode_uncached(fresh, False)
        assert svc.stats()["pool_calls"] == 1
    async with service(workers=1) as svc:
        assert svc.inline_max_ascii_chars == DEFAULT_INLINE_MAX_ASCII_CHARS > svc.inline_max_chars


async def test_service_only_sends_the_new_segments() -> None:
    async with service(workers=1, inline_max_chars=500) as svc:
        tok = svc.get("qwen3")
        system = "<|im_start|>system\n" + SAMPLE[200:4200] + "<|im_end|>\n"
        first = system + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        assert await guarded(svc.encode("qwen3", first, False)) == tok.encode_uncached(first, False)
        calls = svc.stats()["pool_calls"]
        second = system + "<|im_start|>user\nanother short question<|im_end|>\n<|im_start|>assistant\n"
        assert await guarded(svc.encode("qwen3", second, False)) == tok.encode_uncached(second, False)
        assert svc.stats()["pool_calls"] == calls  # the long system turn was an L1 hit: inline


async def test_render_and_encode_inline_and_in_the_pool_agree() -> None:
    msgs = [
        {"role": "system", "content": "You are terse. " * 20},
        {"role": "user", "content": "Hello! " + SAMPLE[:2000]},
    ]
    async with service(workers=1, render_inline_max_bytes=100, inline_max_chars=100) as svc:
        text, ids = await guarded(
            svc.render_and_encode("qwen3", msgs, None, True, False, {"enable_thinking": False})
        )
        tok = svc.get("qwen3")
        want = tok.chat_template().render_uncached(msgs, template_kwargs={"enable_thinking": False})
        assert text == want and ids == tok.encode_uncached(want, add_special_tokens=False)
        assert svc.stats()["pool_renders"] == 1
        again = await guarded(
            svc.render_and_encode("qwen3", msgs, None, True, False, {"enable_thinking": False})
        )
        # not rendered again: a render-cache hit, or a fill of the skeleton render_uncached just made
        assert again == (text, ids) and svc.stats()["pool_renders"] == 1
        assert svc.stats()["render_hits"] + tok.chat_template().skeletons.hits >= 1  # type: ignore[union-attr]
    async with service(workers=0) as svc:
        assert svc.pool is None
        got = await guarded(
            svc.render_and_encode("qwen3", msgs, None, True, False, {"enable_thinking": False})
        )
        assert got == (text, ids)
        assert svc.stats()["pool_calls"] == 0


async def test_llama_chat_prompt_has_one_bos() -> None:
    async with service(workers=1, render_inline_max_bytes=0, inline_max_chars=0) as svc:
        text, ids = await guarded(
            svc.render_and_encode("llama", [{"role": "user", "content": "hi, one BOS"}])
        )
        assert text.startswith("<|begin_of_text|>")
        assert ids.count(128000) == 1 and ids[0] == 128000


async def test_template_errors_cross_the_pool_as_chat_template_errors() -> None:
    mistral_template = (MISTRAL / "chat_template.jinja").read_text()
    bad = [{"role": "user", "content": "a" * 300}, {"role": "user", "content": "b"}]
    async with service(
        workers=1, render_inline_max_bytes=10, chat_templates={"mistral": mistral_template}
    ) as svc:
        with pytest.raises(ChatTemplateError, match="alternate"):
            await guarded(svc.render_and_encode("mistral", bad))
        assert svc.stats()["pool_renders"] == 0 and svc.stats()["pool_calls"] == 1
    async with service(workers=0, chat_templates={"mistral": mistral_template}) as svc:
        with pytest.raises(ChatTemplateError, match="alternate"):
            await guarded(svc.render_and_encode("mistral", bad))


async def test_stats_keys_the_node_exports() -> None:
    async with service(workers=1) as svc:
        await guarded(svc.encode("qwen3", "x"))
        s = svc.stats()
        for key in (
            "l0_hits",
            "l0_misses",
            "l1_hits",
            "l1_misses",
            "render_hits",
            "render_misses",
            "pool_calls",
        ):
            assert isinstance(s[key], int)
        assert s["pool_workers_alive"] == 1


async def test_a_big_conversation_of_a_known_shape_is_filled_here() -> None:
    """Over the inline thresholds a render goes to the pool, whose worker sends back the skeleton of
    the conversation's shape: the next conversation of that shape is filled here, without the round
    trip (and without a jinja render here)."""
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " * 30} for i in range(5)]
    async with service(workers=1, render_inline_max_messages=2, inline_max_chars=100_000) as svc:
        tok = svc.get("qwen3")
        tpl = tok.chat_template()
        plain = ChatTemplate(tpl.source, special_tokens=tpl.special_tokens, cache_size=0)
        text, ids = await guarded(svc.render_and_encode("qwen3", turns))
        assert svc.stats()["pool_renders"] == 1
        assert text == plain.render_uncached(turns) and ids == tok.encode_uncached(text, False)
        calls = svc.stats()["pool_calls"]
        for word in ("step", "<tool_response>"):  # the second one fails a guard: the pool again
            other = [{**m, "content": m["content"].replace("turn", word)} for m in turns]
            text2, ids2 = await guarded(svc.render_and_encode("qwen3", other))
            want = plain.render_uncached(other)
            assert text2 == want and ids2 == tok.encode_uncached(want, False)
        assert svc.stats()["pool_calls"] == calls + 1 and svc.stats()["pool_renders"] == 2
