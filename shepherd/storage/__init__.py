"""History storage behind one async interface (responses, conversations, items, the node's records).

Callers use ``types`` (``HistoryStore``, the records, ``StorageUnavailable`` ...), ``ids`` (record ids
that name their owner node) and the backends: ``memory.MemoryStore`` (bounded, in-process). Imports
proto only (docs/DESIGN.md §12).
"""

__all__ = ["ids", "memory", "types"]
