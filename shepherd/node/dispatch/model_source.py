"""Model identity and tokenizer from the engine: a node started with gRPC workers and no ``--model-path``
asks a worker of the model for ``GetModelInfo`` (the served name) and ``GetTokenizer`` (the tokenizer
directory as a zip, its sha256 on the last chunk), as SMG does for gRPC workers.

The zip is verified against its sha256 (a mismatch is refused) and kept in the tokenizer cache
(``--tokenizer-cache-dir``, default ``$XDG_CACHE_HOME/shepherd/tokenizers`` or
``~/.cache/shepherd/tokenizers``), extracted once per sha256 into ``<cache>/<sha256>/`` beside the zip
(checked against its sha256 on every use); ``by-model/<key>`` names the sha256 a model (engine kind,
served name, model path, vocabulary size) was given, so a restart reuses it without GetTokenizer. One
worker of the model is asked; every worker, every restart and every node on the machine share it.
Writes are atomic (a temporary name, then a rename): nodes starting together never read half a file.

Aliases (``--model-alias NAME=SERVED``) rename a model: NAME is what clients send and what
``/v1/models`` lists; the served name stays the engine's (``root`` in ``/v1/models``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import io
import logging
import os
import shutil
import tempfile
import zipfile
from collections.abc import Awaitable, Callable
from pathlib import Path, PurePosixPath

from shepherd.auth.tls import EngineTls
from shepherd.node.config import ConfigError, ModelConfig, NodeConfig, WorkerAllow
from shepherd.node.dispatch.workers import ADMIT_TIMEOUT_MAX_SECS
from shepherd.node.engines.grpcio import GrpcEngineClient
from shepherd.node.engines.h2 import H2EngineClient
from shepherd.node.engines.kinds import SERVICE_KINDS, ServiceClient, service_client, settle_kind
from shepherd.proto.engine_types import EngineError, ModelInfo

log = logging.getLogger("shepherd.model_source")

GRPC_SCHEMES = ("grpc", "grpcs", "sglang", "vllm", *SERVICE_KINDS)
STARTUP_RETRY_S, STARTUP_RETRY_MAX_S = 1.0, 5.0  # asking the workers again at start-up (back-off)
STARTUP_LOG_S = 30.0  # and saying so this often
MAX_ZIP_BYTES = 256 * 1024 * 1024  # a tokenizer directory is a few MB; anything this large is refused
MAX_FILE_BYTES = 512 * 1024 * 1024  # uncompressed, all files together (zip bombs)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "shepherd" / "tokenizers"


def parse_aliases(items: tuple[str, ...]) -> dict[str, str]:
    """``NAME=SERVED`` items -> {SERVED: NAME}; a malformed one is a ``ConfigError``."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, served = item.partition("=")
        if not sep or not name.strip() or not served.strip():
            raise ConfigError(f"--model-alias {item!r}: expected NAME=SERVED")
        out[served.strip()] = name.strip()
    return out


