"""The history store's vocabulary: records, pages, errors and the one async interface every backend
implements (memory, SQLite, PostgreSQL, Redis; docs/DESIGN.md §12).

Records are plain frozen dataclasses whose fields are JSON values (``to_dict`` / ``from_dict``), so the
same record crosses a process boundary (SQLite's thread, the mesh's RPC) or a database row unchanged.

Semantics every backend keeps (the contract suite in tests/storage checks them on all four):

* ``put_response`` stores a response, its items and (with ``conversation_id``) the items' links to that
  conversation in one atomic step: after a failure nothing of it is visible.
* Items are immutable once stored; an item id is unique across the store (a second put of the same id
  is an ``IntegrityError``), and a response id too.
* ``get_chain`` walks ``previous_response_id`` from a response back to the start of its chain, oldest
  first, at most ``max_depth`` responses; a cycle or a longer chain is a ``ChainError``. A link to a
  response the store does not hold ends the walk: the oldest returned response then names it in
  ``previous_response_id`` (a router asks the next owner for the rest). Every response but the newest
  comes without its ``body`` (``{}``): a walk reads ids and item lists, and a chain of big bodies
  (``text.format`` schemas, a streamed background response's events) is not loaded whole for one turn.
* Conversation items are listed in the order they were added (``added_at``, then insertion), pages by
  ``after`` (an item id of that conversation) and ``limit``, ascending or descending.
* Retention: ``purge(older_than)`` removes responses, conversations (with their links) and items not
  referenced by a kept response or conversation, created before ``older_than`` (unix seconds).
* Leases: ``claim(name, holder, until, now)`` gives ``name`` to ``holder`` when no one else holds it at
  ``now`` (free, expired, or ``holder``'s own: renewed to ``until``), atomically across every node the
  backend serves; ``release`` frees it for its holder only. A conversation's turn in progress holds one
  (a second turn at once is refused, as OpenAI's ``conversation_locked``).
* Every method may raise ``StorageUnavailable`` when the backend cannot be reached: the API answers
  503 with ``Retry-After``, never a silent empty history.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

# a response's statuses once it has ended (``update_response(..., running_only=True)`` leaves such a one)
TERMINAL_STATUSES = frozenset({"completed", "failed", "incomplete", "cancelled"})

Order = Literal["asc", "desc"]


class StorageError(Exception):
    """Base of the errors a history store raises."""


class StorageUnavailable(StorageError):
    """The backend cannot be reached (or timed out): the caller answers 503 with Retry-After."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class IntegrityError(StorageError):
    """A write would break an invariant (a duplicate id, an item of another conversation, ...)."""


class ChainError(StorageError):
    """A ``previous_response_id`` chain loops or is longer than allowed."""


class NotFound(StorageError):
    """The record a write refers to does not exist (e.g. adding items to an unknown conversation)."""


