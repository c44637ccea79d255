"""The mock engine's HTTP surface (aiohttp): what ``vllm serve`` / SGLang expose to OpenAI clients,
plus the ``/mock/*`` control endpoints. It shares the engine core (scheduler, cache, faults) with the
gRPC services, and is the "direct-to-engine" reference of the benchmarks, so the hot path is lean:
orjson, chunk bytes assembled from pre-built pieces, and in zero-latency mode up to 64 SSE chunks per
write.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /v1/loads; POST|DELETE|GET /mock/responses, POST|GET /mock/faults, GET|DELETE /mock/stats,
POST /mock/flush_cache. Request parameters and stop strings: ``http_params``; rerank, score and
classify: ``http_pooling``; POST /v1/embeddings: ``http_embeddings``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import orjson
from aiohttp import web
from tokenizers.decoders import DecodeStream

from shepherd.mock_engine.engine import EngineCore, Run, TokenizerLike
from shepherd.mock_engine.http_embeddings import EmbeddingsRoute
from shepherd.mock_engine.http_params import (
    HttpError,
    Params,
    StopText,
    error_response,
    json_body,
    json_object,
    json_response,
    parse_params,
)
from shepherd.mock_engine.http_pooling import PoolingRoutes
from shepherd.mock_engine.requests import MockRequest, MockRpcError
from shepherd.proto.engine_types import EngineChunk, EngineComplete, TokenLogprob

MAX_BODY = 32 * 1024 * 1024
WRITE_BATCH = 64  # SSE chunks per write in zero-latency mode
HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 429,
    "INTERNAL": 500,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
DONE = b"data: [DONE]\n\n"


class ChatTokenizer(TokenizerLike, Protocol):
    """The rest of ``shepherd.tokens.tokenizer.Tokenizer`` the HTTP surface uses."""

    @property
    def hf(self) -> Any: ...

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str: ...


# ---- the app ----------------------------------------------------------------------------------------


class MockHttpApi:
    def __init__(self, core: EngineCore, tokenizer: ChatTokenizer) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.model = core.config.model
        self._ids = itertools.count(1)
        self._created = int(time.time())
        self._model_json = orjson.dumps(self.model)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        r = app.router
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_post("/v1/completions", self.completions)
        r.add_get("/v1/models", self.models)
        r.add_get("/health", self.health)
        r.add_get("/v1/loads", self.loads)
        r.add_post("/mock/responses", self.add_responses)
        r.add_delete("/mock/responses", self.clear_responses)
        r.add_get("/mock/responses", self.list_responses)
        r.add_post("/mock/faults", self.set_faults)
        r.add_get("/mock/faults", self.get_faults)
        r.add_get("/mock/stats", self.get_stats)
        r.add_delete("/mock/stats", self.reset_stats)
        r.add_post("/mock/flush_cache", self.flush_cache)
        r.add_get("/mock/pd/rooms/{room}", self.pd_room)  # a prefill-role engine's bootstrap lookups
        r.add_get("/mock/pd/requests/{request_id}", self.pd_request)
        EmbeddingsRoute(self.core.config, self.tokenizer, self.core.stats).add_to(r)  # /v1/embeddings
        PoolingRoutes(self.model, self.tokenizer, self.core.stats).add_to(r)  # rerank, score, classify
        return app

    # ---- simple endpoints -----------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        cfg = self.core.config
        return json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model,
                        "object": "model",
                        "created": self._created,
                        "owned_by": "shepherd-mock",
                        "root": self.model,
                        "max_model_len": cfg.context_length,
                    }
                ],
            }
        )

    async def loads(self, request: web.Request) -> web.Response:
        load = self.core.loads()
        entry = {
            "dp_rank": 0,
            "num_running_reqs": load.running,
            "num_waiting_reqs": load.waiting,
            "num_total_reqs": load.running + load.waiting,
            "num_used_tokens": load.used_tokens,
            "max_total_num_tokens": load.max_total_tokens,
            "token_usage": load.token_usage,
            "gen_throughput": load.gen_throughput,
            "cache_hit_rate": load.cache_hit_rate,
            "utilization": load.utilization,
            "max_running_requests": load.max_running,
            "num_waiting_uncached_tokens": load.waiting_uncached_tokens,
        }
        return json_response(
            {
                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "version": "mock",
                "dp_rank_count": 1,
                "loads": [entry],
                "aggregate": {
                    "total_running_reqs": load.running,
                    "total_waiting_reqs": load.waiting,
                    "total_reqs": load.running + load.waiting,
                    "avg_token_usage": load.token_usage,
                    "avg_throughput": load.gen_throughput,
                    "avg_utilization": load.utilization,
                },
            }
        )

    # ---- control ----------------------------------------------------------------------------------

    async def add_responses(self, request: web.Request) -> web.Response:
        try:
            body = json_body(await request.read())
            entries = body if isinstance(body, list) else [body]
            for entry in entries:
                if not isinstance(entry, dict) or not isinstance(entry.get("text"), str):
                    raise HttpError(400, "each response needs a string 'text'", "invalid_type", "text")
                match = entry.get("match") or ""
                times = entry.get("times", 1)
                finish = entry.get("finish_reason")
                if not isinstance(match, str) or not isinstance(times, int) or times < 1:
                    raise HttpError(
                        400, "'match' must be a string and 'times' an integer >= 1", "invalid_value"
                    )
                try:
                    self.core.add_script(entry["text"], match=match, times=times, finish_reason=finish)
                except ValueError as e:
                    raise HttpError(400, str(e), "invalid_value") from e
        except HttpError as e:
            return error_response(e.status, e.message, e.code, e.param)
        return json_response({"pending": self.core.scripts.snapshot()})

    async def clear_responses(self, request: web.Request) -> web.Response:
        self.core.scripts.clear()
        return json_response({"pending": []})

    async def list_responses(self, request: web.Request) -> web.Response:
        return json_response({"pending": self.core.scripts.snapshot()})

    async def set_faults(self, request: web.Request) -> web.Response:
        try:
            body = json_body(await request.read())
            if not isinstance(body, dict):
                raise HttpError(400, "faults must be a JSON object", "invalid_type")
            try:
                faults = self.core.injector.faults.updated(body)
            except (ValueError, TypeError) as e:
                raise HttpError(400, str(e), "invalid_value") from e
        except HttpError as e:
            return error_response(e.status, e.message, e.code, e.param)
        self.core.set_faults(faults)
        return json_response(faults.to_json())

    async def get_faults(self, request: web.Request) -> web.Response:
        return json_response(self.core.injector.faults.to_json())

    async def pd_room(self, request: web.Request) -> web.Response:
        try:
            rec = self.core.prefills.room(int(request.match_info["room"]))
        except ValueError:
            rec = None
        if rec is None:
            return json_response({"error": "unknown bootstrap room"}, status=404)
        return json_response(rec.to_json())

    async def pd_request(self, request: web.Request) -> web.Response:
        rec = self.core.prefills.request(request.match_info["request_id"])
        if rec is None:
            return json_response({"error": "unknown request"}, status=404)
        return json_response(rec.to_json())

    async def get_stats(self, request: web.Request) -> web.Response:
        return json_response(self.core.stats_json())

    async def reset_stats(self, request: web.Request) -> web.Response:
        self.core.stats.reset()
        return json_response(self.core.stats_json())

    async def flush_cache(self, request: web.Request) -> web.Response:
        ok = self.core.flush_cache()
        return json_response({"success": ok}, status=200 if ok else 409)

    # ---- generation -----------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        self.core.stats.count_rpc("http.chat_completions")
        try:
            body = json_object(await request.read(), self.model)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise HttpError(400, "messages must be a non-empty list", "invalid_type", "messages")
            params = parse_params(body, chat=True)
            tools = body.get("tools")
            kwargs = body.get("chat_template_kwargs")
            try:
                text = self.tokenizer.render_chat(
                    messages,
                    tools=tools if isinstance(tools, list) and tools else None,
                    add_generation_prompt=True,
                    template_kwargs=kwargs if isinstance(kwargs, dict) else None,
                )
            except Exception as e:  # a template error is the client's (bad roles, content...)
                raise HttpError(400, f"chat template: {e}", "invalid_value", "messages") from e
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        except HttpError as e:
            return error_response(e.status, e.message, e.code, e.param)
        rid = request.headers.get("x-request-id") or f"chatcmpl-mock-{next(self._ids)}"
        self.core.stats.record_trace(rid, request.headers)  # traceparent, if sent
        return await self._generate(request, rid, [(tuple(ids), text)], params, chat=True, echo=False)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.core.stats.count_rpc("http.completions")
        try:
            body = json_object(await request.read(), self.model)
            params = parse_params(body, chat=False)
            prompts = self._prompts(body.get("prompt"))
        except HttpError as e:
            return error_response(e.status, e.message, e.code, e.param)
        rid = request.headers.get("x-request-id") or f"cmpl-mock-{next(self._ids)}"
        self.core.stats.record_trace(rid, request.headers)  # traceparent, if sent
        return await self._generate(
            request, rid, prompts, params, chat=False, echo=bool(body.get("echo", False))
        )

    def _prompts(self, prompt: Any) -> list[tuple[tuple[int, ...], str]]:
        tok = self.tokenizer
        if isinstance(prompt, str):
            return [(tuple(tok.encode(prompt)), prompt)]
        if isinstance(prompt, list) and prompt:
            kinds = set(map(type, prompt))  # C-speed type check (orjson gives exact int/str/list)
            if kinds == {int}:
                return [(tuple(prompt), "")]
            if kinds == {str}:
                return [(tuple(tok.encode(p)), p) for p in prompt]
            if kinds == {list} and all(set(map(type, p)) == {int} for p in prompt):
                return [(tuple(p), "") for p in prompt]
        raise HttpError(
            400, "prompt must be a string, a list of strings or token ids", "invalid_type", "prompt"
        )

    async def _generate(
        self,
        request: web.Request,
        rid: str,
        prompts: list[tuple[tuple[int, ...], str]],
        params: Params,
        *,
        chat: bool,
        echo: bool,
    ) -> web.StreamResponse:
        core = self.core
        stats = core.stats
        stats.last_request_kind = "http"
        runs: list[Run] = []
        try:
            for i, (ids, text) in enumerate(prompts):
                req = MockRequest(
                    request_id=rid if len(prompts) == 1 else f"{rid}-{i}",
                    prompt=ids,
                    spec=params.spec,
                    n=params.n,
                    stream=params.stream,
                    logprobs=params.logprobs,
                    top_logprobs=params.top_logprobs,
                    prompt_text=text,
                )
                runs.append(core.start(req))
        except MockRpcError as e:
            for run in runs:
                run.close()
            status = HTTP_STATUS.get(e.code, 500)
            return error_response(status, e.message, e.code.lower())
        try:
            if params.stream:
                return await self._stream(request, rid, runs, prompts, params, chat=chat, echo=echo)
            return await self._whole(rid, runs, prompts, params, chat=chat, echo=echo)
        finally:
            for run in runs:
                run.close()

    async def _whole(
        self,
        rid: str,
        runs: list[Run],
        prompts: list[tuple[tuple[int, ...], str]],
        params: Params,
        *,
        chat: bool,
        echo: bool,
    ) -> web.Response:
        tok = self.tokenizer
        choices: list[dict[str, Any]] = []
        prompt_tokens = completion_tokens = cached_tokens = 0
        for p, run in enumerate(runs):
            async for ev in run.events():
                if not isinstance(ev, EngineComplete):
                    continue
                ids = list(ev.output_ids)
                finish = ev.finish_reason
                text = tok.decode(ids)
                if params.stops:
                    st = StopText(params.stops, params.include_stop_str)
                    cut = st.feed(text)
                    if st.stopped:
                        text, finish = cut, "stop"
                if echo:
                    text = prompts[p][1] + text
                index = p * params.n + ev.index
                lp = self._logprobs_json(ev.logprobs, chat) if params.logprobs else None
                if chat:
                    choices.append(
                        {
                            "index": index,
                            "message": {"role": "assistant", "content": text},
                            "logprobs": lp,
                            "finish_reason": finish,
                        }
                    )
                else:
                    choices.append({"index": index, "text": text, "logprobs": lp, "finish_reason": finish})
                completion_tokens += ev.completion_tokens
                if ev.index == 0:
                    prompt_tokens += ev.prompt_tokens
                    cached_tokens += ev.cached_tokens
        choices.sort(key=lambda c: int(c["index"]))
        return json_response(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.model,
                "choices": choices,
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                    "prompt_tokens_details": {"cached_tokens": cached_tokens},
                },
            }
        )

    def _logprobs_json(self, lps: Sequence[TokenLogprob], chat: bool) -> dict[str, Any]:
        tok = self.tokenizer
        if chat:
            return {
                "content": [
                    {
                        "token": tok.decode([lp.token_id], skip_special_tokens=False),
                        "logprob": lp.logprob,
                        "bytes": None,
                        "top_logprobs": [
                            {"token": tok.decode([t], skip_special_tokens=False), "logprob": v, "bytes": None}
                            for t, v in lp.top
                        ],
                    }
                    for lp in lps
                ]
            }
        return {
            "tokens": [tok.decode([lp.token_id], skip_special_tokens=False) for lp in lps],
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [
                {tok.decode([t], skip_special_tokens=False): v for t, v in lp.top} if lp.top else None
                for lp in lps
            ],
            "text_offset": [],
        }

    async def _stream(
        self,
        request: web.Request,
        rid: str,
        runs: list[Run],
        prompts: list[tuple[tuple[int, ...], str]],
        params: Params,
        *,
        chat: bool,
        echo: bool,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
        await resp.prepare(request)
        hf = self.tokenizer.hf
        created = int(time.time())
        head = orjson.dumps(rid)
        if chat:
            prefix = (
                b'data: {"id":'
                + head
                + b',"object":"chat.completion.chunk","created":'
                + str(created).encode()
                + b',"model":'
                + self._model_json
                + b',"choices":[{"index":'
            )
        else:
            prefix = (
                b'data: {"id":'
                + head
                + b',"object":"text_completion","created":'
                + str(created).encode()
                + b',"model":'
                + self._model_json
                + b',"choices":[{"index":'
            )
        # zero latency: nothing is gained by writing chunk by chunk, unless a stall must show a partial stream
        stalls = self.core.injector.faults.stall_after_tokens is not None
        batch = WRITE_BATCH if self.core.config.zero_latency and not stalls else 1
        out: list[bytes] = []
        n = params.n
        prompt_tokens = completion_tokens = cached_tokens = 0

        def piece(index: int, text: str, finish: str | None, lp: Any = None) -> bytes:
            if chat:
                delta = b'"delta":{"content":' + orjson.dumps(text) + b"}"
            else:
                delta = b'"text":' + orjson.dumps(text)
            tail = b',"logprobs":' + (orjson.dumps(lp) if lp is not None else b"null")
            tail += b',"finish_reason":' + (orjson.dumps(finish) if finish else b"null") + b"}]}\n\n"
            return prefix + str(index).encode() + b"," + delta + tail

        try:
            for p, run in enumerate(runs):
                decoders = [DecodeStream(skip_special_tokens=True) for _ in range(n)]
                stoppers = [StopText(params.stops, params.include_stop_str) for _ in range(n)]
                for i in range(n):
                    index = p * n + i
                    if chat:
                        out.append(
                            prefix + str(index).encode() + b',"delta":{"role":"assistant","content":""},'
                            b'"logprobs":null,"finish_reason":null}]}\n\n'
                        )
                    elif echo:
                        out.append(piece(index, prompts[p][1], None))
                stopped = 0
                async for ev in run.events():
                    i = ev.index
                    index = p * n + i
                    st = stoppers[i]
                    if isinstance(ev, EngineChunk):
                        if st.stopped:
                            continue
                        ds = decoders[i]
                        text = "".join(s for s in (ds.step(hf, t) for t in ev.token_ids) if s)
                        visible = st.feed(text)
                        lp = self._logprobs_json(ev.logprobs, chat) if params.logprobs else None
                        if visible or lp is not None:
                            out.append(piece(index, visible, None, lp))
                        if st.hit():
                            out.append(piece(index, "", "stop"))
                            stopped += 1
                            if stopped == n:
                                run.abort()  # every choice hit a stop string: the engine can stop
                    else:
                        assert isinstance(ev, EngineComplete)
                        completion_tokens += ev.completion_tokens
                        if i == 0:
                            prompt_tokens += ev.prompt_tokens
                            cached_tokens += ev.cached_tokens
                        if not st.stopped:
                            rest = st.flush()
                            out.append(piece(index, rest, ev.finish_reason))
                    if len(out) >= batch:
                        await resp.write(b"".join(out))
                        out.clear()
            if params.include_usage:
                usage = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                    "prompt_tokens_details": {"cached_tokens": cached_tokens},
                }
                obj = b"chat.completion.chunk" if chat else b"text_completion"
                out.append(
                    b'data: {"id":'
                    + head
                    + b',"object":"'
                    + obj
                    + b'","created":'
                    + str(created).encode()
                    + b',"model":'
                    + self._model_json
                    + b',"choices":[],"usage":'
                    + orjson.dumps(usage)
                    + b"}\n\n"
                )
            out.append(DONE)
            await resp.write(b"".join(out))
        except (ConnectionResetError, ConnectionError):
            pass  # the client went away; the runs are closed (counted as cancelled) by the caller
        return resp


def build_app(core: EngineCore, tokenizer: ChatTokenizer) -> web.Application:
    return MockHttpApi(core, tokenizer).app()
