"""``PromptIds``: a prompt's token ids that also carry the pieces they were built from.

The shape is ``(key, n)`` pairs in order: ``key`` a string that determines the piece's ids (for one
tokenizer), ``n`` its number of ids; empty when unknown. The token caches (``shepherd.tokens.cache``)
produce them; the prefix index's block namer (``shepherd.policies.block_names``) consumes the shape to
name a prompt's blocks piece by piece.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

Shape = tuple[tuple[str, int], ...]

__all__ = ["PromptIds", "Shape", "shape_of"]


class PromptIds(list[int]):
    """A prompt's ids and the pieces they came from (``shape``; empty when unknown)."""

    __slots__ = ("shape",)

    def __init__(self, ids: Iterable[int] = (), shape: Shape = ()) -> None:
        super().__init__(ids)
        self.shape = shape


def shape_of(ids: Sequence[int]) -> Shape:
    return ids.shape if isinstance(ids, PromptIds) else ()
