"""The Anthropic Messages API: ``POST /v1/messages`` (stream and not) and ``POST
/v1/messages/count_tokens``, for the official ``anthropic`` SDK unchanged.

A create runs the chat path's order: parse with bounded checks only (``node.anthropic.requests``), resolve
the model (404), render and encode with the same tokenizer service call as chat (so a Messages prompt
hits the same render and token caches), ``shape_chat`` (parsers, tool constraints), then under
admission the meta-validation of the tools' input schemas off the event loop, then the generation. The
answer is the chat pipeline's: ``Generation`` with the chat parser stage, writing the Messages encoder's
events (``node.anthropic.messages.MessageEvents``) when streamed, or ``collect`` then the whole output
through the same encoder, quiet (``node.output.chat.replay``): the Message has the stream's blocks.

A tool call the output was cut off inside (``max_tokens``) is a ``tool_use`` block, its ``input`` the
call's JSON as far as it goes (a cut leaving no whole name drops the call), as Anthropic answers with
``stop_reason: max_tokens``: the tool parser's ``partial_calls`` (chat completions keep vLLM's text). An
output that ended on its own inside a call (EOS, a stop sequence: a malformed call, e.g. its JSON
unterminated) has that call as text, as chat completions answer it: never a ``tool_use`` block under
``end_turn``, which would leave the client a call to answer that it was told not to run.

``count_tokens`` renders and encodes exactly as a create would and answers ``{"input_tokens": N}``.

Every answer of these routes carries Anthropic's ``request-id`` header (what the SDK reads as a Message's
``_request_id`` and an error's ``request_id``) besides ``x-request-id``: a create's is its message id, an
error's and a count's is the request's id (``x-request-id``'s), whoever made the error (the handlers,
authentication, rate limits, the error middleware: ``common.stamp_headers``).

Errors on these routes are answered in Anthropic's envelope by the error middleware (keyed on the path
prefix ``/v1/messages``); a failure once a stream has started is an ``event: error``. Models served by
OpenAI HTTP workers are refused (400): their answers cannot be re-encoded here.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from shepherd.node.anthropic.messages import MessageEvents, messages_usage
from shepherd.node.anthropic.requests import MessagesRequest, parse_count_tokens, parse_messages
from shepherd.node.api.admission import TICKET_KEY
from shepherd.node.api.common import ADMISSION, GATEWAY, MODEL_KEY, STREAM_KEY, model_for, request_id_of
from shepherd.node.api.generation import Generation, Job, fresh_id, strict_violation
from shepherd.node.api.openai import render_chat
from shepherd.node.dispatch.gateway import Gateway
from shepherd.node.http.body import read_json
from shepherd.node.openai.structured import check_schemas, header_value
from shepherd.node.output.chat import replay, shape_chat
from shepherd.node.output.choice import ChoiceState
from shepherd.proto.openai_errors import bad

__all__ = ["count_tokens", "create_message", "routes"]

REQUEST_ID = "request-id"  # Anthropic's header (the SDK's ``_request_id`` / ``APIStatusError.request_id``)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _MessagesGeneration(Generation):
    """The chat generation, its answers (whole and streamed) carrying ``request-id`` too, and under rate
    limits Anthropic's ``anthropic-ratelimit-*`` beside the ``x-ratelimit-*`` (``admission``)."""

    def headers(self) -> dict[str, str]:
        h = super().headers()
        h[REQUEST_ID] = self.rid
        ticket = self.request.get(TICKET_KEY)
        if ticket is not None:
            h.update(ticket.anthropic_headers)
        return h


async def _prompt(gw: Gateway, model: str, req: MessagesRequest) -> tuple[str, list[int]]:
    return await render_chat(gw, model, req.chat)


def _model(request: web.Request, gw: Gateway, name: str) -> str:
    model = model_for(request, gw, name)
    gw.require_kind(model, "generate")
    if gw.relay_mode(model):
        raise bad(
            f"The Messages API is not available for '{model}', served by OpenAI HTTP workers.",
            param="model",
            code="unsupported_model",
        )
    return model


async def create_message(request: web.Request) -> web.StreamResponse:
    gw: Gateway = request.app[GATEWAY]
    t0 = time.perf_counter()
    _, d = await read_json(request, gw.cfg.max_body_bytes)
    req = parse_messages(d, request.headers.get("anthropic-beta", ""))
    model = _model(request, gw, req.chat.model)
    tok = gw.tokenizer(model)
    text, ids = await _prompt(gw, model, req)
    req, bound = _within_context(gw, model, req, len(ids))
    shaping = shape_chat(gw.parser_families(model), req.chat, text)
    if shaping.output is not None and shaping.output.tool_parser is not None:
        # a call cut off by max_tokens is a tool_use block (its input as far as it goes), as Anthropic's
        # and its input is held to its end unless the client opted in to eager input streaming
        shaping.output = dataclasses.replace(shaping.output, partial_calls=True, live_calls=req.eager_tools)
    message_id = fresh_id("msg_")
    events = (
        MessageEvents(
            message_id,
            model,
            len(ids),
            req.stop_sequences,
            omit_thinking=req.omit_thinking,
            context_bound=bound,
        )
        if req.stream
        else None
    )
    g = _MessagesGeneration(
        request,
        gw,
        model,
        tok,
        shaping.sampling,
        chat=True,
        rid=message_id,
        t0=t0,
        logprobs=None,
        shaping=shaping,
        events=events,
    )
    jobs = [Job(ids, text, [ChoiceState(0, tok, shaping.sampling, ids)], 0)]
    schemas = req.chat.schemas

    async def run() -> web.StreamResponse:
        if schemas:  # under admission, after the model lookup: off the loop, with a deadline
            await check_schemas(schemas)
        gw.metrics.overhead.observe(time.perf_counter() - t0)
        if req.cache_only:
            return await _cache_only(g, jobs, message_id, req)
        if events is not None:
            return await g.stream(jobs)
        return await _respond(g, jobs, message_id, req, bound)

    adm = request.app[ADMISSION]
    if adm is None:
        return await run()
    return await adm.guard(request, model, len(ids), shaping.sampling, run, jobs)


