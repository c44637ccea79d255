"""A streamed choice's common per-token step in C: a plain engine chunk in, its SSE chunk written out.

A paced engine sends one message per token, and the node's Python per-token path (``take_and_write``:
the choice's ``feed``, the detokenizer's byte-table step, the parser stage's passthrough, the encoder's
content chunk, ``emit_now``'s write) was ~25 Python calls a token. ``PlainStep`` (``_plainstep.c``) does
that case in one C call, on the same state (the detokenizer's ids, held bytes, emitted count and text
parts; the choice's token count and text; the generation loop's counters; the ITL histogram; the
keep-alive entry), and hands anything else to the Python path (``fallback``) before changing anything:
a batch of more than one event, logprobs, an id that is special, a stop id or outside the vocabulary, a
hold past ``_MAX_PENDING`` ids, a reasoning parser still parsing, bytes pending before the chunk. The
property tests (tests/unit/test_plain_step.py) hold both paths to the same bytes and state.

``plain_step`` builds one when the stream qualifies (one choice, choice index 0, no stop strings, no
logprobs, no tool parser, the byte table serving, the encoder's ``content0`` parts); None otherwise,
and when the extension is not built.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from shepherd.node.output.chat import ChoiceParsing
from shepherd.node.output.choice import ChoiceState
from shepherd.proto.engine_types import EngineChunk, EngineEvent

try:  # optional: built by setup.py (the Python path serves without it)
    from shepherd.node.output._plainstep import PlainStep

    BUILT = True
except ImportError:  # pragma: no cover - without a C compiler
    BUILT = False

__all__ = ["BUILT", "PlainStep", "plain_step"]


def plain_step(
    st: ChoiceState,
    post: ChoiceParsing | None,
    content0: tuple[bytes, bytes] | None,
    *,
    observe: Callable[[float], None],
    last: list[float],
    cached: list[int],
    got: list[int],
    last_ids: list[Sequence[int]],
    seen: list[bool],
    ka: Any,
    send: Callable[[bytes], bool],
    pending: list[bytes],
    fallback: Callable[[list[EngineEvent]], bool],
    itl: object = None,
    limit: int | None = None,
) -> PlainStep | None:
    """The C step of choice ``st`` (index 0 of a one-choice stream), or None when it does not qualify.

    ``post``: the choice's parser stage (None: no parsers; ``content0`` then the encoder's content parts);
    ``observe``: the ITL histogram's (``itl``: the histogram itself, a ``metrics._HistogramChild``, which
    the C step then updates as its ``observe`` does, without the call); ``last`` / ``cached`` / ``got`` /
    ``last_ids`` / ``seen``: the generation loop's state (lists, choice 0 at index 0); ``ka``: the
    keep-alive entry (``last`` touched per write); ``send``: the connection's ``send_framed``;
    ``pending``: chunks waiting for the next write (the step leaves a non-empty list to ``fallback``);
    ``fallback``: ``take_and_write``; ``limit``: the tokens the choice may have (a chunk going past them is
    ``fallback``'s, which cuts it)."""
    if not BUILT or type(st) is not ChoiceState or st.index != 0:
        return None
    if post is not None:
        pc = post.plain_content()
        if pc is None:
            return None
        content0, reasoning = pc
    else:
        reasoning = None
    if content0 is None:
        return None
    plain = st.plain_detokenizer()
    if plain is None:
        return None
    detok, stop_ids = plain
    state = detok.byte_step_state()
    if state is None:
        return None
    ids, parts, drop, drop_extra, vocab = state
    if drop_extra is not None and (
        type(drop_extra) not in (set, frozenset) or not isinstance(drop_extra, set | frozenset)
    ):
        return None  # (the C step takes exact sets only)
    return PlainStep(
        EngineChunk,
        st,
        st.text,
        detok,
        ids,
        parts,
        drop,
        drop_extra,
        stop_ids,
        reasoning,
        content0[0],
        content0[1],
        observe,
        time.perf_counter,
        last,
        cached,
        got,
        last_ids,
        seen,
        ka,
        time.monotonic,
        send,
        pending,
        fallback,
        vocab,
        itl,
        **({} if limit is None else {"limit": limit}),
    )
