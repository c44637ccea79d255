"""The Redis backend: redis-py's asyncio client over a bounded connection pool (docs/DESIGN.md §12).

Layout under a key prefix (default ``shepherd:``), every hash field a JSON value:

* ``{p}response:{id}``, ``{p}item:{id}``, ``{p}conversation:{id}``: a hash per entity (an item's
  ``refs`` field counts the responses and conversations referring to it: at 0 it is removed; a
  conversation's ``seq`` field numbers its links);
* ``{p}conversation:{id}:items``: a ZSET of the conversation's items scored by the time they were
  added; members are ``<12-digit seq>:<item id>``, so items added at the same time list in insertion
  order; ``{p}conversation:{id}:links``: item id -> member;
* ``{p}index:responses``, ``{p}index:conversations``: ZSETs of ids by ``created_at``, for ``purge``;
* ``{p}record:{kind}``: a hash key -> bytes (the node's own records; never expire).

Every write is one Lua script (atomic: a failed check writes nothing). Retention: with
``retention_days`` > 0 each entity's keys expire that long after their last write (an item's whenever
a response or conversation refers to it again), and ``purge`` removes by ``created_at``. The script
builds keys from the prefix, so keys are not declared: a single Redis (or one replica set), not a
Redis Cluster. Connection errors and timeouts are ``StorageUnavailable``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.maint_notifications import MaintNotificationsConfig

from shepherd.storage.types import (
    ChainError,
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

DEFAULT_PREFIX = "shepherd:"
PURGE_BATCH = 500
_COUNTERS = (b"refs", b"seq")  # hash fields that are counters, not record fields

_LUA = r"""
local p, op, a = ARGV[1], ARGV[2], cjson.decode(ARGV[3])
local ttl = tonumber(a.ttl or 0)