@dataclass(frozen=True, slots=True)
class StoredItem:
    """One conversation / response item (``msg_``, ``fc_``, ``fco_``, ``rs_`` ...): ``data`` is the whole
    item as the API shows it (``type``, ``role``, ``content``, ``call_id``, ...), ``id`` included."""

    id: str
    type: str
    data: dict[str, Any]
    created_at: float
    response_id: str | None = None  # the response that produced or consumed it (None: added directly)
    role: str | None = None
    status: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": self.type,
            "data": self.data,
            "created_at": self.created_at,
            "response_id": self.response_id,
            "role": self.role,
            "status": self.status,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StoredItem:
        return cls(
            id=str(d["id"]),
            type=str(d["type"]),
            data=dict(d["data"]),
            created_at=float(d["created_at"]),
            response_id=d.get("response_id"),
            role=d.get("role"),
            status=d.get("status"),
        )


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A response as stored: ``body`` is the response object the API returns (status, output, usage,
    instructions, metadata, ...); ``input_item_ids`` the items of this turn's input, ``output_item_ids``
    those it produced, in order. ``owner``: the principal that created it (None: auth off); a caller
    that is not the owner (nor an admin) is told 404."""

    id: str
    created_at: float
    model: str
    body: dict[str, Any]
    input_item_ids: tuple[str, ...] = ()
    output_item_ids: tuple[str, ...] = ()
    previous_response_id: str | None = None
    conversation_id: str | None = None
    owner: str | None = None
    status: str = "completed"

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "created_at": self.created_at,
            "model": self.model,
            "body": self.body,
            "input_item_ids": list(self.input_item_ids),
            "output_item_ids": list(self.output_item_ids),
            "previous_response_id": self.previous_response_id,
            "conversation_id": self.conversation_id,
            "owner": self.owner,
            "status": self.status,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StoredResponse:
        return cls(
            id=str(d["id"]),
            created_at=float(d["created_at"]),
            model=str(d["model"]),
            body=dict(d.get("body") or {}),  # (none: a chain's older response, see ``get_chain``)
            input_item_ids=tuple(d.get("input_item_ids") or ()),
            output_item_ids=tuple(d.get("output_item_ids") or ()),
            previous_response_id=d.get("previous_response_id"),
            conversation_id=d.get("conversation_id"),
            owner=d.get("owner"),
            status=str(d.get("status") or "completed"),
        )


@dataclass(frozen=True, slots=True)
class StoredConversation:
    id: str
    created_at: float
    metadata: dict[str, str] = field(default_factory=dict)
    owner: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "created_at": self.created_at, "metadata": self.metadata, "owner": self.owner}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StoredConversation:
        return cls(
            id=str(d["id"]),
            created_at=float(d["created_at"]),
            metadata=dict(d.get("metadata") or {}),
            owner=d.get("owner"),
        )


@dataclass(frozen=True, slots=True)
class ItemPage:
    items: list[StoredItem]
    has_more: bool


@dataclass(slots=True)
class StoreStats:
    """Counters a backend keeps (exported as metrics): writes, reads, evictions (memory), purges."""

    writes: int = 0
    reads: int = 0
    evicted: int = 0
    purged: int = 0


class HistoryStore(Protocol):
    """The one async interface of every backend (see the module docstring for the semantics)."""

    name: str  # "memory", "sqlite", "postgres", "redis"
    stats: StoreStats
    shared: bool  # True: every node of a mesh sees the same records (postgres, redis)

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    # ---- responses ----
    async def put_response(
        self, response: StoredResponse, items: Sequence[StoredItem], conversation_id: str | None = None
    ) -> None: ...

    async def update_response(
        self, response: StoredResponse, items: Sequence[StoredItem] = (), *, running_only: bool = False
    ) -> bool:
        """Replace a stored response (a background response's status and output) and add ``items``,
        atomically; ``NotFound`` when it is not stored. With ``response.conversation_id`` the new
        items are linked to that conversation too. ``running_only``: only while the stored one has not
        ended (its status not in ``TERMINAL_STATUSES``: another writer's end stands). Returns whether
        it was replaced."""
        ...

    async def get_response(self, response_id: str) -> StoredResponse | None: ...

    async def delete_response(self, response_id: str) -> bool: ...

    async def get_chain(self, response_id: str, max_depth: int) -> list[StoredResponse]: ...

    async def get_items(self, item_ids: Sequence[str]) -> list[StoredItem]:
        """The items of these ids that exist, in the order asked."""
        ...

    # ---- conversations ----
    async def create_conversation(
        self, conversation: StoredConversation, items: Sequence[StoredItem] = ()
    ) -> None: ...

    async def get_conversation(self, conversation_id: str) -> StoredConversation | None: ...

    async def update_conversation(
        self, conversation_id: str, metadata: dict[str, str]
    ) -> StoredConversation | None: ...

    async def delete_conversation(self, conversation_id: str) -> bool: ...

    async def add_items(self, conversation_id: str, items: Sequence[StoredItem]) -> None:
        """Append items to a conversation (``NotFound`` when it does not exist)."""
        ...

    async def list_items(
        self, conversation_id: str, *, after: str | None = None, limit: int = 20, order: Order = "asc"
    ) -> ItemPage: ...

    async def get_item(self, conversation_id: str, item_id: str) -> StoredItem | None: ...

    async def delete_item(self, conversation_id: str, item_id: str) -> bool:
        """Unlink an item from a conversation (the item itself stays while a response refers to it)."""
        ...

    # ---- the node's own records (API keys, ...): opaque bytes by (kind, key) ----
    async def put_record(self, kind: str, key: str, value: bytes) -> None: ...

    async def get_record(self, kind: str, key: str) -> bytes | None: ...

    async def delete_record(self, kind: str, key: str) -> bool: ...

    async def list_records(self, kind: str) -> list[tuple[str, bytes]]: ...

    # ---- leases ----
    async def claim(self, name: str, holder: str, until: float, now: float) -> bool:
        """Hold lease ``name`` for ``holder`` until ``until`` (unix seconds) when no other holder has it
        at ``now``; whether ``holder`` holds it now."""
        ...

    async def release(self, name: str, holder: str) -> bool:
        """Free lease ``name`` if ``holder`` holds it (True: it did)."""
        ...

    # ---- retention ----
    async def purge(self, older_than: float) -> int:
        """Remove what was created before ``older_than`` (unix seconds); the count removed."""
        ...
