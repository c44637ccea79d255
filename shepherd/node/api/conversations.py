"""The Conversations API, as OpenAI's (docs/DESIGN.md §12):

- ``POST /v1/conversations`` ``{items?: [up to 20 input items], metadata?}`` -> the conversation
  ``{id: "conv_...", object: "conversation", created_at, metadata}``;
- ``GET`` / ``POST`` (``{metadata}``: replaces it) / ``DELETE`` ``/v1/conversations/{id}`` (delete ->
  ``{id, object: "conversation.deleted", deleted: true}``);
- ``POST /v1/conversations/{id}/items`` ``{items: [1-20 items]}`` -> ``{object: "list", data, first_id,
  last_id, has_more}``; ``GET`` the same list, paged: ``after`` (an item id), ``limit`` (1-100, default
  20), ``order`` (``asc`` | ``desc``, default ``desc``); ``include`` is accepted and ignored;
- ``GET`` / ``DELETE`` ``/v1/conversations/{id}/items/{item_id}`` (delete -> the conversation).

Items are parsed by ``shepherd.node.openai.items.parse_items`` (the Responses input items: message,
function_call, function_call_output, reasoning) and keep the client's ids when given; fresh ids carry
the conversation owner's tag. Metadata is bounded as OpenAI's: 16 pairs, keys of at most 64 characters,
values of at most 512.

Ownership (auth on): the principal that created a conversation owns it; any other caller but an admin
is told 404, as if it did not exist. Errors are OpenAI's envelope: an unknown id is a 404, a malformed
one (or any malformed field) a 400 naming the parameter; the store's unavailability (an owner node
suspected or unreachable) a 503 with Retry-After; an owner node gone from the mesh a 404 saying so.
"""

from __future__ import annotations

import re
import time
from typing import Any

from aiohttp import web

from shepherd.node.api.common import (
    GATEWAY,
    REASONING_SEAL,
    History,
    history_errors,
    history_of,
    item_list,
    may_read,
    owner_of,
)
from shepherd.node.cluster.history import OwnerGone
from shepherd.node.http.body import json_response, read_json
from shepherd.node.openai.items import parse_items
from shepherd.node.openai.requests import parse_metadata, shown_id
from shepherd.proto.openai_errors import ApiError, bad
from shepherd.storage.ids import tag_of
from shepherd.storage.types import NotFound, StoredConversation, StoredItem

MAX_ITEMS_PER_CALL = 20
MAX_LIMIT = 100
DEFAULT_LIMIT = 20
_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")

# ---- the store and validation -------------------------------------------------------------------------

# the store's errors as API errors (404 / 400 / 503 with Retry-After, rounded to the nearest second)
storage_errors = history_errors("conversation", round)


def _history(request: web.Request) -> History:
    return history_of(request, "conversation")


def _conv_id(request: web.Request) -> str:
    cid = request.match_info["conversation_id"]
    if not cid.startswith("conv_") or not _ID_RE.match(cid):
        raise bad(
            f"Invalid 'conversation_id': {cid[:80]!r}. Expected an ID that begins with 'conv'.",
            param="conversation_id",
            code="invalid_value",
        )
    return cid


def _item_id(request: web.Request) -> str:
    iid = request.match_info["item_id"]
    if not _ID_RE.match(iid):
        raise bad(f"Invalid 'item_id': {iid[:80]!r}.", param="item_id", code="invalid_value")
    return iid


def _known(d: dict[str, Any], allowed: tuple[str, ...]) -> None:
    for k in d:
        if k not in allowed:
            raise bad(f"Unknown parameter: '{k[:80]}'.", param=k[:80], code="unknown_parameter")


def _parse(
    request: web.Request, raw: Any, history: History, owner_tag: str | None, now: float, required: bool
) -> list[StoredItem]:
    if raw is None and not required:
        return []
    if not isinstance(raw, list):
        raise bad("'items' must be a list of items.", param="items", code="invalid_type")
    if required and not raw:
        raise bad("'items' must hold at least one item.", param="items", code="array_below_min_length")
    if len(raw) > MAX_ITEMS_PER_CALL:
        raise bad(
            f"'items' has {len(raw)} items: you may add up to {MAX_ITEMS_PER_CALL} at a time.",
            param="items",
            code="array_above_max_length",
        )
    items = parse_items(
        raw,
        param="items",
        new_id=lambda prefix: history.new_id(prefix, owner_tag=owner_tag),
        now=now,
        unseal=request.app[REASONING_SEAL].open,  # (a reasoning item's blob of this mesh: its text)
    )
    for i, it in enumerate(items):
        if it.type == "item_reference":
            raise bad(
                f"'items[{i}]': an item_reference cannot be added to a conversation; add the item itself.",
                param=f"items[{i}]",
                code="invalid_value",
            )
    ids = [it.id for it in items]
    if len(set(ids)) != len(ids):
        raise bad("'items' holds two items with the same id.", param="items", code="invalid_value")
    return items


def conversation_object(c: StoredConversation) -> dict[str, Any]:
    return {"id": c.id, "object": "conversation", "created_at": int(c.created_at), "metadata": c.metadata}


def _not_found(cid: str) -> ApiError:
    return ApiError(404, f"Conversation with id '{shown_id(cid)}' not found.", code="not_found")


