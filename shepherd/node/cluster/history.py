"""The node's history store (docs/DESIGN.md §12): the configured backend, routed over the mesh when it is
embedded, and its retention.

- **Backend** (``open_backend``): ``memory`` (bounded, lost on restart), ``sqlite`` (one file; the
  default path is ``<data_dir>/history.db``), ``postgres`` / ``redis`` (shared by every node: nothing
  is routed). The settings are checked at start-up by ``shepherd.node.config`` (``check_history``).
- **Routing** (``RoutedStore``): with an embedded backend (not ``shared``) in a mesh, every record id
  names its owner node (``storage.ids``: a tag, the first 4 bytes of SHA-256 of the owner's mesh name).
  Each call on an id whose tag is another member's is sent to that member over the mesh's RPC channel
  (mTLS, sealed): one msgpack map ``{"m": method, "a": {args}}`` of the records' ``to_dict`` forms; the
  owner answers ``{"ok": result}`` or ``{"err": kind, "msg": text}``. ``RpcServer`` is the owner's side:
  it checks everything from the wire (a method allowlist, the argument types and sizes, and that the id
  is this node's) before it calls the local backend. An id without a tag (a record another gateway
  wrote to a shared database) is looked up locally; the node's own records (API keys) and ``purge``
  never leave the node.
- **Failures**: an owner this node does not know, or one that is dead or has left, raises ``OwnerGone``
  (a ``NotFound``: the API answers 404 naming the owner); a suspected owner, or an RPC that failed or
  was refused, raises ``StorageUnavailable`` (503 with Retry-After): never a silently empty history.
- **Chains** across owners (``get_chain``): asked segment by segment; each owner returns the part of the
  chain it holds, and the oldest response of a segment names, in ``previous_response_id``, the next
  segment's newest (and by its tag, the next owner). The whole walk keeps one depth bound and a cycle
  check over every id seen.
- **Background responses**: ``cancel`` reaches the ``BackgroundRegistry`` of the node that runs the
  response (RPC method ``"cancel"``; ``set_cancel_handler`` installs the local one); ``running`` asks the
  node a record names as its runner whether it still runs it (``NodeHistory.runner_runs``: a node
  restarted under the same name does not, and its record would read ``in_progress`` forever).
- **Retention** (``Retention``): ``purge`` of what is older than ``history_retention_days``, at start and
  every ``RETENTION_INTERVAL_S``, on this node's own backend (each owner purges its own records).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import msgpack  # type: ignore[import-untyped]

from shepherd.mesh.runtime import RpcError, RpcHandler
from shepherd.node.config import ConfigError, NodeConfig, default_node_name
from shepherd.node.metrics import counter
from shepherd.node.observe import tracing
from shepherd.proto.msgpack_bounds import Limits, unpack_async
from shepherd.storage.factory import open_store
from shepherd.storage.ids import node_tag, tag_of
from shepherd.storage.types import (
    TERMINAL_STATUSES,
    ChainError,
    HistoryStore,
    IntegrityError,
    ItemPage,
    NotFound,
    Order,
    StorageError,
    StorageUnavailable,
    StoredConversation,
    StoredItem,
    StoredResponse,
    StoreStats,
)

log = logging.getLogger("shepherd.node.cluster.history")

RETENTION_INTERVAL_S = 3600.0
MAX_PAYLOAD = 16 * 1024 * 1024  # an RPC request this node accepts (the mesh's frame bound is the other)
MAX_ITEMS = 10_000  # items in one write, ids in one get_items
MAX_LIST_LIMIT = 1000
REPLY_BUDGET = 4 * 1024 * 1024  # records in one reply (the mesh's frames are at most 16 MiB)
ITEM_HINTS = 100_000  # item id -> owner entries kept (get_items)
# writes the owner did not take (dead, suspected, no answer) that would otherwise leave a record stuck: a
# background response's end (read elsewhere as in progress: only the node that ran it knows how it ended;
# a lease's release is made again by its turn, ``responses._Lease``). Sent again while the owner is alive
# (an owner that restarts keeps them: an embedded backend on disk), every RETRY_S for at most RETRY_FOR_S;
# at most PENDING_WRITES of them and PENDING_BYTES in all (the oldest dropped)
RETRY_S = 1.0
RETRY_FOR_S = 900.0
PENDING_WRITES = 4096
PENDING_BYTES = 64 * 1024 * 1024
_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")  # (fullmatch: "$" would let a trailing newline in)
_MAX_STR = 1 << 20

MemberStatus = Literal["alive", "suspect", "dead", "left"]


class OwnerGone(NotFound):
    """The node owning a record is not a live member of the mesh: its records are unreachable."""


class OwnerUnavailable(StorageUnavailable):
    """The node owning a record cannot answer for it now (suspected down, no answer in time, busy, its
    own store unavailable): a 503 for calls on that node's records, not a sign that this node's own store
    is down (``History.store_failed`` ignores it)."""


class MeshLink(Protocol):
    """What the routed store uses of ``shepherd.node.cluster.mesh_node.MeshNode``."""

    name: str

    async def rpc(self, name: str, payload: bytes, timeout: float | None = None) -> bytes: ...

    def set_rpc_handler(self, handler: RpcHandler | None) -> None: ...

    def member_status(self, name: str) -> MemberStatus | None: ...

    def members(self) -> list[dict[str, Any]]: ...


CancelHandler = Callable[[str], Awaitable[bool]]
# how long after its start a node takes a tag no member has for a node gone (before: it may not have heard
# of every member yet)
MEMBERS_KNOWN_S = 60.0


# ---- the wire -----------------------------------------------------------------------------------------


def _pack(obj: Any) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


# what a peer's request and a member's reply may decode into (``msgpack_bounds``): records are JSON
# (a transcript's items hold an array or map per ~40 bytes, a response with logprobs one per ~18: more
# than one per 8 bytes is refused, as a 16 MiB body of empty arrays, 16 million lists); requests carry no
# bytes, replies only a "metrics" exposition
REQUEST_LIMITS = Limits(
    max_bytes=MAX_PAYLOAD,
    max_str_len=MAX_PAYLOAD,
    max_bin_len=0,
    max_array_len=MAX_PAYLOAD,
    max_map_len=MAX_PAYLOAD,
    bytes_per_container=8,
)
REPLY_LIMITS = dataclasses.replace(REQUEST_LIMITS, max_bin_len=MAX_PAYLOAD)


_ERRORS: dict[str, type[StorageError]] = {
    "not_found": NotFound,
    "integrity": IntegrityError,
    "chain": ChainError,
    "unavailable": StorageUnavailable,
}


def _error_kind(e: StorageError) -> str:
    for kind, cls in (
        ("unavailable", StorageUnavailable),
        ("chain", ChainError),
        ("integrity", IntegrityError),
        ("not_found", NotFound),
    ):
        if isinstance(e, cls):
            return kind
    return "storage"


class WireError(ValueError):
    """A request from the wire that does not have the expected shape."""


def _id(v: Any, what: str = "id") -> str:
    if not isinstance(v, str) or not _ID_RE.fullmatch(v):
        raise WireError(f"{what} must be an id string")
    return v


def _opt_id(v: Any, what: str) -> str | None:
    return None if v is None else _id(v, what)


def _ids(v: Any, what: str) -> list[str]:
    if not isinstance(v, list) or len(v) > MAX_ITEMS:
        raise WireError(f"{what} must be a list of at most {MAX_ITEMS} ids")
    return [_id(x, what) for x in v]


def _num(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise WireError(f"{what} must be a number")
    return float(v)


def _str(v: Any, what: str, optional: bool = False) -> str | None:
    if v is None and optional:
        return None
    if not isinstance(v, str) or len(v) > _MAX_STR:
        raise WireError(f"{what} must be a string")
    return v


def _dict(v: Any, what: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise WireError(f"{what} must be a map")
    return v


def _item(v: Any) -> StoredItem:
    d = _dict(v, "item")
    _id(d.get("id"), "item id")
    _str(d.get("type"), "item type")
    _dict(d.get("data"), "item data")
    _num(d.get("created_at"), "item created_at")
    _opt_id(d.get("response_id"), "item response_id")
    for k in ("role", "status"):
        _str(d.get(k), f"item {k}", optional=True)
    return StoredItem.from_dict(d)


def _items(v: Any) -> list[StoredItem]:
    if not isinstance(v, list) or len(v) > MAX_ITEMS:
        raise WireError(f"items must be a list of at most {MAX_ITEMS}")
    return [_item(x) for x in v]


def _response(v: Any) -> StoredResponse:
    d = _dict(v, "response")
    _id(d.get("id"), "response id")
    _num(d.get("created_at"), "response created_at")
    _str(d.get("model"), "response model")
    _dict(d.get("body"), "response body")
    _ids(d.get("input_item_ids") or [], "input_item_ids")
    _ids(d.get("output_item_ids") or [], "output_item_ids")
    _opt_id(d.get("previous_response_id"), "previous_response_id")
    _opt_id(d.get("conversation_id"), "conversation_id")
    _str(d.get("owner"), "owner", optional=True)
    _str(d.get("status"), "status", optional=True)
    return StoredResponse.from_dict(d)


def _metadata(v: Any) -> dict[str, str]:
    d = _dict(v, "metadata")
    if len(d) > 64 or not all(isinstance(k, str) and isinstance(x, str) for k, x in d.items()):
        raise WireError("metadata must map strings to strings")
    return d


def _conversation(v: Any) -> StoredConversation:
    d = _dict(v, "conversation")
    _id(d.get("id"), "conversation id")
    _num(d.get("created_at"), "conversation created_at")
    _metadata(d.get("metadata") or {})
    _str(d.get("owner"), "owner", optional=True)
    return StoredConversation.from_dict(d)


def _fit(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first of ``records`` that fit one reply (at least one)."""
    out: list[dict[str, Any]] = []
    size = 0
    for d in records:
        n = len(_pack(d))
        if out and size + n > REPLY_BUDGET:
            break
        out.append(d)
        size += n
    return out