class TokenizerCache:
    """Verified tokenizer zips, extracted per sha256 under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path_of(self, sha: str) -> Path:
        return self.root / sha

    def lookup(self, sha: str) -> Path | None:
        """The extracted directory of ``sha`` when it is there and its zip still verifies."""
        d = self.path_of(sha)
        z = self.root / f"{sha}.zip"
        if not d.is_dir() or not z.is_file():
            return None
        if hashlib.sha256(z.read_bytes()).hexdigest() != sha:
            return None
        return d

    def indexed(self, key: str) -> Path | None:
        """The verified directory a model's ``key`` (``model_key``) was last given, if still there."""
        f = self.root / "by-model" / key
        try:
            sha = f.read_text().strip()
        except OSError:
            return None
        return self.lookup(sha) if len(sha) == 64 else None

    def index(self, key: str, sha: str) -> None:
        d = self.root / "by-model"
        d.mkdir(parents=True, exist_ok=True)
        part = d / f".{key}.{os.getpid()}"
        part.write_text(sha)
        os.replace(part, d / key)

    def store(self, data: bytes, sha: str) -> Path:
        """Verify ``data`` against ``sha`` and extract it (once); raises ``ValueError`` on a mismatch or a
        zip that is not a flat tokenizer directory."""
        got = hashlib.sha256(data).hexdigest()
        if sha and got != sha.lower():
            raise ValueError(f"tokenizer zip sha256 mismatch: the engine said {sha}, the bytes are {got}")
        sha = got
        hit = self.lookup(sha)
        if hit is not None:
            return hit
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{sha[:12]}-", dir=self.root))
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as zf:
                if sum(i.file_size for i in zf.infolist()) > MAX_FILE_BYTES:
                    raise ValueError(f"the tokenizer zip holds over {MAX_FILE_BYTES} bytes")
                for info in zf.infolist():
                    if info.is_dir():
                        continue
                    name = PurePosixPath(info.filename)
                    if name.is_absolute() or ".." in name.parts or len(name.parts) != 1:
                        raise ValueError(f"tokenizer zip entry {info.filename!r} is not a plain file name")
                    if info.file_size > MAX_FILE_BYTES:
                        raise ValueError(f"tokenizer zip entry {info.filename!r} is too large")
                    (tmp / name.name).write_bytes(zf.read(info))
            zpart = self.root / f".{sha}.zip.{os.getpid()}"
            zpart.write_bytes(data)
            final = self.path_of(sha)
            try:
                tmp.rename(final)
            except OSError:  # another node extracted it meanwhile: theirs is the same bytes
                if not final.is_dir():
                    raise
            os.replace(zpart, self.root / f"{sha}.zip")
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return self.path_of(sha)


def model_key(kind: str, info: ModelInfo) -> str:
    """What names one model's tokenizer across restarts: the engine kind, served name, model path and
    vocabulary size (hashed: a file name)."""
    raw = f"{kind}\0{info.served_model_name}\0{info.model_path}\0{info.vocab_size}"
    return hashlib.sha256(raw.encode()).hexdigest()


def _client(url: str, cfg: NodeConfig) -> H2EngineClient | GrpcEngineClient | ServiceClient:
    """A gRPC client for ``url`` as the registry makes it (TLS when the node's engine TLS is set or the
    URL is ``grpcs://``; ``trtllm://`` and ``mlx://`` their own client over that connection)."""
    scheme, _, rest = url.partition("://")
    kind = scheme if scheme in ("sglang", "vllm") else None
    target = rest.rstrip("/")
    tls = EngineTls.configured(cfg.engine_tls_ca_file, cfg.engine_tls_cert_file, cfg.engine_tls_key_file)
    if tls is None and scheme == "grpcs":
        tls = EngineTls()
    base: H2EngineClient | GrpcEngineClient
    if cfg.engine_transport == "grpcio":
        base = GrpcEngineClient(url, target, kind, tls.grpc_credentials() if tls else None)
    else:
        # the node's worker_allow, as the registry's clients have it: a name resolving to a metadata
        # address is not dialed at start either
        allow = WorkerAllow(cfg.worker_allow)
        base = H2EngineClient(url, target, kind, tls=tls.ssl_context() if tls else None, allow=allow)
    return service_client(url, scheme, base) if scheme in SERVICE_KINDS else base


Probe = tuple[H2EngineClient | GrpcEngineClient | ServiceClient, str, ModelInfo]
Waiting = Callable[[], Awaitable[None]]


async def _probe(url: str, cfg: NodeConfig, timeout: float) -> Probe:
    """(an open client, the engine's kind, its GetModelInfo) of the worker at ``url``: a ``grpc://``
    worker's kind detected as the registry does (``kinds.settle_kind``: SGLang, vLLM, TensorRT-LLM or
    MLX), so every kind's GetTokenizer is asked."""
    client = _client(url, cfg)
    try:
        if isinstance(client, H2EngineClient | GrpcEngineClient):
            async with asyncio.timeout(timeout):
                client = await settle_kind(client, timeout)
        if isinstance(client, H2EngineClient | GrpcEngineClient):
            async with asyncio.timeout(timeout):
                kind = await client.detect(timeout)
        else:
            kind = client.kind
        async with asyncio.timeout(timeout):
            info = await client.model_info(timeout)
    except BaseException:
        with contextlib.suppress(Exception):
            await client.close()
        raise
    return client, kind, info