def _within_context(
    gw: Gateway, model: str, req: MessagesRequest, prompt: int
) -> tuple[MessagesRequest, bool]:
    """The request with ``max_tokens`` lowered to what the context window leaves after the prompt, and
    whether it was (Anthropic's models take any ``max_tokens`` up to their output limit and stop at the
    window with ``stop_reason: model_context_window_exceeded``: Claude Code asks 32,000 of every model,
    which a 32K-context model would otherwise refuse on every turn); a prompt that leaves no room is a
    400 in Anthropic's words ("prompt is too long: N tokens > M maximum"), which clients match to
    compact the conversation."""
    ctx = gw.context_length(model)
    if prompt >= ctx:
        raise bad(f"prompt is too long: {prompt} tokens > {ctx - 1} maximum", param="messages")
    asked = req.chat.sampling.max_tokens
    if asked is None or prompt + asked <= ctx:
        return req, False
    sampling = dataclasses.replace(req.chat.sampling, max_tokens=ctx - prompt)
    return dataclasses.replace(req, chat=dataclasses.replace(req.chat, sampling=sampling)), True


async def _respond(
    g: Generation, jobs: list[Job], message_id: str, req: MessagesRequest, bound: bool = False
) -> web.Response:
    choices, violations = await g.collect(jobs)
    strict = g.rejected(violations)
    if strict:
        raise strict_violation(strict)
    choice: dict[str, Any] = choices[0]
    job = jobs[0]
    enc = MessageEvents(
        message_id,
        g.model,
        len(job.ids),
        req.stop_sequences,
        quiet=True,
        omit_thinking=req.omit_thinking,
        context_bound=bound,
    )
    reason = choice["finish_reason"]
    replay(g.output, enc, job.states[0].full_text(), cut=reason == "length")
    enc.finish(0, reason, choice.get("matched_stop"))
    t = g.totals
    body = enc.message(messages_usage(t.prompt, t.completion, t.cached))
    g.done()
    headers = g.headers()
    if violations:
        headers["x-smg-schema-violation"] = header_value(violations)
    return web.Response(body=orjson.dumps(body), content_type="application/json", headers=headers)


async def _cache_only(g: Generation, jobs: list[Job], message_id: str, req: MessagesRequest) -> web.Response:
    """``max_tokens: 0``: the prompt's prefill alone, so that the engine's prefix cache holds it (one
    token generated and dropped, as the completions API's echo with ``max_tokens`` 0: vLLM refuses a
    request for none), then an empty Message, ``stop_reason`` max_tokens, no output token; streamed,
    its ``message_start``, ``message_delta`` and ``message_stop``. A failure is a plain HTTP error (no
    byte was sent)."""
    await g.prompt_only(jobs, logprobs=False)
    job = jobs[0]
    g._account(job)
    g.done()
    enc = MessageEvents(message_id, g.model, len(job.ids), req.stop_sequences, quiet=not req.stream)
    enc.cache(g.totals.cached)
    start = enc.opening()  # (nothing when quiet)
    enc.finish(0, "length")
    t = g.totals
    headers = g.headers()
    if req.stream:
        g.request[STREAM_KEY] = True
        headers["Cache-Control"] = "no-cache"
        body = start + await enc.end(t.prompt, 0, t.cached)
        return web.Response(body=body, content_type="text/event-stream", headers=headers)
    message = enc.message(messages_usage(t.prompt, 0, t.cached))
    return web.Response(body=orjson.dumps(message), content_type="application/json", headers=headers)


async def count_tokens(request: web.Request) -> web.StreamResponse:
    gw: Gateway = request.app[GATEWAY]
    _, d = await read_json(request, gw.cfg.max_body_bytes)
    req = parse_count_tokens(d)
    model = _model(request, gw, req.chat.model)
    if req.chat.schemas:
        await check_schemas(req.chat.schemas)
    _, ids = await _prompt(gw, model, req)
    request[MODEL_KEY] = model
    return web.Response(
        body=orjson.dumps({"input_tokens": len(ids)}),
        content_type="application/json",
        headers={REQUEST_ID: request_id_of(request)},
    )


def routes() -> list[web.RouteDef]:
    return [
        web.post("/v1/messages", create_message),
        web.post("/v1/messages/count_tokens", count_tokens),
    ]