def _page(p: ItemPage) -> dict[str, Any]:
    return {"items": [i.to_dict() for i in p.items], "has_more": p.has_more}


# ---- the owner's side ---------------------------------------------------------------------------------


MAX_LEASE_S = 86_400.0  # a lease a peer asks for lasts at most this long (then it expires)


class RpcServer:
    """Serves the history RPCs of the mesh's peers on the local backend (see the module doc)."""

    def __init__(
        self, local: HistoryStore, tag: str, *, max_chain_depth: int = 1000, storage: bool = True
    ) -> None:
        self.local = local
        self.tag = tag
        self.max_chain_depth = max_chain_depth
        self.cancel_handler: CancelHandler | None = None
        # whether a background response runs in this process (its ``BackgroundRegistry``)
        self.running_handler: Callable[[str], bool] | None = None
        # this process's /metrics exposition, for its sibling processes (``--procs N``: one node to the
        # outside, whose scrape shows every process's series); None: not served
        self.metrics_handler: Callable[[], Awaitable[bytes]] | None = None
        self.served = 0
        self.refused = 0
        # the allowlist: the only methods a peer may call
        self._methods: dict[str, Callable[[dict[str, Any]], Awaitable[Any]]] = {
            "put_response": self._put_response,
            "update_response": self._update_response,
            "get_response": self._get_response,
            "delete_response": self._delete_response,
            "get_chain": self._get_chain,
            "get_items": self._get_items,
            "create_conversation": self._create_conversation,
            "get_conversation": self._get_conversation,
            "update_conversation": self._update_conversation,
            "delete_conversation": self._delete_conversation,
            "add_items": self._add_items,
            "list_items": self._list_items,
            "get_item": self._get_item,
            "delete_item": self._delete_item,
            "claim": self._claim,
            "release": self._release,
            "cancel": self._cancel,
            "running": self._running,
        }
        self._methods["metrics"] = self._metrics
        if not storage:  # a shared backend: every node reads it itself; peers ask for cancels and runs
            self._methods = {"cancel": self._cancel, "running": self._running, "metrics": self._metrics}

    def _mine(self, record_id: str) -> str:
        if tag_of(record_id) != self.tag:
            raise WireError(f"{record_id[:40]!r} is not owned by this node")
        return record_id

    async def handle(self, peer: str, payload: bytes) -> bytes:
        """``MeshNode.set_rpc_handler`` handler: one request in, one reply out (errors are replies)."""
        try:
            if len(payload) > MAX_PAYLOAD:
                raise WireError("request too large")
            try:
                req = await unpack_async(payload, REQUEST_LIMITS)
            except Exception as e:
                raise WireError(f"not a msgpack request: {e}"[:200]) from None
            req = _dict(req, "request")
            method, args = req.get("m"), _dict(req.get("a", {}), "arguments")
            fn = self._methods.get(method) if isinstance(method, str) else None
            if fn is None:
                raise WireError(f"unknown method {str(method)[:40]!r}")
            with tracing.rpc_server(peer, str(method), req.get("t")):  # the caller's trace (tracing on)
                result = await fn(args)
            self.served += 1
            return _pack({"ok": result})
        except WireError as e:
            self.refused += 1
            log.warning("history rpc from %s refused: %s", peer[:64], e)
            return _pack({"err": "bad", "msg": str(e)})
        except (KeyError, TypeError, ValueError) as e:
            self.refused += 1
            log.warning("history rpc from %s refused: %s: %s", peer[:64], type(e).__name__, e)
            return _pack({"err": "bad", "msg": f"malformed request ({type(e).__name__})"})
        except StorageError as e:
            return _pack({"err": _error_kind(e), "msg": str(e)[:500]})

    # each method: validated arguments -> the local call -> a msgpack-able result

    async def _put_response(self, a: dict[str, Any]) -> None:
        r = _response(a.get("response"))
        self._mine(r.id)
        await self.local.put_response(
            r, _items(a.get("items", [])), _opt_id(a.get("conversation_id"), "conv")
        )

    async def _update_response(self, a: dict[str, Any]) -> bool:
        r = _response(a.get("response"))
        self._mine(r.id)
        running_only = a.get("running_only") is True
        return await self.local.update_response(r, _items(a.get("items", [])), running_only=running_only)

    async def _get_response(self, a: dict[str, Any]) -> Any:
        r = await self.local.get_response(self._mine(_id(a.get("id"))))
        return None if r is None else r.to_dict()

    async def _delete_response(self, a: dict[str, Any]) -> bool:
        return await self.local.delete_response(self._mine(_id(a.get("id"))))

    async def _get_chain(self, a: dict[str, Any]) -> dict[str, Any]:
        depth = a.get("max_depth")
        if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= self.max_chain_depth:
            raise WireError(f"max_depth must be an integer in 1..{self.max_chain_depth}")
        chain = [r.to_dict() for r in await self.local.get_chain(self._mine(_id(a.get("id"))), depth)]
        keep = _fit(list(reversed(chain)))  # the newest part that fits one reply; the caller asks again
        keep.reverse()
        return {"chain": keep, "more": len(keep) < len(chain)}

    async def _get_items(self, a: dict[str, Any]) -> dict[str, Any]:
        ids = _ids(a.get("ids"), "ids")
        found = {i.id: i.to_dict() for i in await self.local.get_items(ids)}
        out: list[dict[str, Any]] = []
        size = done = 0
        for i in ids:  # in the order asked, as many as fit one reply ("done": the ids answered for)
            d = found.get(i)
            if d is not None:
                n = len(_pack(d))
                if out and size + n > REPLY_BUDGET:
                    break
                out.append(d)
                size += n
            done += 1
        return {"items": out, "done": done}

    async def _create_conversation(self, a: dict[str, Any]) -> None:
        c = _conversation(a.get("conversation"))
        self._mine(c.id)
        await self.local.create_conversation(c, _items(a.get("items", [])))

    async def _get_conversation(self, a: dict[str, Any]) -> Any:
        c = await self.local.get_conversation(self._mine(_id(a.get("id"))))
        return None if c is None else c.to_dict()

    async def _update_conversation(self, a: dict[str, Any]) -> Any:
        c = await self.local.update_conversation(self._mine(_id(a.get("id"))), _metadata(a.get("metadata")))
        return None if c is None else c.to_dict()

    async def _delete_conversation(self, a: dict[str, Any]) -> bool:
        return await self.local.delete_conversation(self._mine(_id(a.get("id"))))

    async def _add_items(self, a: dict[str, Any]) -> None:
        await self.local.add_items(self._mine(_id(a.get("id"))), _items(a.get("items")))

    async def _list_items(self, a: dict[str, Any]) -> dict[str, Any]:
        limit, order = a.get("limit"), a.get("order")
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_LIMIT:
            raise WireError(f"limit must be an integer in 1..{MAX_LIST_LIMIT}")
        if order not in ("asc", "desc"):
            raise WireError("order must be 'asc' or 'desc'")
        page = await self.local.list_items(
            self._mine(_id(a.get("id"))), after=_opt_id(a.get("after"), "after"), limit=limit, order=order
        )
        return _page(page)

    async def _get_item(self, a: dict[str, Any]) -> Any:
        it = await self.local.get_item(self._mine(_id(a.get("id"))), _id(a.get("item_id"), "item_id"))
        return None if it is None else it.to_dict()

    async def _delete_item(self, a: dict[str, Any]) -> bool:
        return await self.local.delete_item(self._mine(_id(a.get("id"))), _id(a.get("item_id"), "item_id"))

    def _lease(self, a: dict[str, Any]) -> tuple[str, str]:
        """(the lease's name: ``kind:id``, an id this node owns; its holder: an id)."""
        name = a.get("name")
        kind, _, rid = name.rpartition(":") if isinstance(name, str) else ("", "", "")
        if not kind.isidentifier():
            raise WireError("a lease name is kind:id")
        return f"{kind}:{self._mine(_id(rid))}", _id(a.get("holder"), "holder")

    async def _claim(self, a: dict[str, Any]) -> bool:
        """The caller's lease, on this node's clock: its length (``until - now`` on the caller's) is
        kept, bounded; its times are not (a peer's clock, or a peer that sends ``inf``, does not
        decide when a lease here ends)."""
        name, holder = self._lease(a)
        until, now = a.get("until"), a.get("now")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (until, now)):
            raise WireError("'until' and 'now' must be numbers")
        ttl = float(until) - float(now)  # type: ignore[arg-type]
        if not 0 < ttl <= MAX_LEASE_S:  # (nan and inf fail too)
            raise WireError(f"a lease lasts more than 0 and at most {MAX_LEASE_S:.0f} s")
        here = time.time()
        return await self.local.claim(name, holder, here + ttl, here)

    async def _release(self, a: dict[str, Any]) -> bool:
        return await self.local.release(*self._lease(a))

    async def _metrics(self, a: dict[str, Any]) -> bytes | None:
        handler = self.metrics_handler
        return None if handler is None else await handler()

    async def _cancel(self, a: dict[str, Any]) -> bool:
        # any id: a background response runs on the node that took the request, which is not always
        # the one its id names (a response in a conversation is stored by the conversation's owner)
        rid = _id(a.get("id"))
        handler = self.cancel_handler
        return False if handler is None else bool(await handler(rid))

    async def _running(self, a: dict[str, Any]) -> bool:
        rid = _id(a.get("id"))
        handler = self.running_handler
        return False if handler is None else bool(handler(rid))


