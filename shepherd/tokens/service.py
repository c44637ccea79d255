"""The node's tokenizer façade: ``TokenizerService``.

Caches live in the parent (that is where a hit is cheap): L0/L1 ids and rendered prompts are looked up
inline; what is left to do runs inline when small (``inline_max_chars`` characters still to encode,
``inline_max_ascii_chars`` when the text is ASCII; a render of at most ``render_inline_max_messages``
messages and ``render_inline_max_bytes`` bytes of serialized input) and in the pool (pool.py)
otherwise, and pool results go into the parent's caches. A worker that renders a plain conversation
(role and text messages) sends back the skeleton of its shape (chat_skeleton.py): the parent fills the
next conversation of that shape itself, at any size, with no jinja and no round trip.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from shepherd.tokens import heap
from shepherd.tokens.cache import CacheLimits, EncodePlan, TokenCache
from shepherd.tokens.chat_template import ChatTemplate
from shepherd.tokens.pool import TokenizerPool, TokenizerPoolUnavailable
from shepherd.tokens.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_INLINE_MAX_ASCII_CHARS",
    "DEFAULT_INLINE_MAX_CHARS",
    "DEFAULT_RENDER_INLINE_MAX_BYTES",
    "DEFAULT_RENDER_INLINE_MAX_MESSAGES",
    "TokenizerService",
]

# Measured with bench/tokenizer_bench.py ("inline thresholds", "encode cost by kind of text"): a pool
# round trip never costs less CPU (parent + worker) than the work done here (the hop adds 20-65 µs a
# call, and the worker's encode is no cheaper), so these bound the event loop's stall instead. Text
# that is not ASCII (tiktoken's regex split, 0.045-0.14 µs a character: French, Japanese): 2,048
# characters still to encode, 0.1-0.3 ms. ASCII text (the C split, shepherd/tokens/_pretok.c) is
# 3-30x cheaper: 16,384 characters, 0.07 ms of prose and 0.24 ms of code (4.5-15 ns a character);
# the worst ASCII (a long run without a space: one BPE piece) ~160 ns a character there, ~2.6 ms (and
# at that size the parent's own share of a round trip already costs more than encoding prose here).
# ``str.isascii`` is O(1): the string's kind, not a scan. Renders (qwen3 template): a conversation of
# a new shape costs ~40-50 µs a message here (the skeleton's jinja render), a fill of a known shape
# ~0.6 µs: the 8 messages bound a new shape's render to ~0.4 ms.
DEFAULT_INLINE_MAX_CHARS: Final = 2048
DEFAULT_INLINE_MAX_ASCII_CHARS: Final = 16384
DEFAULT_RENDER_INLINE_MAX_MESSAGES: Final = 8
DEFAULT_RENDER_INLINE_MAX_BYTES: Final = 16384


class TokenizerService:
    """The node's tokenizer façade: caches in this process, big work in the pool.

    ``models`` maps a served model name to its tokenizer directory (or to a loaded ``Tokenizer`` of
    that name, shared as it is); ``chat_templates`` optionally overrides a model's template (a
    ``.jinja`` path, a template name, or template text) for the ones loaded here.
    ``workers=0`` runs everything inline (no processes). An ``inline_max_chars`` given without
    ``inline_max_ascii_chars`` holds for ASCII text too.
    """

    def __init__(
        self,
        models: Mapping[str, str | Path | Tokenizer],
        workers: int = 2,
        inline_max_chars: int | None = None,
        *,
        inline_max_ascii_chars: int | None = None,
        render_inline_max_bytes: int | None = None,
        render_inline_max_messages: int | None = None,
        chat_templates: Mapping[str, str | Path] | None = None,
        cache_limits: CacheLimits | None = None,
        call_timeout: float | None = 120.0,
        freeze_before_fork: bool = False,
    ) -> None:
        self._paths = {name: p if isinstance(p, Tokenizer) else Path(p) for name, p in models.items()}
        self._overrides = dict(chat_templates or {})
        self.workers = workers
        self.inline_max_chars = DEFAULT_INLINE_MAX_CHARS if inline_max_chars is None else inline_max_chars
        if inline_max_ascii_chars is None:
            inline_max_ascii_chars = (
                DEFAULT_INLINE_MAX_ASCII_CHARS if inline_max_chars is None else inline_max_chars
            )
        self.inline_max_ascii_chars = inline_max_ascii_chars
        self.render_inline_max_bytes = (
            DEFAULT_RENDER_INLINE_MAX_BYTES if render_inline_max_bytes is None else render_inline_max_bytes
        )
        self.render_inline_max_messages = (
            DEFAULT_RENDER_INLINE_MAX_MESSAGES
            if render_inline_max_messages is None
            else render_inline_max_messages
        )
        self._cache_limits = cache_limits
        self._call_timeout = call_timeout
        # a process that lives on what it loaded (the node): freeze it before the pool forks (heap.py)
        self._freeze_before_fork = freeze_before_fork
        self._tokenizers: dict[str, Tokenizer] = {}
        self._pool: TokenizerPool | None = None
        self.inline_encodes = 0
        self.pool_encodes = 0
        self.inline_renders = 0
        self.pool_renders = 0
        self.pool_fallbacks = 0

    # ---- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load every tokenizer (here, once), then fork the pool (which inherits them)."""
        for name, path in self._paths.items():
            if name in self._tokenizers:
                continue
            if isinstance(path, Tokenizer):
                if path.name != name:
                    raise ValueError(f"tokenizer named {path.name!r} given for model {name!r}")
                self._tokenizers[name] = path
            else:
                self._tokenizers[name] = Tokenizer.load(
                    path, name, chat_template=self._overrides.get(name), cache_limits=self._cache_limits
                )
        # Before the fork, though the workers never decode: built after it, the build's temporaries
        # (HF's vocabulary as a dict, the self-check) landed in pages shared with the workers and copied
        # them, ~59 MB of the parent's own for a 150k vocabulary; built here they are trimmed below and
        # the table (~2 MB of lists over the fast encoder's bytes) is shared (bench/memory_bench.py).
        for tok in self._tokenizers.values():
            tok.build_fast_decoder()
            _ = tok.max_token_chars  # (here, not on the first request's event-loop turn: ~0.1 s a vocabulary)
        if self._freeze_before_fork:
            heap.freeze_before_fork()
        else:
            heap.trim_heap()  # the parses' free pages (~110 MB for a 150k vocabulary) back to the kernel
        if self.workers > 0 and self._pool is None:
            self._pool = TokenizerPool(
                list(self._tokenizers.values()), self.workers, call_timeout=self._call_timeout
            )
            await self._pool.start()

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    @property
    def pool(self) -> TokenizerPool | None:
        return self._pool

    # ---- lookups -----------------------------------------------------------------------------------

    def get(self, model: str) -> Tokenizer:
        try:
            return self._tokenizers[model]
        except KeyError:
            if model in self._paths:
                raise KeyError(f"tokenizer of {model!r} is not loaded yet (call start())") from None
            raise KeyError(f"unknown model {model!r}") from None

    def models(self) -> list[str]:
        return list(self._paths)

    # ---- work --------------------------------------------------------------------------------------------

    async def encode(self, model: str, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of ``text`` (equal to ``Tokenizer.encode_uncached``): cache hits and small remainders
        inline, big remainders in the pool; results land in this process's caches."""
        got = self._encode_here(model, self.get(model).cache, text, add_special_tokens)
        return got if isinstance(got, list) else await got

    def _encode_here(
        self, model: str, cache: TokenCache, text: str, add_special_tokens: bool
    ) -> list[int] | Awaitable[list[int]]:
        """The ids when the caches and a small inline encode give them (no await in the common case),
        else the pool's, to await."""
        chars = cache.encoded_chars
        if self._pool is None:
            limit = None
        else:  # ASCII text encodes 3-30x cheaper (the C split): a bigger remainder stays here
            limit = self.inline_max_ascii_chars if text.isascii() else self.inline_max_chars
        got = cache.encode_or_plan(text, add_special_tokens, limit)
        if isinstance(got, EncodePlan):
            return self._encode_planned(model, cache, got)
        self.inline_encodes += cache.encoded_chars != chars  # (cache hits alone encode nothing)
        return got

    async def _encode_planned(self, model: str, cache: TokenCache, plan: EncodePlan) -> list[int]:
        """What the caches left over, encoded in the pool (inline when it is unavailable)."""
        pieces = plan.missing_pieces()
        if self._pool is not None:
            try:
                encoded = await self._pool.encode_pieces(model, pieces, plan.piece_add_special)
            except TokenizerPoolUnavailable:
                self.pool_fallbacks += 1
            else:
                self.pool_encodes += 1
                return cache.complete(plan, encoded)
        self.inline_encodes += 1
        return cache.complete(plan, cache.encode_pieces(pieces, plan.piece_add_special))

    async def render(
        self,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool | str = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The rendered prompt (``Tokenizer.render_chat``), big renders in the pool."""
        tpl = self.get(model).chat_template(tools=tools is not None)
        text = self._rendered(
            model, tpl, messages, tools, add_generation_prompt, continue_final_message, template_kwargs
        )
        return text if isinstance(text, str) else await text

    def _rendered(
        self,
        model: str,
        tpl: ChatTemplate,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        continue_final_message: bool | str,
        template_kwargs: Mapping[str, Any] | None,
    ) -> str | Awaitable[str]:
        """The render when it is cheap here (no await in the common case), else the pool's, to await."""
        text, key = self._render_here(
            tpl, messages, tools, add_generation_prompt, continue_final_message, template_kwargs
        )
        if text is not None:
            return text
        assert key is not None
        return self._render_in_pool(
            model, tpl, key, messages, tools, add_generation_prompt, continue_final_message, template_kwargs
        )

    def _render_here(
        self,
        tpl: ChatTemplate,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        continue_final_message: bool | str,
        template_kwargs: Mapping[str, Any] | None,
    ) -> tuple[str | None, bytes | None]:
        """``(the render, its cache key)`` when it is cheap here: a skeleton fill (a conversation shape
        seen before, at any size: no cache key then), a render-cache hit, a small render; else
        ``(None, the serialized inputs)``: the pool should render it.

        A skeleton fill costs about what the render cache's key and lookup cost, so conversations it
        fills skip that cache (an identical request is filled again); the cache serves the others."""
        if not continue_final_message:
            text = tpl.render_from_skeleton(messages, tools, add_generation_prompt, template_kwargs)
            if text is not None:
                self.inline_renders += 1
                return text, None
        key = tpl.serialize(messages, tools, add_generation_prompt, continue_final_message, template_kwargs)
        text = tpl.cached(key)
        if text is not None:
            return text, key
        if self._pool is not None and key is not None and self._render_is_big(messages, key):
            return None, key
        text = self._render_inline(
            tpl, key, messages, tools, add_generation_prompt, continue_final_message, template_kwargs
        )
        return text, key

    def _render_inline(
        self,
        tpl: ChatTemplate,
        key: bytes | None,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        continue_final_message: bool | str,
        template_kwargs: Mapping[str, Any] | None,
    ) -> str:
        """Render on the event loop and cache the result under ``key`` (None: not cacheable)."""
        self.inline_renders += 1
        text, reads = tpl.render_recorded(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            template_kwargs=template_kwargs,
        )
        tpl.store(key, text, reads)
        return text

    async def _render_in_pool(
        self,
        model: str,
        tpl: ChatTemplate,
        key: bytes,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        continue_final_message: bool | str,
        template_kwargs: Mapping[str, Any] | None,
    ) -> str:
        assert self._pool is not None
        try:
            text, reads, skeleton = await self._pool.render_with_skeleton(model, tpl.name, key)
        except TokenizerPoolUnavailable:
            self.pool_fallbacks += 1
            return self._render_inline(
                tpl, key, messages, tools, add_generation_prompt, continue_final_message, template_kwargs
            )
        self.pool_renders += 1
        if skeleton is not None:  # the next conversation of this shape is filled here
            tpl.adopt_skeleton(messages, add_generation_prompt, template_kwargs, skeleton)
        tpl.store(key, text, reads)
        return text

    def _render_is_big(self, messages: object, key: bytes) -> bool:
        count = len(messages) if isinstance(messages, Sequence) else 0
        return count > self.render_inline_max_messages or len(key) > self.render_inline_max_bytes

    async def render_and_encode(
        self,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool | str = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[str, list[int]]:
        """The rendered chat prompt and its ids. The ids are encoded with ``add_special_tokens=False``,
        as transformers' ``apply_chat_template(tokenize=True)`` does: templates write BOS themselves.

        One synchronous pass when everything is cheap here (the common case), the pool otherwise."""
        tok = self._tokenizers.get(model) or self.get(model)
        tpl = tok.chat_template(tools=tools is not None)
        rendered = self._rendered(
            model, tpl, messages, tools, add_generation_prompt, continue_final_message, template_kwargs
        )
        text = rendered if isinstance(rendered, str) else await rendered
        got = self._encode_here(model, tok.cache, text, False)
        return text, got if isinstance(got, list) else await got

    def cache_counters(self) -> tuple[int, int, int, int, int, int]:
        """The cache lookups so far, summed over models: (render hits, render misses, L0 hits, L0 misses,
        L1 hits, L1 misses): what a traced stage reads before and after itself (``tracing.stage``)."""
        toks = self._tokenizers
        if len(toks) == 1:  # one model with one template (the common case): its counters, no sums
            for tok in toks.values():
                tpls = tok.templates
                if len(tpls) == 1:
                    c = tok.cache
                    for t in tpls.values():
                        return (t.hits, t.misses, c.exact_hits, c.exact_misses, c.segment_hits,
                                c.segment_misses)  # fmt: skip
        rh = rm = l0h = l0m = l1h = l1m = 0
        for tok in toks.values():
            c = tok.cache
            l0h += c.exact_hits
            l0m += c.exact_misses
            l1h += c.segment_hits
            l1m += c.segment_misses
            for tpl in tok.templates.values():
                rh += tpl.hits
                rm += tpl.misses
        return rh, rm, l0h, l0m, l1h, l1m

    def stats(self) -> dict[str, int]:
        """Counters summed over models: ``l0_hits``/``l0_misses``/``l1_hits``/``l1_misses``/
        ``render_hits``/``render_misses`` plus sizes and pool figures."""
        out: dict[str, int] = {}
        for tok in self._tokenizers.values():
            for k, v in tok.cache.stats().items():
                out[k] = out.get(k, 0) + v
            for tpl in tok.templates.values():
                out["render_hits"] = out.get("render_hits", 0) + tpl.hits
                out["render_misses"] = out.get("render_misses", 0) + tpl.misses
        out.setdefault("render_hits", 0)
        out.setdefault("render_misses", 0)
        out["inline_encodes"] = self.inline_encodes
        out["pool_encodes"] = self.pool_encodes
        out["inline_renders"] = self.inline_renders
        out["pool_renders"] = self.pool_renders
        out["pool_fallbacks"] = self.pool_fallbacks
        pool = self._pool
        out["pool_calls"] = pool.calls if pool else 0
        out["pool_failures"] = pool.failures if pool else 0
        out["pool_restarts"] = pool.restarts if pool else 0
        out["pool_retries"] = pool.retries if pool else 0
        out["pool_workers_alive"] = pool.alive() if pool else 0
        return out
