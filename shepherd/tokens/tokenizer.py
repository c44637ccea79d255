"""One model's tokenizer: HF ``tokenizers`` + its config, special tokens, chat templates and caches.

``Tokenizer.load(dir)`` reads ``tokenizer.json`` (or ``tokenizer.json.xz``), ``tokenizer_config.json``,
an optional ``generation_config.json`` (its ``eos_token_id`` list) and chat templates: the config's
``chat_template`` (a string, or a list of ``{"name", "template"}``), ``chat_template.jinja`` beside it
(takes precedence as the default, as in transformers) and any other ``*.jinja`` there, named by its stem
without a ``chat_template.`` prefix (``chat_template.v3_1.jinja`` → ``"v3_1"``).

``encode`` goes through the L0/L1 caches (see cache.py), what they miss through ``FastBPE``
(see fast_bpe.py) when the tokenizer's structure allows it, and always equals ``encode_uncached``
(plain HF); ``render_chat`` goes through the rendered-prompt cache (see chat_template.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import lzma
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
import tokenizers

from shepherd.tokens.cache import CacheLimits, TokenCache
from shepherd.tokens.chat_messages import ChatTemplateError
from shepherd.tokens.chat_template import ChatTemplate
from shepherd.tokens.fast_bpe import fast_bpe_for
from shepherd.tokens.fast_decode import ByteDecoder

__all__ = [
    "VERY_LARGE_INTEGER",
    "Tokenizer",
    "load_chat_templates",
    "special_tokens_map",
]

# transformers' VERY_LARGE_INTEGER: model_max_length when the config sets none (or sets this sentinel)
VERY_LARGE_INTEGER = int(1e30)

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_str(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def special_tokens_map(config: Mapping[str, Any]) -> dict[str, Any]:
    """transformers' ``special_tokens_map`` from a tokenizer_config: strings only, unset ones absent."""
    out: dict[str, Any] = {}
    for key in _SPECIAL_KEYS:
        s = _token_str(config.get(key))
        if s is not None:
            out[key] = s
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list) and extra:
        out["additional_special_tokens"] = [s for s in map(_token_str, extra) if s is not None]
    return out


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def load_chat_templates(
    path: str | Path,
    chat_template: str | Path | None = None,
    *,
    config: Mapping[str, Any] | None = None,
) -> dict[str, ChatTemplate]:
    """The chat templates of a model directory (works without a tokenizer.json), by name.

    ``chat_template`` overrides the default: a path to a ``.jinja`` file, the name of one of the
    directory's templates, or template source text.
    """
    directory = Path(path)
    cfg = dict(config) if config is not None else _read_json(directory / "tokenizer_config.json")
    specials = special_tokens_map(cfg)
    sources: dict[str, str] = {}
    raw = cfg.get("chat_template")
    if isinstance(raw, str):
        sources["default"] = raw
    elif isinstance(raw, list):
        for item in raw:
            if isinstance(item, Mapping) and isinstance(item.get("template"), str):
                sources[str(item.get("name", "default"))] = item["template"]
    if directory.is_dir():
        for f in sorted(directory.glob("*.jinja")):
            stem = f.stem
            if stem == "chat_template":
                name = "default"
            elif stem.startswith("chat_template."):
                name = stem[len("chat_template.") :]
            else:
                name = stem
            sources[name] = f.read_text(encoding="utf-8")
    if chat_template is not None:
        sources["default"] = _resolve_override(chat_template, sources)
    return {name: ChatTemplate(src, name=name, special_tokens=specials) for name, src in sources.items()}


def _resolve_override(chat_template: str | Path, sources: Mapping[str, str]) -> str:
    if isinstance(chat_template, Path):
        return chat_template.read_text(encoding="utf-8")
    if chat_template in sources:
        return sources[chat_template]
    if "{{" in chat_template or "{%" in chat_template:
        return chat_template
    p = Path(chat_template)
    if p.is_file():
        return p.read_text(encoding="utf-8")
    raise FileNotFoundError(f"chat template {chat_template!r}: not a template name, file or template text")