# ---- the caller's side --------------------------------------------------------------------------------


class RoutedStore:
    """A ``HistoryStore`` over this node's backend that sends each call on another owner's id to that
    owner over the mesh (see the module doc). ``name``, ``stats``: the local backend's."""

    shared = False

    def __init__(
        self,
        local: HistoryStore,
        link: MeshLink,
        *,
        rpc_timeout: float | None = None,
        max_chain_depth: int = 1000,
    ) -> None:
        self.local = local
        self.link = link
        self.name = local.name
        self.stats: StoreStats = local.stats  # the same object: the backend's counters
        self.tag = node_tag(link.name)
        self.rpc_timeout = rpc_timeout
        self.server = RpcServer(local, self.tag, max_chain_depth=max_chain_depth)
        self._names: dict[str, str] = {}  # owner tag -> member name
        # item id -> the owner of the response that lists it (item ids may be a client's: no owner tag)
        self._item_owner: OrderedDict[str, str] = OrderedDict()
        self.routed = 0  # calls sent to another owner
        self.routed_failed = 0
        # writes the owner did not take, sent again (``_later``): (method, key) -> (owner, give up at
        # (monotonic), arguments, their size)
        self._pending: OrderedDict[tuple[str, str], tuple[str, float, dict[str, Any], int]] = OrderedDict()
        self._pending_bytes = 0
        self._retry_task: asyncio.Task[None] | None = None

    def install(self) -> None:
        """Serve the peers' history RPCs from this node's backend."""
        self.link.set_rpc_handler(self.server.handle)

    def set_cancel_handler(self, handler: CancelHandler | None) -> None:
        """The local ``BackgroundRegistry.cancel`` (async: response id -> cancelled?)."""
        self.server.cancel_handler = handler

    async def start(self) -> None:
        await self.local.start()

    async def close(self) -> None:
        task, self._retry_task = self._retry_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.local.close()

    # -- owners ---------------------------------------------------------------------------------------

    def owner(self, record_id: str) -> str | None:
        """The member that owns ``record_id`` (None: this node; an id without a tag is looked up here);
        ``OwnerGone`` when no member of the mesh has its tag."""
        tag = tag_of(record_id)
        if tag is None or tag == self.tag:
            return None
        name = self._names.get(tag)
        if name is None:
            for m in self.link.members():
                n = m.get("name")
                if isinstance(n, str) and len(self._names) < 65_536:
                    self._names[node_tag(n)] = n
            name = self._names.get(tag)
        if name is None:
            raise OwnerGone(
                f"{record_id[:48]!r} is owned by a node that is not in the mesh (tag {tag}): its records "
                "are unreachable (an embedded history backend keeps records on the node that made them)"
            )
        return name

    async def _call(self, owner: str, method: str, args: dict[str, Any]) -> Any:
        status = self.link.member_status(owner)
        if status in ("dead", "left", None):
            raise OwnerGone(
                f"the node {owner!r} that owns this record is {status or 'unknown'}: its records are "
                "unreachable until it is back (an embedded history backend keeps records on its node)"
            )
        if status == "suspect":
            raise OwnerUnavailable(f"the node {owner!r} that owns this record is suspected down", 2.0)
        self.routed += 1
        req: dict[str, Any] = {"m": method, "a": args}
        # a CLIENT span (tracing on); the owner continues the trace from the request's "t"
        with tracing.rpc_client(owner, method) as carrier:
            if carrier:
                req["t"] = carrier
            try:
                raw = await self.link.rpc(owner, _pack(req), timeout=self.rpc_timeout)
            except RpcError as e:
                self.routed_failed += 1
                if e.reason == "unknown":
                    raise OwnerGone(f"the node {owner!r} that owns this record has left the mesh") from None
                # the mesh's detail (an address, an exception) goes to the log, not to API clients
                log.info("history: %s on %r failed: %s", method, owner, e)
                what = "is busy" if "busy" in e.message else f"did not answer ({e.reason})"
                raise OwnerUnavailable(f"the node {owner!r} that owns this record {what}", 1.0) from None
        try:
            reply = await unpack_async(raw, REPLY_LIMITS)
        except Exception:
            self.routed_failed += 1
            raise OwnerUnavailable(f"the node {owner!r} answered an unreadable reply") from None
        if not isinstance(reply, dict):
            raise OwnerUnavailable(f"the node {owner!r} answered an unreadable reply")
        if "ok" in reply:
            return reply["ok"]
        kind, msg = reply.get("err"), str(reply.get("msg", ""))[:500]
        cls = _ERRORS.get(kind) if isinstance(kind, str) else None
        if cls is StorageUnavailable:  # (the owner's store: not this node's)
            cls = OwnerUnavailable
        if cls is None:
            self.routed_failed += 1
            raise OwnerUnavailable(f"the node {owner!r} refused a history call: {msg}")
        raise cls(msg)

    # -- responses ------------------------------------------------------------------------------------

    async def put_response(
        self, response: StoredResponse, items: Sequence[StoredItem], conversation_id: str | None = None
    ) -> None:
        owner = self.owner(response.id)
        if owner is None:
            return await self.local.put_response(response, items, conversation_id)
        args = {"response": response.to_dict(), "items": [i.to_dict() for i in items]}
        await self._call(owner, "put_response", {**args, "conversation_id": conversation_id})

    async def update_response(
        self, response: StoredResponse, items: Sequence[StoredItem] = (), *, running_only: bool = False
    ) -> bool:
        owner = self.owner(response.id)
        if owner is None:
            return await self.local.update_response(response, items, running_only=running_only)
        args: dict[str, Any] = {"response": response.to_dict(), "items": [i.to_dict() for i in items]}
        if running_only:  # (an owner of an older version ignores it: the update is made as before)
            args["running_only"] = True
        try:
            return await self._call(owner, "update_response", args) is not False
        except (OwnerGone, StorageUnavailable):
            if running_only and response.status in TERMINAL_STATUSES:  # a background response's end
                self._later(owner, "update_response", response.id, args)
            raise

    async def get_response(self, response_id: str) -> StoredResponse | None:
        owner = self.owner(response_id)
        if owner is None:
            return await self.local.get_response(response_id)
        d = await self._call(owner, "get_response", {"id": response_id})
        if d is None:
            return None
        r = _response(d)
        self._remember(owner, [r])
        return r

    def _remember(self, owner: str, responses: Iterable[StoredResponse]) -> None:
        """Where the items of responses fetched from ``owner`` live (``get_items`` asks there)."""
        hints = self._item_owner
        for r in responses:
            for i in (*r.input_item_ids, *r.output_item_ids):
                hints[i] = owner
                hints.move_to_end(i)
        while len(hints) > ITEM_HINTS:
            hints.popitem(last=False)

    async def delete_response(self, response_id: str) -> bool:
        owner = self.owner(response_id)
        if owner is None:
            return await self.local.delete_response(response_id)
        return bool(await self._call(owner, "delete_response", {"id": response_id}))

    async def _segment(
        self, owner: str | None, response_id: str, depth: int
    ) -> tuple[list[StoredResponse], bool]:
        """The part of the chain ``owner`` holds from ``response_id``, and whether it holds more of it
        than one reply carried (then it is asked again from the oldest's ``previous_response_id``)."""
        if owner is None:
            return await self.local.get_chain(response_id, depth), False
        got = await self._call(owner, "get_chain", {"id": response_id, "max_depth": depth})
        raw = got.get("chain") if isinstance(got, dict) else None
        if not isinstance(raw, list):
            raise OwnerUnavailable(f"the node {owner!r} answered an unreadable chain")
        chain = [_response(d) for d in raw]
        self._remember(owner, chain)
        return chain, bool(got.get("more")) and bool(chain)

    async def get_chain(self, response_id: str, max_depth: int) -> list[StoredResponse]:
        segments: list[list[StoredResponse]] = []
        seen: set[str] = set()
        total = 0
        rid, owner = response_id, self.owner(response_id)
        for _ in range(max_depth + 1):  # each round adds at least one response, or ends
            remaining = max_depth - total
            seg, more = await self._segment(owner, rid, max(remaining, 1))
            if not seg:
                break
            if remaining <= 0:
                raise ChainError(f"the chain of {response_id!r} is longer than {max_depth} responses")
            for r in seg:
                if r.id in seen:
                    raise ChainError(f"the chain of {response_id!r} loops at {r.id!r}")
                seen.add(r.id)
            segments.append(seg)
            total += len(seg)
            nxt = seg[0].previous_response_id
            if nxt is None:
                break
            if nxt in seen:
                raise ChainError(f"the chain of {response_id!r} loops at {nxt!r}")
            next_owner = self.owner(nxt)
            if next_owner == owner and not more:
                break  # its owner does not hold it: the chain ends here (the oldest names the link)
            rid, owner = nxt, next_owner
        out: list[StoredResponse] = []
        for k, seg in enumerate(reversed(segments)):
            if k < len(segments) - 1 and seg[-1].body:  # each owner's newest came whole: the chain's alone
                seg = [*seg[:-1], dataclasses.replace(seg[-1], body={})]
            out.extend(seg)
        return out

    async def get_items(self, item_ids: Sequence[str]) -> list[StoredItem]:
        """Items live with the response or conversation that stored them, and an item id may be a
        client's (no owner tag): each id is asked of the owner of the response it was last seen in
        (``get_response`` / ``get_chain`` remember them; that owner's failure is an error), else of the
        owner its tag names (best effort: a client's id may carry any tag), and of this node."""
        found: dict[str, StoredItem] = {}
        hinted: dict[str, list[str]] = {}
        guessed: dict[str, list[str]] = {}
        for i in item_ids:
            owner = self._item_owner.get(i)
            if owner is not None:
                hinted.setdefault(owner, []).append(i)
                continue
            try:
                tagged = self.owner(i)
            except OwnerGone:
                tagged = None
            if tagged is not None:
                guessed.setdefault(tagged, []).append(i)
        for owner, ids in hinted.items():
            found.update((it.id, it) for it in await self._remote_items(owner, ids))
        for owner, ids in guessed.items():
            with contextlib.suppress(NotFound, StorageUnavailable):
                found.update((it.id, it) for it in await self._remote_items(owner, ids))
        rest = [i for i in item_ids if i not in found]
        if rest:
            found.update((it.id, it) for it in await self.local.get_items(rest))
        return [found[i] for i in item_ids if i in found]

    async def _remote_items(self, owner: str, ids: list[str]) -> list[StoredItem]:
        out: list[StoredItem] = []
        k = 0
        while k < len(ids):  # each round answers for at least one id
            got = await self._call(owner, "get_items", {"ids": ids[k : k + MAX_ITEMS]})
            raw = got.get("items") if isinstance(got, dict) else None
            done = got.get("done") if isinstance(got, dict) else None
            if not isinstance(raw, list) or not isinstance(done, int) or done < 1:
                raise OwnerUnavailable(f"the node {owner!r} answered unreadable items")
            out.extend(_item(d) for d in raw)
            k += done
        return out

    # -- conversations --------------------------------------------------------------------------------

    async def create_conversation(
        self, conversation: StoredConversation, items: Sequence[StoredItem] = ()
    ) -> None:
        owner = self.owner(conversation.id)
        if owner is None:
            return await self.local.create_conversation(conversation, items)
        args = {"conversation": conversation.to_dict(), "items": [i.to_dict() for i in items]}
        await self._call(owner, "create_conversation", args)

    async def get_conversation(self, conversation_id: str) -> StoredConversation | None:
        owner = self.owner(conversation_id)
        if owner is None:
            return await self.local.get_conversation(conversation_id)
        d = await self._call(owner, "get_conversation", {"id": conversation_id})
        return None if d is None else _conversation(d)

    async def update_conversation(
        self, conversation_id: str, metadata: dict[str, str]
    ) -> StoredConversation | None:
        owner = self.owner(conversation_id)
        if owner is None:
            return await self.local.update_conversation(conversation_id, metadata)
        d = await self._call(owner, "update_conversation", {"id": conversation_id, "metadata": metadata})
        return None if d is None else _conversation(d)

    async def delete_conversation(self, conversation_id: str) -> bool:
        owner = self.owner(conversation_id)
        if owner is None:
            return await self.local.delete_conversation(conversation_id)
        return bool(await self._call(owner, "delete_conversation", {"id": conversation_id}))

    async def add_items(self, conversation_id: str, items: Sequence[StoredItem]) -> None:
        owner = self.owner(conversation_id)
        if owner is None:
            return await self.local.add_items(conversation_id, items)
        args = {"id": conversation_id, "items": [i.to_dict() for i in items]}
        await self._call(owner, "add_items", args)

    async def list_items(
        self, conversation_id: str, *, after: str | None = None, limit: int = 20, order: Order = "asc"
    ) -> ItemPage:
        owner = self.owner(conversation_id)
        if owner is None:
            return await self.local.list_items(conversation_id, after=after, limit=limit, order=order)
        args = {"id": conversation_id, "after": after, "limit": limit, "order": order}
        d = _dict(await self._call(owner, "list_items", args), "page")
        raw = d.get("items")
        if not isinstance(raw, list):
            raise OwnerUnavailable(f"the node {owner!r} answered an unreadable page")
        return ItemPage([_item(x) for x in raw], bool(d.get("has_more")))

    async def get_item(self, conversation_id: str, item_id: str) -> StoredItem | None:
        owner = self.owner(conversation_id)
        if owner is None:
            return await self.local.get_item(conversation_id, item_id)
        d = await self._call(owner, "get_item", {"id": conversation_id, "item_id": item_id})
        return None if d is None else _item(d)

    async def delete_item(self, conversation_id: str, item_id: str) -> bool:
        owner = self.owner(conversation_id)
        if owner is None:
            return await self.local.delete_item(conversation_id, item_id)
        return bool(await self._call(owner, "delete_item", {"id": conversation_id, "item_id": item_id}))

    # -- background responses -------------------------------------------------------------------------

    # -- this node's own records and retention: never routed ------------------------------------------

    async def claim(self, name: str, holder: str, until: float, now: float) -> bool:
        owner = self.owner(name.rpartition(":")[2])  # a lease lives with the record it names
        if owner is None:
            return await self.local.claim(name, holder, until, now)
        args = {"name": name, "holder": holder, "until": until, "now": now}
        return bool(await self._call(owner, "claim", args))

    async def release(self, name: str, holder: str) -> bool:
        owner = self.owner(name.rpartition(":")[2])
        if owner is None:
            return await self.local.release(name, holder)
        return bool(await self._call(owner, "release", {"name": name, "holder": holder}))

    def _later(self, owner: str, method: str, key: str, args: dict[str, Any]) -> None:
        """Send ``method(args)`` to ``owner`` again once it is alive (``_retry``); the latest per key."""
        size = len(_pack(args))
        if size > PENDING_BYTES:
            return
        old = self._pending.pop((method, key), None)
        if old is not None:
            self._pending_bytes -= old[3]
        self._pending[(method, key)] = (owner, time.monotonic() + RETRY_FOR_S, args, size)
        self._pending_bytes += size
        while len(self._pending) > PENDING_WRITES or self._pending_bytes > PENDING_BYTES:
            self._pending_bytes -= self._pending.popitem(last=False)[1][3]
        if self._retry_task is None or self._retry_task.done():
            self._retry_task = asyncio.get_running_loop().create_task(self._retry())

    async def _retry(self) -> None:
        """Send the writes owners did not take again, each while its owner is alive, until taken."""
        while self._pending:
            await asyncio.sleep(RETRY_S)
            now = time.monotonic()
            for k, (owner, give_up, args, size) in list(self._pending.items()):
                if now <= give_up:
                    if self.link.member_status(owner) != "alive":
                        continue
                    try:
                        await self._call(owner, k[0], args)
                    except (OwnerGone, StorageUnavailable):
                        continue  # again later
                    except StorageError as e:
                        log.info("history: %s of %s not taken by %r: %s", k[0], k[1][:96], owner, e)
                cur = self._pending.get(k)
                if cur is not None and cur[2] is args:  # (not replaced by a newer one meanwhile)
                    del self._pending[k]
                    self._pending_bytes -= size

    async def put_record(self, kind: str, key: str, value: bytes) -> None:
        await self.local.put_record(kind, key, value)

    async def get_record(self, kind: str, key: str) -> bytes | None:
        return await self.local.get_record(kind, key)

    async def delete_record(self, kind: str, key: str) -> bool:
        return await self.local.delete_record(kind, key)

    async def list_records(self, kind: str) -> list[tuple[str, bytes]]:
        return await self.local.list_records(kind)

    async def purge(self, older_than: float) -> int:
        return await self.local.purge(older_than)