async def first_answer(
    urls: list[str], cfg: NodeConfig, timeout: float, what: str, level: int = logging.WARNING
) -> Probe | None:
    """The first of ``urls`` to answer GetModelInfo, all asked at once and within ``timeout`` in all (a
    dead or unreachable worker costs no more than that); the other clients are closed. Each failure
    logged at ``level``."""
    tasks = [asyncio.create_task(_probe(u, cfg, timeout)) for u in urls]
    winner: Probe | None = None
    try:
        for fut in asyncio.as_completed(tasks, timeout=timeout + 1):
            try:
                winner = await fut
                break
            except (EngineError, TimeoutError, OSError) as e:
                why = str(e) or f"no answer within {timeout:g} s"
                log.log(level, "model %s: a worker did not answer GetModelInfo: %s", what, why)
    except TimeoutError:
        log.log(level, "model %s: no worker answered GetModelInfo in %.0f s", what, timeout + 1)
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                got = await t
                if winner is None or got[0] is not winner[0]:
                    await got[0].close()
    return winner


async def _wait_for_answer(
    urls: list[str], cfg: NodeConfig, timeout: float, what: str, waiting: Waiting | None = None
) -> Probe | None:
    """``first_answer``, asked again (every 1 s, backing off to 5 s; each round's deadline doubling, up to
    ``ADMIT_TIMEOUT_MAX_SECS``: an engine too busy to answer in time is heard once it answers within
    that) until one answers or ``worker_startup_timeout_secs`` is over: a node started beside its
    engines (compose, Kubernetes) starts before they have loaded their weights, and must not settle on a
    default model meanwhile. ``waiting`` is awaited once, when the first ask went unanswered (the start
    will wait)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + cfg.worker_startup_timeout_secs
    pause, said, level = STARTUP_RETRY_S, loop.time(), logging.WARNING
    while True:
        probe = await first_answer(urls, cfg, timeout, what, level)
        level = logging.DEBUG  # (said once; then every STARTUP_LOG_S below)
        left = deadline - loop.time()
        if probe is not None or left <= 0:
            return probe
        if waiting is not None:
            await waiting()
            waiting = None
        if loop.time() - said >= STARTUP_LOG_S:
            said = loop.time()
            log.warning("model %s: waiting for a gRPC worker to answer (%.0f s left)", what, left)
        await asyncio.sleep(min(pause, left))
        pause = min(STARTUP_RETRY_MAX_S, pause * 2)
        timeout = min(ADMIT_TIMEOUT_MAX_SECS, timeout * 2)


async def fetch_model(probe: Probe, cache: TokenizerCache, timeout: float) -> tuple[ModelInfo, Path]:
    """(GetModelInfo, the cached tokenizer directory) from the worker ``probe`` reached (closed after)."""
    client, kind, info = probe
    try:
        key = model_key(kind, info)
        hit = await asyncio.to_thread(cache.indexed, key)
        if hit is not None:  # this model's tokenizer, fetched before and still verifying
            return info, hit
        data, sha = await client.get_tokenizer(timeout=max(timeout, 60.0))
        if len(data) > MAX_ZIP_BYTES:
            raise EngineError(f"the tokenizer zip is {len(data)} bytes (over {MAX_ZIP_BYTES})")
        path = await asyncio.to_thread(cache.store, data, sha)
        await asyncio.to_thread(cache.index, key, path.name)
        return info, path
    finally:
        with contextlib.suppress(Exception):
            await client.close()


async def resolve_models(cfg: NodeConfig, waiting: Waiting | None = None) -> NodeConfig:
    """``cfg`` with every model that has no tokenizer path of its own given one from its engines (and,
    for the top-level flags without ``--model-id``, the engine's served name), then the aliases applied.
    A model whose engines all fail to answer keeps the embedded default tokenizer (logged loudly).
    ``waiting`` is awaited when the start is going to wait for engines (once per model that waits)."""
    aliases = parse_aliases(cfg.model_aliases)
    cache = TokenizerCache(Path(cfg.tokenizer_cache_dir) if cfg.tokenizer_cache_dir else default_cache_dir())
    timeout = cfg.health_check_timeout_secs + 3
    if cfg.models:
        wanted = list(cfg.models)
        from_flags = False
    elif cfg.model_path:
        wanted = list(cfg.model_configs())
        from_flags = True
    else:
        urls = cfg.worker_urls
        if cfg.pd_disaggregation:
            urls = (*urls, *cfg.prefill_urls, *cfg.decode_urls)
        wanted = [ModelConfig(cfg.model_id or "", "", worker_urls=urls, chat_template=cfg.chat_template)]
        from_flags = True
    out: list[ModelConfig] = []
    changed = False

    def grpc_urls_of(mc: ModelConfig) -> list[str]:
        return [u for u in mc.worker_urls if u.partition("://")[0] in GRPC_SCHEMES]

    async def answer(mc: ModelConfig) -> Probe | None:
        urls = grpc_urls_of(mc)
        if mc.model_path or not urls:
            return None
        what = repr(mc.name or "?")
        if from_flags and mc.name:  # --model-id named it: asked once, the embedded tokenizer meanwhile
            return await first_answer(urls, cfg, timeout, what)
        # its name unknown (no --model-id), or a models: entry (refused without its tokenizer): waited for
        return await _wait_for_answer(urls, cfg, timeout, what, waiting)

    # every model's engines waited for at once (not one model's start-up timeout after another's)
    probes = await asyncio.gather(*(answer(mc) for mc in wanted))
    for mc, probe in zip(wanted, probes, strict=True):
        if not mc.model_path:
            grpc_urls = grpc_urls_of(mc)
            got: tuple[ModelInfo, Path] | None = None
            what = repr(mc.name or "?")
            if probe is not None:
                try:
                    got = await fetch_model(probe, cache, timeout)
                except (EngineError, TimeoutError, OSError, ValueError, zipfile.BadZipFile) as e:
                    log.warning("model %s: no tokenizer from worker %s: %s", what, probe[0].url, e)
            if got is not None:
                info, path = got
                served = info.served_model_name or Path(info.model_path).name or path.name
                mc = dataclasses.replace(mc, model_path=str(path), name=mc.name or served, served_name=served)
                log.info("model %r: tokenizer and chat template from the engine (%s)", mc.name, path)
            elif from_flags:
                if grpc_urls:
                    log.warning(
                        "no gRPC worker answered GetModelInfo/GetTokenizer at start-up: serving with the "
                        "embedded default tokenizer; give --model-path for the model's own"
                    )
                continue  # the flags as they are (model_configs(): the embedded tokenizer)
            else:
                raise ConfigError(
                    f"model {mc.name!r}: no model_path and no gRPC worker gave its tokenizer at start-up"
                )
            changed = True
        alias = aliases.get(mc.served_name or mc.name) or aliases.get(mc.name)
        if alias is not None and alias != mc.name:
            mc = dataclasses.replace(mc, name=alias, served_name=mc.served_name or mc.name)
            changed = True
        out.append(mc)
    if not changed:
        return cfg if not aliases else _alias_flags(cfg, aliases)
    if from_flags and len(out) != 1:
        return cfg
    return dataclasses.replace(cfg, models=tuple(out))


def _alias_flags(cfg: NodeConfig, aliases: dict[str, str]) -> NodeConfig:
    """Aliases over the top-level flags' model (embedded tokenizer or ``--model-path``)."""
    if cfg.models:
        return cfg
    (mc,) = cfg.model_configs()
    alias = aliases.get(mc.name)
    if alias is None:
        return cfg
    return dataclasses.replace(cfg, models=(dataclasses.replace(mc, name=alias, served_name=mc.name),))
