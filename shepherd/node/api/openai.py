"""OpenAI-compatible generation endpoints: /v1/chat/completions and /v1/completions (stream and not).

Each handler parses the request, renders and encodes the prompt, and hands the engine work to a
``Generation`` (``generation.py``), under admission when rate limits are configured.

Order, so that no request does work that scales with its input before it is known to be served and
admitted: parse with bounded checks only (``parse_chat_deferred``: sizes of stops, schemas, tools,
template kwargs), resolve the model (404), render and encode (big renders in the tokenizer pool),
then under admission (rate limits) the meta-validation of its JSON schemas off the event loop
(``check_chat_schemas``), then the generation.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import orjson
from aiohttp import web

from shepherd.node.api.common import ADMISSION, GATEWAY, STREAM_KEY, admitted, model_for, relay
from shepherd.node.api.generation import Generation, Job, fresh_id
from shepherd.node.dispatch.gateway import Gateway
from shepherd.node.http.body import json_now, read_json
from shepherd.node.observe import tracing
from shepherd.node.openai.guided import GUIDED_KEYS
from shepherd.node.openai.requests import (
    ChatRequest,
    Sampling,
    check_chat_schemas,
    parse_chat_deferred,
    parse_completion,
)
from shepherd.node.openai.sse import DONE, CompletionChunks, with_choice_ids, with_usage
from shepherd.node.openai.template_compat import effort_kwargs, map_developer, template_names, with_text_parts
from shepherd.node.openai.tool_choice import template_tools
from shepherd.node.output.chat import shape_chat
from shepherd.node.output.choice import ChoiceState
from shepherd.proto.openai_errors import ApiError, bad
from shepherd.tokens.chat_messages import ChatTemplateError


def _sane(rid: object) -> bool:
    return isinstance(rid, str) and 0 < len(rid) <= 128 and rid.isprintable()


def _request_id(request: web.Request, prefix: str, d: dict[str, Any]) -> str:
    """The id clients see: their ``x-request-id`` when it is sane, else the body's ``request_id`` (vLLM's:
    after the prefix, as vLLM answers) or ``rid`` (SGLang's: as it is), else ours."""
    rid = request.headers.get("x-request-id")
    if _sane(rid):
        return str(rid)
    body_id = d.get("request_id")
    if _sane(body_id):
        return f"{prefix}{body_id}"
    body_id = d.get("rid")
    if _sane(body_id):
        return str(body_id)
    return fresh_id(prefix)


def _vllm_flags(g: Generation, d: dict[str, Any]) -> None:
    """vLLM's answer switches: ``return_tokens_as_token_ids`` (logprobs' tokens as ``"token_id:<id>"``) and
    ``return_token_ids`` (the prompt's and each choice's output ids in the answer); each a boolean."""
    if _flag(d, "return_tokens_as_token_ids") and g.lpfmt is not None:
        g.lpfmt.tokens_as_ids = True
    if _flag(d, "return_token_ids"):
        g.return_ids = True


def _flag(d: dict[str, Any], name: str) -> bool:
    v = d.get(name)
    if v is None or v is False:
        return False
    if v is not True:
        raise bad(f"'{name}' must be a boolean.", param=name)
    return True


def prompt_size(messages: Sequence[Any]) -> tuple[int, int]:
    """(the characters of the messages' text, the messages that are a token at least), what a prompt is
    mostly made of, for ``Gateway.check_prompt_chars``: the characters of their content (a string, or its
    text parts), reasoning and tool calls' arguments; a user or assistant message with text renders to
    one token at least in any template (300,000 messages of one letter: refused before rendering them)."""
    n = 0
    least = 0
    for m in messages:
        if type(m) is not dict:
            continue
        c = m.get("content")
        before = n
        if type(c) is str:
            n += len(c)
        elif type(c) is list:
            n += sum(len(t) for p in c if type(p) is dict and type(t := p.get("text")) is str)
        if n > before and m.get("role") in ("user", "assistant"):
            least += 1
        r = m.get("reasoning_content")
        if type(r) is str:
            n += len(r)
        calls = m.get("tool_calls")
        if type(calls) is list:
            for call in calls:
                fn = call.get("function") if type(call) is dict else None
                a = fn.get("arguments") if type(fn) is dict else None
                n += len(a) if type(a) is str else 0
    return n, least


def _check_ids(s: Sampling, vocab: int) -> None:
    """Token ids the request names must exist in the model's vocabulary."""
    if not s.stop_token_ids and not s.logit_bias:
        return
    for key, ids in (("stop_token_ids", s.stop_token_ids), ("logit_bias", [t for t, _ in s.logit_bias])):
        bad_ids = [t for t in ids if t >= vocab]
        if bad_ids:
            msg = f"'{key}' names token id {bad_ids[0]}, outside the vocabulary (size {vocab})."
            raise bad(msg, param=key)


async def render_chat(
    gw: Gateway, model: str, req: ChatRequest, param: str = "messages"
) -> tuple[str, list[int]]:
    """The chat template rendered over ``req`` and encoded, through the tokenizer service and its caches
    (chat completions, Responses and Messages alike); a template that cannot render is a 400 naming
    ``param``, the request field the messages came from. ``developer`` messages become ``system`` ones,
    ``reasoning_effort`` the template's thinking switch and contents sent as several text parts those
    parts for a template that iterates over them, as the template's source says
    (``template_compat``; ``req.template_kwargs`` updated, as the parser stage reads it)."""
    tools = template_tools(req.tools, req.tool_choice)
    messages = req.messages
    chars, least = prompt_size(messages)
    gw.check_prompt_chars(model, chars, param, least_tokens=least)
    if (
        req.reasoning_effort is not None
        or req.text_parts
        or any(m.get("role") == "developer" for m in messages)
    ):
        try:
            names = template_names(gw.tokenizer(model).chat_template(tools=tools is not None).source)
        except ChatTemplateError as e:
            raise bad(
                f"Cannot render the chat template: {e}", param=param, code="chat_template_error"
            ) from None
        messages = map_developer(messages, names)
        if req.text_parts:
            messages = with_text_parts(messages, req.text_parts, names)
        if req.reasoning_effort is not None:
            req.template_kwargs = effort_kwargs(
                req.reasoning_effort, names, req.template_kwargs, req.effort_required
            )
    # a span (tracing on): the template render and the encode, their cache hits or misses
    with tracing.stage(
        "render_tokenize", {"gen_ai.request.model": model}, cache_stats=gw.tokenizers.cache_counters
    ):
        tracing.input_messages(messages)  # only with OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT
        try:
            return await gw.tokenizers.render_and_encode(
                model,
                messages,
                tools,
                req.add_generation_prompt,
                req.continue_final_message,
                req.template_kwargs,
            )
        except ChatTemplateError as e:
            msg = f"Cannot render the chat template: {e}"
            raise bad(msg, param=param, code="chat_template_error") from None


# ---- handlers ----------------------------------------------------------------------------------------


async def _relayed(
    request: web.Request,
    gw: Gateway,
    model: str,
    raw: bytes,
    d: dict[str, Any],
    path: str,
    s: Sampling,
    chat: ChatRequest | None = None,
) -> web.StreamResponse:
    """A model served by OpenAI HTTP workers: the body goes to one as it is, under admission (a chat
    request's schemas checked first, under admission too)."""
    send = partial(relay, request, gw, model, raw, d, path, s.stream)
    if chat is not None and chat.schemas:
        send = partial(_checked, chat, send)
    return await admitted(request, model, len(raw) // 4, s, send)


def _relay_refuses(param: str, model: str) -> ApiError:
    """The 400 of a constrained-decoding field for a model served by OpenAI HTTP workers: the body is
    relayed as sent, and what kind of server the worker is (and whether it reads the field) is unknown,
    so the constraint cannot be promised."""
    msg = (
        f"'{param}' cannot be honoured: the model '{model}' is served by OpenAI HTTP workers, which are "
        "relayed the request as sent and may ignore it; use 'response_format', or a gRPC worker."
    )
    return ApiError(400, msg, param=param, code="unsupported_parameter")


async def _checked(req: ChatRequest, run: Callable[[], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """``run()`` once the request's JSON schemas passed meta-validation (off the event loop)."""
    await check_chat_schemas(req)
    return await run()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    gw: Gateway = request.app[GATEWAY]
    t0 = time.perf_counter()
    limit = gw.cfg.max_body_bytes
    got = json_now(request, limit)
    raw, d = got if got is not None else await read_json(request, limit)
    req = parse_chat_deferred(d)
    model = model_for(request, gw, req.model)
    gw.require_kind(model, "generate")
    if gw.relay_mode(model):
        if req.guided_param:
            raise _relay_refuses(req.guided_param, model)
        return await _relayed(request, gw, model, raw, d, "/v1/chat/completions", req.sampling, req)
    tok = gw.tokenizer(model)
    _check_ids(req.sampling, tok.vocab_size)
    text, ids = await render_chat(gw, model, req)
    shaping = shape_chat(gw.parser_families(model), req, text)
    n = req.sampling.n
    sampling = shaping.sampling
    states = (
        [ChoiceState(0, tok, sampling, ids)]
        if n == 1
        else [ChoiceState(i, tok, sampling, ids) for i in range(n)]
    )
    g = Generation(
        request,
        gw,
        model,
        tok,
        shaping.sampling,
        chat=True,
        rid=_request_id(request, "chatcmpl-", d),
        t0=t0,
        logprobs=req.top_logprobs if req.logprobs else None,
        shaping=shaping,
    )
    _vllm_flags(g, d)
    g.prompt_lps = g.prompt_field = req.prompt_logprobs  # vLLM's: the response's prompt_logprobs
    jobs = [Job(ids, text, states, 0)]
    adm = request.app[ADMISSION]
    if req.schemas:  # meta-validated now: after the model lookup and admission, off the event loop
        run = partial(_checked, req, partial(g.run, jobs))
        if adm is None:
            return await run()
        return await adm.guard(request, model, len(ids), shaping.sampling, run, jobs)
    if adm is None:
        return await g.run(jobs)
    return await adm.guard(request, model, len(ids), shaping.sampling, partial(g.run, jobs), jobs)


async def completions(request: web.Request) -> web.StreamResponse:
    gw: Gateway = request.app[GATEWAY]
    t0 = time.perf_counter()
    raw, d = await read_json(request, gw.cfg.max_body_bytes)
    req = parse_completion(d)
    model = model_for(request, gw, req.model)
    gw.require_kind(model, "generate")
    if gw.relay_mode(model):
        guided = next((k for k in GUIDED_KEYS if d.get(k) is not None), None)
        if guided is not None:
            raise _relay_refuses(guided, model)
        return await _relayed(request, gw, model, raw, d, "/v1/completions", req.sampling)
    tok = gw.tokenizer(model)
    _check_ids(req.sampling, tok.vocab_size)
    jobs: list[Job] = []
    vocab = tok.vocab_size
    for i, p in enumerate(req.prompts):
        if isinstance(p, str):
            gw.check_prompt_chars(model, len(p), "prompt")
            with tracing.stage(
                "tokenize", {"gen_ai.request.model": model}, cache_stats=gw.tokenizers.cache_counters
            ):
                ids = await gw.tokenizers.encode(model, p, req.add_special_tokens)
            text = p
        else:
            if any(t >= vocab or t < 0 for t in p):
                raise bad(
                    f"prompt {i} holds a token id outside the vocabulary (size {vocab}).", param="prompt"
                )
            ids, text = p, ""
        if not ids:
            raise bad(f"prompt {i} is empty.", param="prompt")
        # the context checked here, so that its 400 names this route's field (generation checks it too)
        gw.check_context(model, len(ids), req.sampling.max_tokens, param="prompt")
        states = [ChoiceState(j, tok, req.sampling, ids) for j in range(req.sampling.n)]
        echo = (text or tok.decode(ids, skip_special_tokens=False)) if req.echo else ""
        jobs.append(Job(ids, text, states, i * req.sampling.n, echo))
    g = Generation(
        request,
        gw,
        model,
        tok,
        req.sampling,
        chat=False,
        rid=_request_id(request, "cmpl-", d),
        t0=t0,
        logprobs=req.logprobs,
        constraint=req.constraint,
    )
    _vllm_flags(g, d)
    # the prompt's logprobs: vLLM's prompt_logprobs field, and echo's with logprobs
    g.prompt_lps, g.prompt_field = req.engine_prompt_logprobs, req.prompt_logprobs
    g.echo_logprobs = req.echo and req.logprobs is not None
    run = partial(_echo_only, g, jobs) if req.echo_only else partial(g.run, jobs)
    adm = request.app[ADMISSION]
    if adm is None:
        return await run()
    prompt = sum(len(j.ids) for j in jobs)
    return await adm.guard(request, model, prompt, req.sampling, run, jobs)


async def _echo_only(g: Generation, jobs: list[Job]) -> web.StreamResponse:
    """vLLM's ``echo`` with ``max_tokens: 0`` (serving_completion.py: "only return the prompt"): every
    choice is its prompt alone, ``finish_reason`` ``length``, no completion token, streamed or not. The
    engine is not called (vLLM generates one token and drops it), unless the prompt's logprobs are asked
    (``logprobs``, ``prompt_logprobs``): then each prompt's call generates one token, dropped, as vLLM's
    (``Generation.prompt_only``), and the choices carry the prompt's logprobs (the first token's null)."""
    request, gw = g.request, g.gw
    gw.metrics.overhead.observe(time.perf_counter() - g.t0)
    if g.prompt_lps is not None:
        await g.prompt_only(jobs)  # (before any byte is sent: a failure is a plain HTTP error)
    for job in jobs:
        g._account(job)  # (its prompt; no completion token)
    prompt = g.totals.prompt

    def lp(job: Job, idx: int) -> dict[str, Any] | None:
        return g._echo_lp(job, idx) if g.echo_logprobs else None

    if not g.s.stream:
        choices = []
        for job in jobs:
            field = g._prompt_field(job)
            for st in job.states:
                idx = job.index_base + st.index
                choice = {
                    "index": idx,
                    "text": job.echo,
                    "logprobs": lp(job, idx),
                    "finish_reason": "length",
                    "matched_stop": None,
                    "stop_reason": None,
                    **({"token_ids": [], "prompt_token_ids": job.ids} if g.return_ids else {}),
                }
                if field is not None:
                    choice["prompt_logprobs"] = field
                choices.append(choice)
        g.done()
        body = orjson.dumps(g.answer_body(choices))
        return web.Response(body=body, content_type="application/json", headers=g.headers())
    request[STREAM_KEY] = True  # SMG's ``streaming`` label of the request count
    enc = CompletionChunks(g.rid, g.created, g.model)
    out: list[bytes] = []
    for job in jobs:
        for st in job.states:
            idx = job.index_base + st.index
            chunks = [enc.content(idx, job.echo, lp(job, idx)), enc.finish(idx, "length")]
            if g.return_ids:
                chunks[0] = with_choice_ids(chunks[0], (), job.ids)
            if g.s.continuous_usage:  # (vLLM's: this prompt's tokens, this choice's none)
                chunks = [with_usage(c, len(job.ids), 0) for c in chunks]
            out.extend(chunks)
    if g.s.include_usage:
        out.append(enc.usage_of(prompt, 0, 0))
    out.append(DONE)
    resp = g.sse_response()
    await resp.prepare(request)
    await resp.write_eof(b"".join(out))
    g.done()
    return resp


def routes() -> list[web.RouteDef]:
    return [web.post("/v1/chat/completions", chat_completions), web.post("/v1/completions", completions)]