# ---- retention ----------------------------------------------------------------------------------------


class Retention:
    """Purges what is older than ``days`` from ``store``: once at start, then every ``interval``."""

    def __init__(
        self,
        store: HistoryStore,
        days: float,
        *,
        interval: float = RETENTION_INTERVAL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.days = days
        self.interval = interval
        self.clock = clock
        self.runs = 0
        self.purged = 0
        self.failures = 0
        self._task: asyncio.Task[None] | None = None

    async def run_once(self) -> int:
        n = await self.store.purge(self.clock() - self.days * 86400.0)
        self.runs += 1
        self.purged += n
        if n:
            log.info("history retention: purged %d records older than %g days", n, self.days)
        return n

    async def _loop(self) -> None:
        while True:  # until cancelled by close()
            try:
                await self.run_once()
            except Exception:
                self.failures += 1
                log.exception("history retention: purge failed (retried in %g s)", self.interval)
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        if self.days > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="history-retention")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


# ---- the node's history -------------------------------------------------------------------------------


def open_backend(cfg: NodeConfig) -> HistoryStore:
    """The configured backend, not started (the settings were checked by ``config.check_history``)."""
    try:
        return open_store(
            cfg.history_backend,
            cfg.history_url,
            retention_days=cfg.history_retention_days,
            max_items=cfg.history_memory_max_items,
            max_bytes=cfg.history_memory_max_bytes,
            migrations=cfg.history_migrations,
            pool_size=cfg.history_pool_size,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


@dataclass
class NodeHistory:
    """The node's history: ``store`` is what the routes use (routed in a mesh with an embedded backend),
    ``backend`` this node's own; ``tag`` its owner tag. ``start`` / ``close`` own all of it."""

    backend: HistoryStore
    store: HistoryStore
    tag: str
    router: RoutedStore | None
    retention: Retention | None
    link: MeshLink | None = None
    server: RpcServer | None = None  # the peers' history RPCs (a mesh): storage calls and cancels
    conversations_refused: str | None = None  # why the Conversations API refuses new ones (None: it does not)
    started_at: float = 0.0  # (time.monotonic() of ``start``)

    async def start(self) -> None:
        self.started_at = time.monotonic()
        await self.backend.start()
        if self.router is not None:
            self.router.install()
        elif self.link is not None and self.server is not None:
            self.link.set_rpc_handler(self.server.handle)
        if self.retention is not None:
            self.retention.start()

    async def close(self) -> None:
        if self.retention is not None:
            await self.retention.close()
        with contextlib.suppress(Exception):
            await self.backend.close()

    def set_cancel_handler(self, handler: CancelHandler | None) -> None:
        """The local ``BackgroundRegistry`` cancel, for the peers' "cancel" RPCs."""
        if self.server is not None:
            self.server.cancel_handler = handler

    def set_running_handler(self, handler: Callable[[str], bool] | None) -> None:
        """Whether a background response runs in this process, for the peers' "running" RPCs."""
        if self.server is not None:
            self.server.running_handler = handler

    async def runner_runs(self, tag: str, response_id: str, timeout: float = 2.0) -> bool | None:
        """Whether the alive node of owner ``tag`` runs background response ``response_id``: asked over
        the mesh; None when that cannot be told (no mesh, no alive member with the tag, no answer)."""
        link = self.link
        name = None if link is None else _member_of(link, tag)
        if link is None or name is None or link.member_status(name) != "alive":
            return None
        got = await ask_peer(link, name, _pack({"m": "running", "a": {"id": response_id}}), timeout)
        return got if isinstance(got, bool) else None

    def set_metrics_handler(self, handler: Callable[[], Awaitable[bytes]] | None) -> None:
        """This process's /metrics exposition, for the peers' "metrics" RPCs (``--procs N`` siblings)."""
        if self.server is not None:
            self.server.metrics_handler = handler

    async def peer_metrics(self, timeout: float) -> dict[str, bytes]:
        """Every other alive member's /metrics exposition by member name (those that answer in time)."""
        if self.link is None:
            return {}
        got = await ask_peers(self.link, "metrics", {}, timeout)
        return {n: r for n, r in got.items() if isinstance(r, bytes)}

    def node_gone(self, tag: str) -> bool:
        """Whether the node of owner ``tag`` is gone from the mesh: held dead or left, or no member has the
        tag (reaped long after it went); False without a mesh (nothing to tell)."""
        link = self.link
        if link is None:
            return False
        name = _member_of(link, tag)
        if name is not None:
            return link.member_status(name) in ("dead", "left", None)
        # no member has it: gone, once this node has been up long enough to know the members
        return time.monotonic() - self.started_at > MEMBERS_KNOWN_S

    async def cancel_elsewhere(self, response_id: str) -> bool:
        """Ask every other live member to cancel a background response it runs (True: one did)."""
        return False if self.link is None else await cancel_on_peers(self.link, response_id)

    def metrics(self) -> Iterable[Any]:
        """The store's counters as Prometheus families (``NodeMetrics.add_callback``)."""
        s = self.backend.stats
        name = self.backend.name
        yield counter(
            "smg_history_ops",
            "History store operations by kind (write, read, evicted, purged)",
            ["backend", "kind"],
            [([name, k], float(getattr(s, k))) for k in ("writes", "reads", "evicted", "purged")],
        )
        if self.router is not None:
            r = self.router
            yield counter(
                "smg_history_rpc",
                "History calls sent to the owner node (sent, failed) and served for peers (served, refused)",
                ["kind"],
                [
                    (["sent"], float(r.routed)),
                    (["failed"], float(r.routed_failed)),
                    (["served"], float(r.server.served)),
                    (["refused"], float(r.server.refused)),
                ],
            )


def build_history(
    cfg: NodeConfig, mesh: MeshLink | None = None, *, backend: HistoryStore | None = None
) -> NodeHistory:
    """The node's history from its configuration (no I/O: ``await start()``). ``backend``: use this one
    instead of opening the configured one (tests)."""
    base = backend if backend is not None else open_backend(cfg)
    base = tracing.traced_store(base)  # a span per storage call while tracing is on (else as it is)
    refused = None
    if mesh is not None and cfg.history_backend == "memory" and not cfg.history_allow_local:
        refused = (
            "Conversations are off on this mesh: its history backend is memory, which keeps a conversation "
            "only on the node that made it, lost when that node restarts. The operator may accept this "
            "with --history-allow-local, or use --history-backend sqlite, postgres or redis."
        )
        log.warning(
            "history: the memory backend in a mesh: conversations are refused (history_allow_local / "
            "--history-allow-local accepts them); responses stay on the node that made them, lost when it "
            "restarts (history_backend sqlite, postgres or redis keeps them)"
        )
    router = None
    store: HistoryStore = base
    server: RpcServer | None = None
    tag = node_tag(mesh.name if mesh is not None else cfg.mesh_name or default_node_name())
    if mesh is not None and not base.shared:
        router = RoutedStore(base, mesh, max_chain_depth=cfg.history_chain_max_depth)
        store = router
        server = router.server
    elif mesh is not None:
        server = RpcServer(base, tag, storage=False)
    retention = Retention(base, cfg.history_retention_days) if cfg.history_retention_days > 0 else None
    return NodeHistory(base, store, tag, router, retention, mesh, server, refused)


MAX_CANCEL_FANOUT = 256


async def ask_peers(
    link: MeshLink, method: str, args: dict[str, Any], timeout: float | None = None
) -> dict[str, Any]:
    """Call ``method`` (one the peers' ``RpcServer`` serves to any member: "cancel", "metrics") on every
    other alive member (at most ``MAX_CANCEL_FANOUT``, concurrently): each member's result by name;
    a member that does not answer, fails or answers something unreadable is left out."""
    names = [
        n
        for m in link.members()
        if isinstance(n := m.get("name"), str) and n != link.name and link.member_status(n) == "alive"
    ][:MAX_CANCEL_FANOUT]
    payload = _pack({"m": method, "a": args})

    async def one(name: str) -> tuple[str, Any]:
        return name, await ask_peer(link, name, payload, timeout)

    return {n: r for n, r in await asyncio.gather(*(one(n) for n in names)) if r is not None}


async def ask_peer(link: MeshLink, name: str, payload: bytes, timeout: float | None = None) -> Any:
    """One packed call to member ``name``: its answer (``"ok"``), None when it fails, does not answer in
    time or answers something unreadable."""
    try:
        reply = await unpack_async(await link.rpc(name, payload, timeout=timeout), REPLY_LIMITS)
    except Exception:  # RpcError, or a reply that does not decode
        return None
    return reply.get("ok") if isinstance(reply, dict) else None


def _member_of(link: MeshLink, tag: str) -> str | None:
    """The name of the member whose owner tag is ``tag`` (None: no member has it)."""
    for m in link.members():
        name = m.get("name")
        if isinstance(name, str) and node_tag(name) == tag:
            return name
    return None


async def cancel_on_peers(link: MeshLink, response_id: str, timeout: float | None = None) -> bool:
    """Send a "cancel" RPC for ``response_id`` to every other alive member; True when one of them was
    running it and cancelled it. Unreachable members count as "not running it": the caller then marks
    the stored record."""
    return any(r is True for r in (await ask_peers(link, "cancel", {"id": response_id}, timeout)).values())