class Tokenizer:
    """A loaded tokenizer with its caches. Construct with ``Tokenizer.load``."""

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        *,
        name: str,
        path: Path,
        config: Mapping[str, Any] | None = None,
        generation_config: Mapping[str, Any] | None = None,
        templates: Mapping[str, ChatTemplate] | None = None,
        cache_limits: CacheLimits | None = None,
        tokenizer_json: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None,
        tokenizer_json_key: bytes | None = None,
        fast_bpe: bool = True,
    ) -> None:
        """``tokenizer_json``: the parsed tokenizer.json of ``hf`` if at hand, or a function giving it
        (else ``hf.to_str()`` is parsed when ``fast_bpe`` needs it), ``tokenizer_json_key`` a digest
        of it (tokenizers loaded from the same file share the fast encoder's and decoder's tables, in
        this process and on disk: ``table_cache``); ``fast_bpe=False`` keeps plain HF encoding."""
        cfg = dict(config or {})
        self.name = name
        self.path = path
        self.hf = hf
        self._content_key = tokenizer_json_key
        self._fast_decoder: ByteDecoder | None = None
        # a gateway wants every id of the prompt: the context check is the node's job
        hf.no_truncation()
        hf.no_padding()
        self.config = cfg
        self.special_tokens: dict[str, Any] = special_tokens_map(cfg)
        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self.eos_token: str | None = self.special_tokens.get("eos_token")
        self.templates: dict[str, ChatTemplate] = dict(templates or {})
        added = hf.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        mml = cfg.get("model_max_length")
        # transformers' convention: VERY_LARGE_INTEGER (1e30) means "no limit known"
        self.model_max_length: int = (
            int(mml) if isinstance(mml, int | float) and 0 < mml < VERY_LARGE_INTEGER else VERY_LARGE_INTEGER
        )
        eos: list[int] = []
        if self.eos_token is not None:
            eid = hf.token_to_id(self.eos_token)
            if eid is not None:
                eos.append(eid)
        gen_eos = (generation_config or {}).get("eos_token_id")
        for i in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
            if isinstance(i, int) and not isinstance(i, bool) and i not in eos:
                eos.append(i)
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self.bos_token_id: int | None = hf.token_to_id(self.bos_token) if self.bos_token else None
        if fast_bpe:
            fast_bpe_for(hf, tokenizer_json, content_key=tokenizer_json_key)  # once per ``hf``
        self.cache = TokenCache(hf, cache_limits, fast_bpe=fast_bpe)

    @classmethod
    def load(
        cls,
        path: str | Path,
        name: str | None = None,
        *,
        chat_template: str | Path | None = None,
        cache_limits: CacheLimits | None = None,
        fast_bpe: bool = True,
    ) -> Tokenizer:
        directory = Path(path)
        plain, packed = directory / "tokenizer.json", directory / "tokenizer.json.xz"
        if plain.is_file():
            data = plain.read_bytes()
        elif packed.is_file():
            with lzma.open(packed) as f:
                data = f.read()
        else:
            raise FileNotFoundError(f"{directory}: no tokenizer.json or tokenizer.json.xz")
        hf = tokenizers.Tokenizer.from_buffer(data)
        config = _read_json(directory / "tokenizer_config.json")
        return cls(
            hf,
            name=name or directory.name,
            path=directory,
            config=config,
            generation_config=_read_json(directory / "generation_config.json"),
            templates=load_chat_templates(directory, chat_template, config=config),
            cache_limits=cache_limits,
            tokenizer_json=functools.partial(orjson.loads, data) if fast_bpe else None,
            tokenizer_json_key=hashlib.blake2b(data, digest_size=16).digest(),
            fast_bpe=fast_bpe,
        )

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size}, path={str(self.path)!r})"

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (its vocabulary's longest entry, added tokens too: a
        byte-level entry has a character per byte, at least as many as it decodes to). With the byte
        decoder built: its longest entry's bytes, which are as many or more (a byte-level entry's one a
        character, another's its UTF-8), without asking HF for its whole vocabulary (~0.1 s)."""
        fast = self._fast_decoder
        if fast is not None:
            return fast.longest or 1
        return max((len(t) for t in self.hf.get_vocab(with_added_tokens=True)), default=1) or 1

    # ---- ids -------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of ``text`` through the L0/L1 caches (equal to ``encode_uncached``, always)."""
        return self.cache.encode(text, add_special_tokens)

    def encode_uncached(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self.hf.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """HF's decode, through the byte table of ``fast_decode`` when it is built and agrees."""
        fast = self._fast_decoder
        if fast is not None:
            try:
                return fast.decode(ids, skip_special_tokens)
            except IndexError:
                pass  # an id outside the vocabulary: HF drops it
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def build_fast_decoder(self) -> bool:
        """Build the byte-table decoder (~0.3-0.9 s for a 150k vocabulary; the node does it at start,
        before its pool forks: the workers never decode, but share the table rather than copy pages),
        over the fast encoder's bytes objects when there is one. True when this tokenizer has one."""
        if self._fast_decoder is None:
            fast = self.cache.fast
            self._fast_decoder = ByteDecoder.build(
                self.hf, token_bytes=fast.token_ranks if fast else None, content_key=self._content_key
            )
        return self._fast_decoder is not None

    def id_to_token(self, i: int) -> str | None:
        return self.hf.id_to_token(i)

    def token_to_id(self, s: str) -> int | None:
        return self.hf.token_to_id(s)

    # ---- chat ------------------------------------------------------------------------------------

    def chat_template(self, *, tools: bool = False, name: str | None = None) -> ChatTemplate:
        """The template a render uses: ``name`` if given, ``tool_use`` when tools are given (not None)
        and the model has one, else ``default`` (or the first one; transformers would refuse)."""
        if not self.templates:
            raise ChatTemplateError(f"model {self.name!r} has no chat template")
        if name is not None:
            try:
                return self.templates[name]
            except KeyError:
                raise ChatTemplateError(
                    f"model {self.name!r} has no chat template named {name!r} "
                    f"(it has: {', '.join(sorted(self.templates))})"
                ) from None
        if tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        return next(iter(self.templates.values()))

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool | str = False,
        template_kwargs: Mapping[str, Any] | None = None,
        template_name: str | None = None,
    ) -> str:
        """The prompt text, rendered as transformers' ``apply_chat_template(tokenize=False)`` would."""
        return self.chat_template(tools=tools is not None, name=template_name).render(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            template_kwargs=template_kwargs,
        )
