"""Text <-> token ids: tokenizers, their caches, chat templates, incremental detokenizing, the pool.

Callers use: ``tokenizer.Tokenizer`` (one model's tokenizer, templates and caches; ``ChatTemplateError``),
``service.TokenizerService`` (inline for short prompts, the worker processes of ``pool`` /
``pool_worker`` for long ones), ``detokenizer`` (incremental decode without U+FFFD mid-character),
``chat_template`` / ``chat_skeleton`` (transformers-exact rendering in ``chat_env``'s sandbox, message
preparation in ``chat_messages``, skeleton fills), ``cache`` (L0/L1 id caches), ``fast_bpe`` /
``fast_bpe_core`` / ``fast_decode`` (exact fast paths for byte-level BPE), ``table_cache`` (what a
tokenizer file determines, kept on disk between process starts). The embedded Qwen3
tokenizer is in ``assets/qwen3``. Imports proto only.
"""

__all__ = [
    "cache",
    "chat_env",
    "chat_messages",
    "chat_skeleton",
    "chat_template",
    "detokenizer",
    "fast_bpe",
    "fast_bpe_core",
    "fast_decode",
    "heap",
    "pool",
    "pool_worker",
    "service",
    "table_cache",
    "tokenizer",
]
