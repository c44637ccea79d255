"""The node's request machinery: models and their tokenizers, dispatch to a worker with retry, abort.

The HTTP handlers (``shepherd.node.api``) parse and encode; this module owns what happens between: the prompt
becomes ids, a policy picks a worker, an engine stream is opened (retried on another worker when it fails
before its first token), and an engine request that is no longer wanted is always aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from shepherd.node.config import ConfigError, ModelConfig, NodeConfig, cache_aware_config
from shepherd.node.dispatch.kv_feed import KvFeed, feed_index_of, merge_load
from shepherd.node.dispatch.pd import PdRouter
from shepherd.node.dispatch.stream import Batches, EngineStream, Retry
from shepherd.node.dispatch.workers import (
    Worker,
    WorkerRegistry,
    client_error,
    no_healthy_worker,
    pick_worker,
)
from shepherd.node.engines.http import HttpRelayClient
from shepherd.node.metrics import NodeMetrics, counter, gauge
from shepherd.node.observe import tracing
from shepherd.parsers import OFF, default_parsers_for_model, reasoning_family_name, tool_family_name
from shepherd.policies.base import Policy
from shepherd.policies.simple import make_policy
from shepherd.proto.engine_types import (
    EmbedClient,
    EmbedResult,
    EngineChunk,
    EngineComplete,
    EngineError,
    EngineEvent,
    EngineLoad,
    EngineTimeout,
    GenerateRequest,
    ModelInfo,
    SamplingDefaults,
)
from shepherd.proto.openai_errors import ApiError
from shepherd.tokens.service import TokenizerService
from shepherd.tokens.tokenizer import Tokenizer

log = logging.getLogger("shepherd.gateway")


def model_parsers(mc: ModelConfig, reasoning: str | None, tool: str | None) -> tuple[str | None, str | None]:
    """(reasoning, tool-call) families of a model: its own setting, else the node's, else the default
    for its name (then its path); "none" (or SMG's "passthrough", "plain") turns a parser off."""
    by_name = default_parsers_for_model(mc.name)
    if by_name == (None, None) and mc.model_path:
        by_name = default_parsers_for_model(Path(mc.model_path).name)
    r = mc.reasoning_parser or reasoning
    t = mc.tool_call_parser or tool
    r_family = by_name[0] if r is None else None if r.lower() in OFF else reasoning_family_name(r)
    t_family = by_name[1] if t is None else None if t.lower() in OFF else tool_family_name(t)
    return r_family, t_family


def model_not_found(model: str, known: list[str]) -> ApiError:
    return ApiError(
        404,
        f"The model '{model}' does not exist. Available models: {', '.join(known) or 'none'}.",
        param="model",
        code="model_not_found",
    )


class Gateway:
    """The node's request machinery between the HTTP handlers and the engines: models, their
    tokenizers and policies, the worker registry, ``pick`` and ``open_stream`` with retry.

    Invariants: every engine request it opens is either completed or aborted (``EngineStream.close``,
    or the abort spawned when ``open_stream`` itself fails or is cancelled after the engine saw the
    request); a worker's ``in_flight`` is raised once per open stream and lowered once when it closes;
    a request is retried on another worker only before its first token and never on the worker that
    failed it (at most ``max_retries`` times); ``in_flight`` counts the node's requests being served
    (the error middleware keeps it) and ``draining`` only ever goes from False to True. Routing
    decisions are made by the policies over snapshots; no I/O happens inside ``pick``.
    """

    def __init__(self, cfg: NodeConfig) -> None:
        self.cfg = cfg
        self.metrics = NodeMetrics()
        self.registry = WorkerRegistry(cfg)
        self.registry.loads_needed = self._loads_needed
        self.models: dict[str, ModelConfig] = {m.name: m for m in cfg.model_configs()}
        self._context_lengths: dict[str, tuple[int, int]] = {}  # model -> (registry version, length)
        self._kinds: dict[str, tuple[int, str | None]] = {}  # model -> (registry version, kind)
        # model -> (registry version, what its engines report about sampling: engine_facts)
        self._engine_facts: dict[str, tuple[int, EngineFacts]] = {}
        self._parser_families: dict[str, tuple[str | None, str | None]] = {}
        # one policy instance per model (its own state: cursor, prefix index...), the model's or the node's
        self.policies: dict[str, Policy] = {
            m.name: make_policy(m.policy or cfg.policy, cache_aware=cache_aware_config(cfg))
            for m in self.models.values()
        }
        self.registry.worker_limit = self._worker_limit
        for m in self.models.values():  # a configuration the policy cannot route by: refused at start-up
            limit = self._worker_limit(m.name)
            if limit is not None and len(set(m.worker_urls)) > limit:
                raise ConfigError(
                    f"model {m.name!r}: {len(set(m.worker_urls))} workers, more than the {limit} its "
                    f"{m.policy or cfg.policy} policy's prefix index holds; split them over several models"
                )
        self.kv_feed = KvFeed()
        self.pd: PdRouter | None = PdRouter(self) if cfg.pd_disaggregation else None
        self.registry.on_added = self._worker_added
        self.registry.on_removed = self._worker_removed
        self.registry.on_client_changed = self._worker_client_changed
        self.tokenizers = TokenizerService(
            {m.name: Path(m.model_path) for m in self.models.values()},
            workers=cfg.tokenizer_workers,
            inline_max_chars=cfg.tokenizer_inline_max_chars,
            chat_templates={m.name: m.chat_template for m in self.models.values() if m.chat_template},
            freeze_before_fork=cfg.gc_gen0_threshold > 0,  # gc_tuning's freeze, done before the fork
        )
        self.draining = False
        self.stopping = False  # the shutdown grace is over: requests still served are being cancelled
        self.in_flight = 0
        self._background: set[asyncio.Task[Any]] = set()
        self.started_at = time.time()
        self.metrics.add_callback(self._collect)
        self.metrics.track_in_flight(lambda: float(self.in_flight))

    # ---- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.tokenizers.start()
        adds = [self.registry.add(url, m.name) for m in self.models.values() for url in m.worker_urls]
        await asyncio.gather(*adds)
        self.registry.start()

    async def close(self) -> None:
        await self.kv_feed.close()
        if self._background:  # the Aborts of the calls the shutdown ended, before their clients close
            await asyncio.gather(*self._background, return_exceptions=True)  # (each bounded: 5 s)
        await self.registry.close()
        await self.tokenizers.close()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        t = asyncio.create_task(coro)
        self._background.add(t)
        t.add_done_callback(self._background.discard)

    def _worker_limit(self, model: str) -> int | None:
        limit = getattr(self.policy_for(model), "worker_limit", None)  # cache_aware's index: 64
        return limit if isinstance(limit, int) else None

    def policy_for(self, model: str) -> Policy:
        p = self.policies.get(model)
        if p is None:  # a model known only from a worker added at run time: the node's policy
            p = self.policies[model] = make_policy(self.cfg.policy, cache_aware=cache_aware_config(self.cfg))
        return p

    def set_policy(self, model: str, policy: Policy) -> None:
        """Route ``model`` with ``policy`` from now on (a configuration reload): the KV-event feeds of its
        workers are restarted into the new policy's index."""
        self.policies[model] = policy
        for w in list(self.registry.workers.values()):
            if w.model == model:
                self.kv_feed.stop(w.id, clear=False)  # the old policy's index goes with it
                self._worker_added(w)
        self.registry.wake_load_polls()  # a policy that reads loads: the poll loop starts at once

    def _loads_needed(self, w: Worker) -> bool:
        """Whether ``w``'s routing policy reads the engine-reported loads (``Policy.uses_loads``)."""
        policy = (self.pd.policy_of(w) if self.pd is not None else None) or self.policy_for(w.model)
        return bool(getattr(policy, "uses_loads", True))

    def _worker_added(self, w: Worker) -> None:
        """A gRPC worker of a model routed by a prefix index: feed the index from its KV events."""
        client = w.client
        if isinstance(client, HttpRelayClient) or not self.cfg.kv_events:
            return  # without KV events the index learns from routing decisions only (mesh-wide with a mesh)
        policy = (self.pd.policy_of(w) if self.pd is not None else None) or self.policy_for(w.model)
        index = feed_index_of(policy, w.model)
        if index is None:
            return

        clock = self.registry.clock

        def on_load(load: EngineLoad) -> None:
            w.load = merge_load(w.load, load)
            # the next GetLoads is skipped; a partial record keeps the telemetry's age (polled when old)
            w.load_pushed_at = now = clock()
            if load.max_total_tokens:  # a whole record: telemetry included
                w.telemetry_at = now

        self.kv_feed.start(w.id, client, index, on_load)

    def _worker_client_changed(self, w: Worker) -> None:
        """A grpc:// worker turned out TensorRT-LLM or MLX: its KV feed (if it has one) starts again on the
        new client (the first one's may have ended already, told UNIMPLEMENTED by the SGLang probe)."""
        self.kv_feed.stop(w.id)
        self._worker_added(w)

    def _worker_removed(self, w: Worker) -> None:
        self.kv_feed.stop(w.id)
        policy = (self.pd.policy_of(w) if self.pd is not None else None) or self.policies.get(w.model)
        index = feed_index_of(policy, w.model)
        if index is not None:
            index.clear_worker(w.id)

    # ---- models --------------------------------------------------------------------------------------

    def model_names(self) -> list[str]:
        return list(self.models)

    def served_name(self, model: str) -> str:
        """The engine's name for ``model`` (its alias's target), else ``model`` itself."""
        mc = self.models.get(model)
        return (mc.served_name if mc is not None else None) or model

    def parser_families(self, model: str) -> tuple[str | None, str | None]:
        """The model's (reasoning, tool-call) parser families; None: that parser is off."""
        fams = self._parser_families.get(model)
        if fams is None:
            mc = self.models.get(model)
            fams = self._parser_families[model] = model_parsers(
                mc or ModelConfig(model, ""), self.cfg.reasoning_parser, self.cfg.tool_call_parser
            )
        return fams

    def resolve_model(self, name: str) -> str:
        if name in self.models:
            return name
        if len(self.models) == 1 and name in ("default", ""):  # "": the request named none (as vLLM)
            return next(iter(self.models))
        if not name:
            names = ", ".join(self.models)
            msg = f"'model' is required: this node serves {len(self.models)} models ({names})."
            raise ApiError(400, msg, param="model", code="missing_model")
        raise model_not_found(name, self.model_names())

    def tokenizer(self, model: str) -> Tokenizer:
        return self.tokenizers.get(model)

    def context_length(self, model: str) -> int:
        """The configured context, else the smallest any worker reports, else the tokenizer's
        (cached until the registry's workers or their model info change)."""
        version = self.registry.version
        hit = self._context_lengths.get(model)
        if hit is not None and hit[0] == version:
            return hit[1]
        mc = self.models[model]
        lens = [
            w.info.max_context_length
            for w in self.registry.for_model(model)
            if w.info and w.info.max_context_length
        ]
        n = mc.context_length or (min(lens) if lens else self.tokenizer(model).model_max_length)
        self._context_lengths[model] = (version, n)
        return n

    def check_prompt_chars(
        self, model: str, chars: int, param: str = "messages", least_tokens: int = 0
    ) -> None:
        """Refuse, before any tokenizing, a prompt of more characters than the context's tokens can hold
        (no token is longer than the tokenizer's longest entry), or of more than ``least_tokens`` (what
        it is known to take at the least: a token a message) when those are more than the context:
        tokenizing costs ~0.5 CPU-second a megabyte, and a gzip body of 15 KB decodes to 15 MB of
        prompt."""
        ctx = self.context_length(model)
        most = ctx * self.tokenizer(model).max_token_chars
        if chars > most or least_tokens > ctx:
            reduce = "the messages or completion" if param == "messages" else f"'{param}'"
            what = (
                f"{chars} characters of prompt, more than {ctx} tokens can hold"
                if chars > most
                else f"{least_tokens} messages, at least a token each"
            )
            raise ApiError(
                400,
                f"This model's maximum context length is {ctx} tokens. However, you requested {what}. "
                f"Please reduce the length of {reduce}.",
                param=param,
                code="context_length_exceeded",
            )

    def check_context(
        self,
        model: str,
        n_prompt: int,
        max_tokens: int | None,
        param: str = "messages",
        max_param: str = "max_tokens",
    ) -> int:
        """Validate the prompt against the context; returns max_new_tokens to ask the engine for. A 400
        names ``param``, the request field the prompt came from (chat's ``messages``, completions'
        ``prompt``, Responses' ``input``), and ``max_param``, the route's output bound, in its words."""
        ctx = self.context_length(model)
        if n_prompt >= ctx or (max_tokens is not None and n_prompt + max_tokens > ctx):
            if param == "messages":
                want = f" plus {max_tokens} output tokens" if max_tokens is not None else ""
                asked = (
                    f"{n_prompt} prompt tokens{want}. Please reduce the length of the messages or completion."
                )
            else:
                want = f" plus {max_tokens} output tokens ('{max_param}')" if max_tokens is not None else ""
                also = f" or '{max_param}'" if max_tokens is not None else ""
                asked = f"{n_prompt} tokens of '{param}'{want}. Please reduce the length of '{param}'{also}."
            raise ApiError(
                400,
                f"This model's maximum context length is {ctx} tokens. However, you requested {asked}",
                param=param,
                code="context_length_exceeded",
            )
        return max_tokens if max_tokens is not None else ctx - n_prompt

    def model_kind(self, model: str) -> str | None:
        """ "generate" or "embed": the model's configured kind, else what its gRPC workers report
        (GetModelInfo's is_generation: "embed" when every one that answered says False); None: unknown
        (only HTTP workers, or none answered yet). Cached until the registry changes."""
        version = self.registry.version
        hit = self._kinds.get(model)
        if hit is not None and hit[0] == version:
            return hit[1]
        mc = self.models.get(model)
        kind = mc.kind if mc is not None else None
        if kind is None:
            infos = [
                w.info
                for w in self.registry.for_model(model)
                if w.info is not None and not isinstance(w.client, HttpRelayClient)
            ]
            if infos:
                kind = "generate" if any(i.is_generation for i in infos) else "embed"
        self._kinds[model] = (version, kind)
        return kind

    def engine_facts(self, model: str, target: str | None = None) -> EngineFacts:
        """What ``model``'s engines report that shapes the request sent them: the sampling defaults (those
        of the workers that produce the output: in PD the decode pool's; ``target``: that worker's) and
        whether a worker refuses ``min_new_tokens`` (an SGLang worker started with --skip-tokenizer-init:
        any worker of the model, prefill ones too, as they get the same request). Workers that report
        different defaults: those most of them report (ties: the first worker's, by id), with a warning.
        Cached until the registry's workers or their model info change."""
        if target is not None:
            w = self.registry.find(target)
            if w is not None and w.model == model:
                return _facts([w.info] if w.info is not None else [], [w.info] if w.info is not None else [])
        version = self.registry.version
        hit = self._engine_facts.get(model)
        if hit is not None and hit[0] == version:
            return hit[1]
        ws = sorted(self.registry.for_model(model), key=lambda w: w.id)
        infos = [w.info for w in ws if w.info is not None and not w.is_http]
        pd = self.pd
        out = infos
        if pd is not None:
            out = [w.info for w in ws if w.info is not None and not w.is_http and w.id in pd.decode_ids]
        facts = _facts(out, infos)
        if facts.divergent:
            log.warning(
                "the workers of model %s report different sampling defaults; requests get %s",
                model,
                facts.defaults.as_dict() if facts.defaults is not None else "none",
            )
        self._engine_facts[model] = (version, facts)
        return facts

    def require_kind(self, model: str, kind: str) -> None:
        """A 400 when ``model`` is known to be of the other kind (a generation route naming an embedding
        model, or /v1/embeddings naming a generation-only model)."""
        got = self.model_kind(model)
        if got is None or got == kind:
            return
        if kind == "embed":
            msg = f"The model '{model}' is a generation model; it does not serve /v1/embeddings."
        else:
            msg = f"The model '{model}' is an embedding model; use /v1/embeddings."
        raise ApiError(400, msg, param="model", code="model_not_supported")

    # ---- dispatch ------------------------------------------------------------------------------------

    def relay_mode(self, model: str) -> bool:
        """A model whose workers are all OpenAI HTTP workers is relayed, not tokenized."""
        return self.registry.http_only(model)

    def pick(
        self,
        model: str,
        exclude: set[str],
        input_ids: Sequence[int],
        routing_key: str | None,
        *,
        http: bool = False,
    ) -> Worker | None:
        """A worker for the request, by the model's policy, among the routable workers not in
        ``exclude`` (``pick_worker``; PD dispatch calls that with its pools' policies). A meshed node's
        KV-event streams are read first if their last read is over 50 ms old (``KvFeed.poll_fresh``)."""
        self.kv_feed.poll_fresh()
        return pick_worker(
            self.registry, model, exclude, input_ids, routing_key, self.policy_for(model), http=http
        )

    async def open_stream(
        self,
        model: str,
        gen: GenerateRequest,
        *,
        target: str | None = None,
        routing_key: str | None = None,
        retry: Retry | None = None,
    ) -> EngineStream:
        """Send ``gen`` to a worker and wait for its first event; retry elsewhere on early failure.
        ``retry``: the request's tries so far (workers left out, attempts counted; updated)."""
        if self.pd is not None and target is None:
            return await self.pd.open_stream(model, gen, routing_key)
        state = retry if retry is not None else Retry()
        tried = state.tried
        last_error: EngineError | None = None
        while True:
            if target is not None:
                w = self.registry.find(target)
                if w is None or w.model != model:
                    raise ApiError(400, f"x-smg-target-worker {target!r} is not a worker of model {model!r}.")
            else:
                with tracing.stage("route") as rt:  # a span with the policy's choice (tracing on)
                    w = self.pick(model, tried, gen.input_ids, routing_key)  # as is: it may carry its pieces
                    rt.routed(self.policy_for(model), w)
            if w is None:
                if last_error is not None:
                    raise last_error
                raise no_healthy_worker(f"No healthy worker is available for model '{model}'.")
            attempt = state.attempt
            req = gen if attempt == 0 else _with_id(gen, f"{gen.request_id}-r{attempt}")
            client = w.client
            if isinstance(client, HttpRelayClient):
                w.breaker.release()
                raise ApiError(
                    400, f"worker {w.id} is an HTTP worker; model {model!r} is served over gRPC here."
                )
            w.in_flight += 1
            call = (  # the CLIENT span of this engine call (tracing on): current while it is sent
                tracing.engine_call(model, req.request_id, req.sampling, w.url, client.kind, attempt)
                if tracing.ENABLED
                else None
            )
            agen = cast(Batches, client.generate_batches(req, timeout=self.cfg.request_timeout_secs))
            try:
                first = await (anext(agen) if call is None else call.first(anext(agen)))
                for _ in range(_MAX_EMPTY_FIRST):  # chunks without tokens: the outcome is still open
                    if not _tokenless(first):
                        break
                    first = [*first, *await anext(agen)]
                if not req.stream:  # nothing reaches the client before every choice ended: read them all
                    bound = req.sampling.max_new_tokens
                    first = await _every_choice(
                        agen, first, req.sampling.n, req.token_limit if bound is None else bound
                    )
            except StopAsyncIteration:
                w.in_flight -= 1
                self.registry.record_result(w, False)
                last_error = EngineError("engine closed the stream without output")
            except EngineError as e:
                w.in_flight -= 1
                if isinstance(e, EngineTimeout):
                    # our deadline, not the engine's end: the request may still be queued or running there
                    self.abort_in_background(w, req.request_id, "timeout")
                if e.code == "invalid_request":  # the request's fault, not the worker's
                    w.breaker.release()
                    raise client_error(e, w) from None
                if e.code == "engine_overloaded":  # busy, not broken: its circuit stays as it is (a burst
                    w.breaker.release()  # must not take every worker out, and /readiness with them)
                else:
                    self.registry.record_result(w, False)
                last_error = client_error(e, w)  # what a client may read: the worker by id
                if not e.retryable or target is not None:
                    raise last_error from None
            except BaseException as e:
                w.in_flight -= 1
                w.breaker.release()
                # the handler is cancelled when its client goes away (aiohttp's handler cancellation)
                why = "client_disconnect" if isinstance(e, asyncio.CancelledError) else "cancelled"
                self.abort_in_background(w, req.request_id, why)
                with contextlib.suppress(Exception):
                    await agen.aclose()
                raise
            else:
                failed = _failed_first(first, req.stream)
                if failed is None:
                    self.registry.record_result(w, True)
                    return EngineStream(self, w, req.request_id, agen, first, trace=call)
                # the engine gave up before any output reached the client: another worker may serve it
                w.in_flight -= 1
                self.registry.record_result(w, False)
                if req.sampling.n > 1:  # one choice ended: the others may still be running on the engine
                    self.abort_in_background(w, req.request_id, "cancelled")
                last_error = EngineError(
                    f"worker {w.id} ended the request with finish_reason {failed!r} before its first token",
                    code="engine_abort",
                )
                if call is not None:
                    call.fail(last_error)
                if target is not None:
                    with contextlib.suppress(Exception):
                        await agen.aclose()
                    raise last_error
            with contextlib.suppress(Exception):
                await agen.aclose()
            tried.add(w.id)
            state.attempt += 1
            if state.attempt > self.cfg.max_retries:
                raise last_error
            self._retrying(gen.request_id, state.attempt, last_error)

    def _retrying(self, request_id: str, attempt: int, error: EngineError) -> None:
        self.metrics.retries.inc()
        tracing.event("retry", {"shepherd.retry.attempt": attempt, "error.type": error.code})
        log.info("retrying request %s on another worker after: %s", request_id, error)

    def retry_midway(self, es: EngineStream, e: BaseException, state: Retry) -> bool:
        """Whether a whole (non-streamed) answer whose engine failed after its first token, nothing of it
        sent to the client yet, is asked again from the start on another worker: a retryable engine
        failure (not the request's fault, nor its deadline), no worker named by the client, not a PD
        pair, attempts left. Then the worker is counted as failed and left out of the next pick."""
        if (
            not isinstance(e, EngineError)
            or not e.retryable
            or e.code in ("invalid_request", "engine_timeout")
            or self.pd is not None
            or state.attempt >= self.cfg.max_retries
        ):
            return False
        w = es.worker
        self.registry.record_result(w, False)
        state.tried.add(w.id)
        state.attempt += 1
        self._retrying(es.request_id, state.attempt, client_error(e, w))
        return True

    async def embed(
        self,
        model: str,
        request_id: str,
        ids: Sequence[int],
        *,
        target: str | None = None,
        routing_key: str | None = None,
    ) -> EmbedResult:
        """The embedding of ``ids`` from a worker of ``model`` (its policy's pick, as ``open_stream``),
        retried on another worker when the call fails retryably (at most ``max_retries`` times, never on
        the worker that failed it). The worker's ``in_flight`` is raised for the call."""
        tried: set[str] = set()
        last_error: EngineError | None = None
        for attempt in range(self.cfg.max_retries + 1):
            if target is not None:
                w = self.registry.find(target)
                if w is None or w.model != model:
                    raise ApiError(400, f"x-smg-target-worker {target!r} is not a worker of model {model!r}.")
            else:
                w = self.pick(model, tried, ids, routing_key)
            if w is None:
                break
            client = w.client
            if not isinstance(client, EmbedClient):
                w.breaker.release()
                raise ApiError(
                    400, f"worker {w.id} is an HTTP worker; model {model!r} is served over gRPC here."
                )
            if attempt:
                self.metrics.retries.inc()
            rid = request_id if attempt == 0 else f"{request_id}-r{attempt}"
            w.in_flight += 1
            call = (  # the CLIENT span of this call (tracing on)
                tracing.engine_call(model, rid, None, w.url, client.kind, attempt)
                if tracing.ENABLED
                else None
            )
            try:
                pending = client.embed(rid, ids, timeout=self.cfg.request_timeout_secs)
                got = await (pending if call is None else call.first(pending))
            except EngineError as e:
                if e.code == "invalid_request":  # the request's fault, not the worker's
                    w.breaker.release()
                    raise client_error(e, w) from None
                self.registry.record_result(w, False)
                last_error = client_error(e, w)
                if not e.retryable or target is not None:
                    raise last_error from None
                tried.add(w.id)
                continue
            except BaseException:
                w.breaker.release()
                raise
            finally:
                w.in_flight -= 1
            if call is not None:
                call.span.set_attribute("gen_ai.usage.input_tokens", len(ids))
                call.end()
            self.registry.record_result(w, True)
            return got
        if last_error is not None:
            raise last_error
        raise no_healthy_worker(f"No healthy worker is available for model '{model}'.")

    def abort_in_background(self, w: Worker, request_id: str, reason: str) -> None:
        self.metrics.aborts.labels(reason, w.model).inc()
        client = w.client
        abort = getattr(client, "abort", None)
        if abort is not None:
            w.in_flight += 1  # the Abort is work on the worker: a removed one's client stays open for it
            self.spawn(_counted(w, abort(request_id, reason)))

    # ---- metrics ------------------------------------------------------------------------------------

    def _collect(self) -> list[Any]:
        ws = list(self.registry.workers.values())
        stats = self.tokenizers.stats()
        return [
            gauge(
                "smg_worker_healthy",
                "1 if the worker is healthy",
                ["worker", "model"],
                [([w.url, w.model], float(w.health.healthy)) for w in ws],
            ),
            gauge(
                "smg_worker_in_flight",
                "This node's requests on the worker",
                ["worker"],
                [([w.url], float(w.in_flight)) for w in ws],
            ),
            gauge(
                "smg_worker_circuit_open",
                "1 if the worker's circuit breaker is open",
                ["worker"],
                [([w.url], float(w.breaker.state.value != "closed")) for w in ws],
            ),
            gauge(
                "smg_engine_running_requests",
                "Running requests the engine reports",
                ["worker"],
                [([w.url], float(w.load.running)) for w in ws],
            ),
            gauge(
                "smg_engine_waiting_requests",
                "Waiting requests the engine reports",
                ["worker"],
                [([w.url], float(w.load.waiting)) for w in ws],
            ),
            counter(
                "smg_tokenizer_cache",
                "Tokenizer cache lookups by level and result",
                ["level", "result"],
                _cache_rows(stats),
            ),
        ]


def _cache_rows(stats: dict[str, int]) -> list[tuple[list[str], float]]:
    rows = []
    for key, val in stats.items():
        # keys like "l0_hits", "l1_misses", "render_hits"
        level, _, result = key.rpartition("_")
        if level and result in ("hits", "misses"):
            rows.append(([level, result], float(val)))
    return rows


_ENGINE_FAILED = frozenset({"abort", "error"})  # SGLang's abort, vLLM's error (generation.ENGINE_FAILED)


async def _counted(w: Worker, call: Coroutine[Any, Any, Any]) -> None:
    try:
        await call
    finally:
        w.in_flight -= 1


_MAX_EMPTY_FIRST = 64  # messages without a token read before a stream is handed on


def _tokenless(batch: list[EngineEvent]) -> bool:
    """Only chunks without tokens (SMG's SGLang servicer sends an empty one before an abort)."""
    return all(isinstance(ev, EngineChunk) and not ev.token_ids for ev in batch)


async def _every_choice(
    agen: Batches, first: list[EngineEvent], n: int, max_new: int | None = None
) -> list[EngineEvent]:
    """A call without streaming: ``first`` and what follows until ``n`` choices completed, one failed
    ("abort", "error") or the stream ended. So a failure of any choice (SGLang's n > 1 sends one Complete
    per choice, each in its own message) is seen before anything is answered, and can be retried.
    Streamed tokens past what the call asked for (``n`` x ``max_new``: an engine that does not stop) end
    the wait: the generation loop takes the rest, cuts each choice at its bound and aborts the call."""
    events = list(first)
    done = 0
    tokens = 0
    bound = None if max_new is None else n * max_new
    for ev in events:
        if type(ev) is EngineComplete:
            if ev.finish_reason in _ENGINE_FAILED:
                return events
            done += 1
        elif isinstance(ev, EngineChunk):
            tokens += len(ev.token_ids)
    while done < n:  # bounded by the engine's stream, which ends after its last Complete, and by max_new
        if bound is not None and tokens > bound:
            break
        try:
            batch = await anext(agen)
        except StopAsyncIteration:  # the stream ended short: the generation loop says so (a 502)
            break
        events.extend(batch)
        for ev in batch:
            if type(ev) is EngineComplete:
                if ev.finish_reason in _ENGINE_FAILED:
                    return events
                done += 1
            elif isinstance(ev, EngineChunk):
                tokens += len(ev.token_ids)
    return events


def _failed_first(first: list[EngineEvent], stream: bool) -> str | None:
    """The finish reason when the first events of a stream end a choice as failed ("abort", "error")
    before any token of it could reach the client (a streamed call: no token before; a call without
    streaming: whatever it carries, nothing was sent yet), else None."""
    for ev in first:
        if isinstance(ev, EngineChunk):
            if stream and ev.token_ids:
                return None
        elif type(ev) is EngineComplete and ev.finish_reason in _ENGINE_FAILED:
            if stream and ev.output_ids:
                return None
            return ev.finish_reason
    return None


def _with_id(gen: GenerateRequest, rid: str) -> GenerateRequest:
    return replace(gen, request_id=rid)


class EngineFacts:
    """What a model's engines report that shapes requests (``Gateway.engine_facts``)."""

    __slots__ = ("defaults", "divergent", "skip_tokenizer_init")

    def __init__(self, defaults: SamplingDefaults | None, skip_tokenizer_init: bool, divergent: bool) -> None:
        self.defaults = defaults
        self.skip_tokenizer_init = skip_tokenizer_init
        self.divergent = divergent


def _facts(out: Sequence[ModelInfo], every: Sequence[ModelInfo]) -> EngineFacts:
    """``out``: the infos of the workers whose sampling counts; ``every``: all the model's workers'."""
    votes: dict[SamplingDefaults | None, int] = {}
    for info in out:
        votes[info.sampling_defaults] = votes.get(info.sampling_defaults, 0) + 1
    defaults = max(votes, key=lambda d: votes[d]) if votes else None  # (ties: the first seen)
    return EngineFacts(defaults, any(i.skip_tokenizer_init for i in every), len(votes) > 1)
