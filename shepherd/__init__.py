"""Shepherd: an LLM inference gateway built as a mesh of symmetric nodes (README.md, "Layout").

The parts, bottom up (tests/layout.toml says which may import which): ``proto`` (vocabulary and
codecs), ``tokens`` (text <-> ids), ``parsers`` (reasoning and tool-call parsers), ``policies``
(routing and the prefix index), ``auth``, ``mesh`` (membership and replicated state), ``storage``,
``node`` (the gateway node), ``mock_engine`` and ``loadgen`` (the engine stand-in and the benchmarks).
"""