local function fail(kind, msg) return redis.error_reply('SHEPHERD_' .. kind .. ' ' .. msg) end
local ENDED = {completed = true, failed = true, incomplete = true, cancelled = true}  -- TERMINAL_STATUSES
local function dup(what, id) return fail('INTEGRITY', what .. ' ' .. id .. ' is already stored') end
local function no_conv(conv) return fail('NOTFOUND', 'conversation ' .. conv .. ' not found') end
local function keep(k) if ttl > 0 then redis.call('EXPIRE', k, ttl) end end
local function hset(k, fields)
  local args = {}
  for f, v in pairs(fields) do args[#args + 1] = f; args[#args + 1] = v end
  if #args > 0 then redis.call('HSET', k, unpack(args)) end
end
local function field(k, f)
  local v = redis.call('HGET', k, f)
  if v then return cjson.decode(v) end
  return nil
end
local function ref(id)
  local k = p .. 'item:' .. id
  if redis.call('EXISTS', k) == 1 then redis.call('HINCRBY', k, 'refs', 1); keep(k) end
end
local function unref(id)
  local k = p .. 'item:' .. id
  if redis.call('EXISTS', k) == 1 and redis.call('HINCRBY', k, 'refs', -1) <= 0 then redis.call('DEL', k) end
end
local function unref_response(rk)
  for _, f in ipairs({'input_item_ids', 'output_item_ids'}) do
    for _, id in ipairs(field(rk, f) or {}) do unref(id) end
  end
end
local function check_new(items)
  local seen = {}
  for _, it in ipairs(items or {}) do
    if seen[it.id] or redis.call('EXISTS', p .. 'item:' .. it.id) == 1 then
      return 'item ' .. it.id .. ' is already stored'
    end
    seen[it.id] = true
  end
  return nil
end
local function add_items(items)
  for _, it in ipairs(items or {}) do
    local k = p .. 'item:' .. it.id
    hset(k, it.h); redis.call('HSET', k, 'refs', 0); keep(k)
  end
end
local function link(conv, items)
  local ck = p .. 'conversation:' .. conv
  for _, it in ipairs(items or {}) do
    local m = string.format('%012d', redis.call('HINCRBY', ck, 'seq', 1)) .. ':' .. it.id
    redis.call('ZADD', ck .. ':items', it.score, m)
    redis.call('HSET', ck .. ':links', it.id, m)
    ref(it.id)
  end
  keep(ck); keep(ck .. ':items'); keep(ck .. ':links')
end
local function conv_exists(conv) return redis.call('EXISTS', p .. 'conversation:' .. conv) == 1 end
local function drop_conversation(conv)
  local ck = p .. 'conversation:' .. conv
  redis.call('ZREM', p .. 'index:conversations', conv)
  if redis.call('EXISTS', ck) == 0 then return 0 end
  for _, id in ipairs(redis.call('HKEYS', ck .. ':links')) do unref(id) end
  redis.call('DEL', ck, ck .. ':items', ck .. ':links')
  return 1
end
local function drop_response(rid)
  local rk = p .. 'response:' .. rid
  redis.call('ZREM', p .. 'index:responses', rid)
  if redis.call('EXISTS', rk) == 0 then return 0 end
  unref_response(rk)
  redis.call('DEL', rk)
  return 1
end

if op == 'put_response' then
  local rk = p .. 'response:' .. a.rid
  if redis.call('EXISTS', rk) == 1 then return dup('response', a.rid) end
  if a.conv and not conv_exists(a.conv) then return no_conv(a.conv) end
  local bad = check_new(a.items)
  if bad then return fail('INTEGRITY', bad) end
  local new = {}
  for _, it in ipairs(a.items or {}) do new[it.id] = true end
  for _, id in ipairs(a.refs or {}) do
    if not new[id] and redis.call('EXISTS', p .. 'item:' .. id) == 0 then
      return fail('INTEGRITY', 'response ' .. a.rid .. ' refers to unknown item ' .. id)
    end
  end
  add_items(a.items)
  hset(rk, a.h); keep(rk)
  redis.call('ZADD', p .. 'index:responses', a.score, a.rid)
  for _, id in ipairs(a.refs or {}) do ref(id) end
  if a.conv then link(a.conv, a.items) end
  return 1
elseif op == 'update_response' then
  local rk = p .. 'response:' .. a.rid
  if redis.call('EXISTS', rk) == 0 then return fail('NOTFOUND', 'response ' .. a.rid .. ' not found') end
  if a.running_only then
    local st = redis.call('HGET', rk, 'status')
    if st and ENDED[cjson.decode(st)] then return 0 end
  end
  if a.conv and not conv_exists(a.conv) then return no_conv(a.conv) end
  local bad = check_new(a.items)
  if bad then return fail('INTEGRITY', bad) end
  add_items(a.items)
  for _, id in ipairs(a.refs or {}) do ref(id) end
  unref_response(rk)
  redis.call('DEL', rk); hset(rk, a.h); keep(rk)
  redis.call('ZADD', p .. 'index:responses', a.score, a.rid)
  if a.conv then link(a.conv, a.items) end
  return 1
elseif op == 'delete_response' then
  return drop_response(a.rid)
elseif op == 'chain' then
  local out, seen, n, rid = {'ok'}, {}, 0, a.rid
  while rid do
    local h = redis.call('HGETALL', p .. 'response:' .. rid)
    if #h == 0 then break end
    if seen[rid] then return fail('CHAIN', 'the chain of ' .. a.rid .. ' loops at ' .. rid) end
    if n >= a.max then return fail('CHAIN', 'the chain of ' .. a.rid .. ' is longer than ' .. a.max) end
    if n > 0 then  -- the newest whole, the others without their bodies (types.py, get_chain)
      local light = {}
      for i = 1, #h, 2 do
        if h[i] ~= 'body' then light[#light + 1] = h[i]; light[#light + 1] = h[i + 1] end
      end
      h = light
    end
    seen[rid] = true; n = n + 1; out[n + 1] = h
    rid = nil
    for i = 1, #h, 2 do if h[i] == 'previous_response_id' then rid = cjson.decode(h[i + 1]) end end
  end
  return out
elseif op == 'create_conversation' then
  local ck = p .. 'conversation:' .. a.conv
  if redis.call('EXISTS', ck) == 1 then return dup('conversation', a.conv) end
  local bad = check_new(a.items)
  if bad then return fail('INTEGRITY', bad) end
  add_items(a.items)
  hset(ck, a.h); redis.call('HSET', ck, 'seq', 0); keep(ck)
  redis.call('ZADD', p .. 'index:conversations', a.score, a.conv)
  link(a.conv, a.items)
  return 1
elseif op == 'update_conversation' then
  local ck = p .. 'conversation:' .. a.conv
  if redis.call('EXISTS', ck) == 0 then return {} end
  redis.call('HSET', ck, 'metadata', a.metadata)
  return redis.call('HGETALL', ck)
elseif op == 'delete_conversation' then
  return drop_conversation(a.conv)
elseif op == 'add_items' then
  if not conv_exists(a.conv) then return no_conv(a.conv) end
  local bad = check_new(a.items)
  if bad then return fail('INTEGRITY', bad) end
  add_items(a.items)
  link(a.conv, a.items)
  return 1
elseif op == 'list_items' then
  local ck = p .. 'conversation:' .. a.conv
  if redis.call('EXISTS', ck) == 0 then return no_conv(a.conv) end
  local asc, start = a.order == 'asc', 0
  if a.after then
    local m = redis.call('HGET', ck .. ':links', a.after)
    if not m then return fail('NOTFOUND', 'item ' .. a.after .. ' is not in conversation ' .. a.conv) end
    if asc then start = redis.call('ZRANK', ck .. ':items', m) + 1
    else start = redis.call('ZREVRANK', ck .. ':items', m) + 1 end
  end
  local ms
  if asc then ms = redis.call('ZRANGE', ck .. ':items', start, start + a.limit)
  else ms = redis.call('ZREVRANGE', ck .. ':items', start, start + a.limit) end
  local out = {#ms > a.limit and 1 or 0}
  for i = 1, math.min(#ms, a.limit) do
    out[#out + 1] = redis.call('HGETALL', p .. 'item:' .. string.sub(ms[i], 14))
  end
  return out
elseif op == 'get_item' then
  local ck = p .. 'conversation:' .. a.conv
  if not redis.call('HGET', ck .. ':links', a.item) then return {} end
  return redis.call('HGETALL', p .. 'item:' .. a.item)
elseif op == 'delete_item' then
  local ck = p .. 'conversation:' .. a.conv
  local m = redis.call('HGET', ck .. ':links', a.item)
  if not m then return 0 end
  redis.call('ZREM', ck .. ':items', m)
  redis.call('HDEL', ck .. ':links', a.item)
  unref(a.item)
  return 1
elseif op == 'purge' then
  local n, more = 0, 0
  for _, kind in ipairs({'responses', 'conversations'}) do
    local ik = p .. 'index:' .. kind
    local ids = redis.call('ZRANGEBYSCORE', ik, '-inf', '(' .. a.before, 'LIMIT', 0, a.batch)
    if #ids >= a.batch then more = 1 end
    for _, id in ipairs(ids) do
      if kind == 'responses' then n = n + drop_response(id) else n = n + drop_conversation(id) end
    end
  end
  return {n, more}
elseif op == 'claim' then
  local k = p .. 'lease:' .. a.name
  local held = redis.call('HMGET', k, 'holder', 'till')
  if held[1] and held[1] ~= a.holder and tonumber(held[2]) >= a.now then return 0 end
  redis.call('HSET', k, 'holder', a.holder, 'till', string.format('%.6f', a.till))
  redis.call('PEXPIRE', k, math.max(1, math.ceil((a.till - a.now) * 1000)) + 1000)  -- (the caller's clock)
  return 1
elseif op == 'release' then
  local k = p .. 'lease:' .. a.name
  if redis.call('HGET', k, 'holder') ~= a.holder then return 0 end
  redis.call('DEL', k)
  return 1
end
return fail('BADOP', op)
"""


def _hash(d: dict[str, Any]) -> dict[str, str]:
    """A record's fields as hash fields: JSON values, ``None`` left out."""
    return {k: orjson.dumps(v).decode() for k, v in d.items() if v is not None}


def _record(h: Any) -> dict[str, Any]:
    """HGETALL's answer (a dict, or the flat list a script returns) as the record's fields."""
    pairs = h.items() if isinstance(h, dict) else zip(h[::2], h[1::2], strict=True)
    return {bytes(k).decode(): orjson.loads(v) for k, v in pairs if bytes(k) not in _COUNTERS}


def _items_payload(items: Sequence[StoredItem]) -> list[dict[str, Any]]:
    return [{"id": it.id, "h": _hash(it.to_dict()), "score": repr(it.created_at)} for it in items]


class RedisStore:
    name = "redis"
    shared = True

    def __init__(
        self,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        retention_days: float = 0.0,
        pool_size: int = 8,
        timeout: float = 5.0,
    ) -> None:
        if pool_size < 1:
            raise ValueError("pool_size must be >= 1")
        self.url = url
        self.prefix = prefix
        self.ttl = math.ceil(retention_days * 86400) if retention_days > 0 else 0
        self.pool_size = pool_size
        self.timeout = timeout
        self.stats = StoreStats()
        self._redis: aioredis.Redis | None = None
        self._lua: AsyncScript | None = None

    async def start(self) -> None:
        if self._redis is not None:
            return
        pool = aioredis.BlockingConnectionPool.from_url(
            self.url,
            max_connections=self.pool_size,
            timeout=self.timeout,
            socket_timeout=self.timeout,
            socket_connect_timeout=self.timeout,
            retry=Retry(NoBackoff(), 0),
            # off: redis-py's "auto" skips the pool's check of an idle connection the server closed
            # (a Redis restarted, its idle timeout), so each one would fail its next command
            maint_notifications_config=MaintNotificationsConfig(enabled=False),
        )
        r = aioredis.Redis(connection_pool=pool)
        self._redis = r
        self._lua = r.register_script(_LUA)
        try:
            await self._do(r.ping())
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        r, self._redis = self._redis, None
        if r is not None:
            await r.aclose()
            await r.connection_pool.disconnect()

    # ---- plumbing ---------------------------------------------------------------------------------------

    def _r(self) -> aioredis.Redis:
        if self._redis is None:
            raise StorageUnavailable("the Redis store is not started")
        return self._redis

    async def _do(self, aw: Any) -> Any:
        try:
            return await aw
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            raise StorageUnavailable(f"Redis unavailable: {type(e).__name__}: {e}") from e
        except ResponseError as e:
            msg = str(e)
            for tag, cls in (("INTEGRITY", IntegrityError), ("NOTFOUND", NotFound), ("CHAIN", ChainError)):
                if f"SHEPHERD_{tag} " in msg:
                    raise cls(msg.split(f"SHEPHERD_{tag} ", 1)[1].split(" script:")[0]) from e
            raise StorageError(f"Redis: {msg}") from e
        except RedisError as e:
            raise StorageError(f"Redis: {type(e).__name__}: {e}") from e

    async def _script(self, op: str, args: dict[str, Any]) -> Any:
        args["ttl"] = self.ttl
        payload = orjson.dumps(args).decode()
        self._r()
        assert self._lua is not None
        return await self._do(self._lua(keys=[], args=[self.prefix, op, payload]))

    async def _write(self, op: str, args: dict[str, Any]) -> Any:
        out = await self._script(op, args)
        self.stats.writes += 1
        return out

    def _key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    # ---- responses --------------------------------------------------------------------------------------

    def _response_args(self, response: StoredResponse, items: Sequence[StoredItem]) -> dict[str, Any]:
        return {
            "rid": response.id,
            "h": _hash(response.to_dict()),
            "score": repr(response.created_at),
            "refs": [*response.input_item_ids, *response.output_item_ids],
            "items": _items_payload(items),
        }

    async def put_response(
        self, response: StoredResponse, items: Sequence[StoredItem], conversation_id: str | None = None
    ) -> None:
        args = self._response_args(response, items)
        if conversation_id is not None:
            args["conv"] = conversation_id
        await self._write("put_response", args)

    async def update_response(
        self, response: StoredResponse, items: Sequence[StoredItem] = (), *, running_only: bool = False
    ) -> bool:
        args = self._response_args(response, items)
        if response.conversation_id is not None and items:
            args["conv"] = response.conversation_id
        if running_only:
            args["running_only"] = True
        return bool(await self._write("update_response", args))

    async def get_response(self, response_id: str) -> StoredResponse | None:
        self.stats.reads += 1
        h = await self._do(self._r().hgetall(self._key("response", response_id)))
        return StoredResponse.from_dict(_record(h)) if h else None

    async def delete_response(self, response_id: str) -> bool:
        return bool(await self._write("delete_response", {"rid": response_id}))

    async def get_chain(self, response_id: str, max_depth: int) -> list[StoredResponse]:
        self.stats.reads += 1
        out = await self._script("chain", {"rid": response_id, "max": max_depth})
        chain = [StoredResponse.from_dict(_record(h)) for h in out[1:]]
        chain.reverse()
        return chain

    async def get_items(self, item_ids: Sequence[str]) -> list[StoredItem]:
        self.stats.reads += 1
        if not item_ids:
            return []
        async with self._r().pipeline(transaction=False) as pipe:
            for i in item_ids:
                pipe.hgetall(self._key("item", i))
            got = await self._do(pipe.execute())
        return [StoredItem.from_dict(_record(h)) for h in got if h]

    # ---- conversations ----------------------------------------------------------------------------------

    async def create_conversation(
        self, conversation: StoredConversation, items: Sequence[StoredItem] = ()
    ) -> None:
        await self._write(
            "create_conversation",
            {
                "conv": conversation.id,
                "h": _hash(conversation.to_dict()),
                "score": repr(conversation.created_at),
                "items": _items_payload(items),
            },
        )

    async def get_conversation(self, conversation_id: str) -> StoredConversation | None:
        self.stats.reads += 1
        h = await self._do(self._r().hgetall(self._key("conversation", conversation_id)))
        return StoredConversation.from_dict(_record(h)) if h else None

    async def update_conversation(
        self, conversation_id: str, metadata: dict[str, str]
    ) -> StoredConversation | None:
        h = await self._write(
            "update_conversation",
            {"conv": conversation_id, "metadata": orjson.dumps(dict(metadata)).decode()},
        )
        return StoredConversation.from_dict(_record(h)) if h else None

    async def delete_conversation(self, conversation_id: str) -> bool:
        return bool(await self._write("delete_conversation", {"conv": conversation_id}))

    async def add_items(self, conversation_id: str, items: Sequence[StoredItem]) -> None:
        await self._write("add_items", {"conv": conversation_id, "items": _items_payload(items)})

    async def list_items(
        self, conversation_id: str, *, after: str | None = None, limit: int = 20, order: Order = "asc"
    ) -> ItemPage:
        self.stats.reads += 1
        args: dict[str, Any] = {"conv": conversation_id, "limit": max(limit, 0), "order": order}
        if after is not None:
            args["after"] = after
        out = await self._script("list_items", args)
        return ItemPage([StoredItem.from_dict(_record(h)) for h in out[1:]], bool(out[0]))

    async def get_item(self, conversation_id: str, item_id: str) -> StoredItem | None:
        self.stats.reads += 1
        h = await self._script("get_item", {"conv": conversation_id, "item": item_id})
        return StoredItem.from_dict(_record(h)) if h else None

    async def delete_item(self, conversation_id: str, item_id: str) -> bool:
        return bool(await self._write("delete_item", {"conv": conversation_id, "item": item_id}))

    # ---- node records -----------------------------------------------------------------------------------

    async def put_record(self, kind: str, key: str, value: bytes) -> None:
        await self._do(self._r().hset(self._key("record", kind), key, bytes(value)))
        self.stats.writes += 1

    async def get_record(self, kind: str, key: str) -> bytes | None:
        v = await self._do(self._r().hget(self._key("record", kind), key))
        return None if v is None else bytes(v)

    async def delete_record(self, kind: str, key: str) -> bool:
        return bool(await self._do(self._r().hdel(self._key("record", kind), key)))

    async def list_records(self, kind: str) -> list[tuple[str, bytes]]:
        h = await self._do(self._r().hgetall(self._key("record", kind)))
        return sorted((bytes(k).decode(), bytes(v)) for k, v in h.items())

    # ---- leases -----------------------------------------------------------------------------------------

    async def claim(self, name: str, holder: str, until: float, now: float) -> bool:
        return bool(await self._script("claim", {"name": name, "holder": holder, "till": until, "now": now}))

    async def release(self, name: str, holder: str) -> bool:
        return bool(await self._script("release", {"name": name, "holder": holder}))

    # ---- retention --------------------------------------------------------------------------------------

    async def purge(self, older_than: float) -> int:
        total = 0
        while True:  # bounded: each batch removes its ids from the indexes
            n, more = await self._script("purge", {"before": repr(older_than), "batch": PURGE_BATCH})
            total += int(n)
            if not more:
                break
        self.stats.purged += total
        return total