def _item_not_found(cid: str, iid: str) -> ApiError:
    return ApiError(
        404, f"Item with id '{shown_id(iid)}' not found in conversation '{shown_id(cid)}'.", code="not_found"
    )


async def _load(request: web.Request, history: History, cid: str) -> StoredConversation:
    c = await history.store.get_conversation(cid)
    if c is None or not may_read(request, c.owner):
        raise _not_found(cid)
    return c


async def _body(request: web.Request) -> dict[str, Any]:
    _, d = await read_json(request, request.app[GATEWAY].cfg.max_body_bytes)
    return d


# ---- handlers -----------------------------------------------------------------------------------------


@storage_errors
async def create(request: web.Request) -> web.StreamResponse:
    history = _history(request)
    if history.conversations_refused is not None:
        raise ApiError(400, history.conversations_refused, param=None, code="conversations_disabled")
    d = await _body(request)
    _known(d, ("items", "metadata"))
    metadata = parse_metadata(d.get("metadata"))
    now = time.time()
    items = _parse(request, d.get("items"), history, None, now, required=False)
    conv = StoredConversation(history.new_id("conv"), now, metadata, owner_of(request))
    await history.store.create_conversation(conv, items)
    return json_response(conversation_object(conv))


@storage_errors
async def retrieve(request: web.Request) -> web.StreamResponse:
    history = _history(request)
    return json_response(conversation_object(await _load(request, history, _conv_id(request))))


@storage_errors
async def update(request: web.Request) -> web.StreamResponse:
    history = _history(request)
    cid = _conv_id(request)
    d = await _body(request)
    _known(d, ("metadata",))
    if "metadata" not in d:
        raise bad(
            "Missing required parameter: 'metadata'.", param="metadata", code="missing_required_parameter"
        )
    metadata = parse_metadata(d["metadata"])
    await _load(request, history, cid)
    c = await history.store.update_conversation(cid, metadata)
    if c is None:
        raise _not_found(cid)
    return json_response(conversation_object(c))


@storage_errors
async def delete(request: web.Request) -> web.StreamResponse:
    history = _history(request)
    cid = _conv_id(request)
    await _load(request, history, cid)
    if not await history.store.delete_conversation(cid):
        raise _not_found(cid)
    return json_response({"id": cid, "object": "conversation.deleted", "deleted": True})


@storage_errors
async def add_items(request: web.Request) -> web.StreamResponse:
    history = _history(request)
    cid = _conv_id(request)
    d = await _body(request)
    _known(d, ("items", "include"))
    if "items" not in d:
        raise bad("Missing required parameter: 'items'.", param="items", code="missing_required_parameter")
    now = time.time()
    items = _parse(request, d["items"], history, tag_of(cid), now, required=True)
    await _load(request, history, cid)
    await history.store.add_items(cid, items)
    return json_response(item_list(items, False))


def _limit(request: web.Request) -> int:
    raw = request.query.get("limit")
    if raw is None:
        return DEFAULT_LIMIT
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise bad(
            f"Invalid 'limit': {raw[:40]!r}. It must be an integer between 1 and {MAX_LIMIT}.",
            param="limit",
            code="invalid_value",
        )
    return limit


@storage_errors
async def list_items(request: web.Request) -> web.StreamResponse:
    history = _history(request)
    cid = _conv_id(request)
    limit = _limit(request)
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad(
            f"Invalid 'order': {order[:40]!r}. Use 'asc' or 'desc'.", param="order", code="invalid_value"
        )
    after = request.query.get("after") or None
    if after is not None and not _ID_RE.match(after):
        raise bad(f"Invalid 'after': {after[:80]!r}.", param="after", code="invalid_value")
    await _load(request, history, cid)
    try:
        page = await history.store.list_items(
            cid, after=after, limit=limit, order="asc" if order == "asc" else "desc"
        )
    except OwnerGone:
        raise
    except NotFound:
        raise bad(
            f"Invalid 'after': no item with id '{after}' in this conversation.", param="after"
        ) from None
    return json_response(item_list(page.items, page.has_more))


@storage_errors
async def get_item(request: web.Request) -> web.StreamResponse:
    history = _history(request)
    cid, iid = _conv_id(request), _item_id(request)
    await _load(request, history, cid)
    it = await history.store.get_item(cid, iid)
    if it is None:
        raise _item_not_found(cid, iid)
    return json_response(it.data)


@storage_errors
async def delete_item(request: web.Request) -> web.StreamResponse:
    history = _history(request)
    cid, iid = _conv_id(request), _item_id(request)
    c = await _load(request, history, cid)
    if not await history.store.delete_item(cid, iid):
        raise _item_not_found(cid, iid)
    return json_response(conversation_object(c))


def routes() -> list[web.RouteDef]:
    return [
        web.post("/v1/conversations", create),
        web.get("/v1/conversations/{conversation_id}", retrieve),
        web.post("/v1/conversations/{conversation_id}", update),
        web.delete("/v1/conversations/{conversation_id}", delete),
        web.post("/v1/conversations/{conversation_id}/items", add_items),
        web.get("/v1/conversations/{conversation_id}/items", list_items),
        web.get("/v1/conversations/{conversation_id}/items/{item_id}", get_item),
        web.delete("/v1/conversations/{conversation_id}/items/{item_id}", delete_item),
    ]
