"""The node's log lines: text (the default) or one JSON object a line (``--log-format json``) carrying the
request id and the trace id of the request it was written for; an optional access log (``--access-log``,
one line per request); and secrets redacted from every line, whatever its format or logger.

Redacted: the values of ``Authorization`` / ``x-api-key`` / ``api_key`` / ``password`` / ``secret`` /
``token`` fields, bearer credentials, API keys of the ``sk-`` form, the password of a URL
(``postgresql://user:***@host``), and the literal secrets the configuration names (mesh keys, the keyring
file's keys, API keys and the JWT HMAC secret read from their environment variables).
"""

from __future__ import annotations

import contextvars
import logging
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any
from urllib.parse import unquote_plus, urlsplit

import orjson
from aiohttp import web

from shepherd.node.config import NodeConfig
from shepherd.node.observe import tracing

__all__ = [
    "ACTIVE",
    "JsonFormatter",
    "Redactor",
    "bind_request",
    "config_secrets",
    "configure",
    "redact",
    "request_context",
]

ACTIVE = False  # a JSON format or the access log is on: requests bind their ids (else nothing is done)
ACCESS = False
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("smg_request_id", default=None)
# the trace id of the request's incoming traceparent, for logs while tracing itself is off
_HEADER_TRACE: contextvars.ContextVar[str | None] = contextvars.ContextVar("smg_header_trace", default=None)
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$")

access_log = logging.getLogger("shepherd.access")

_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # a URL's password: scheme://user:password@host
    (re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]*):([^@\s/]+)@"), r"\1:***@"),
    # "authorization: Bearer x", "x-api-key=x", "'password': 'x'", "api_key=x", "token: x"
    (
        re.compile(
            r"(?i)((?:authorization|proxy-authorization|x-api-key|api[_-]?key|password|passwd|secret|"
            r"access[_-]?token|token)[\"']?\s*[:=]\s*[\"']?)(?:(bearer|basic)\s+)?[^\s\"',;&}]+"
        ),
        r"\1\2 ***",
    ),
    (re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{4,}"), r"\1 ***"),
    (re.compile(r"\bsk-[A-Za-z0-9_-]{6,}"), "sk-***"),
)
_literals: list[str] = []


def add_secrets(values: Iterable[str | None]) -> None:
    """Literal secrets to redact wherever they appear (at least 6 characters: shorter ones are not
    secrets one could redact without mangling ordinary text)."""
    for v in values:
        if v and len(v) >= 6 and v not in _literals:
            _literals.append(v)
    _literals.sort(key=len, reverse=True)


def config_secrets(cfg: NodeConfig, env: Mapping[str, str] = os.environ) -> list[str]:
    """The literal secrets ``cfg`` names: mesh keys (flags and keyring file), the bootstrap API keys and
    the JWT HMAC secret held in environment variables, the history and rate-limit Redis URLs' passwords."""
    out: list[str] = list(cfg.mesh_keys)
    if cfg.mesh_keyring_file:
        try:
            with open(cfg.mesh_keyring_file, encoding="utf-8") as f:
                out.extend(line.strip() for line in f if line.strip() and not line.startswith("#"))
        except OSError:
            pass
    out.extend(env.get(key.env, "") for key in cfg.auth.keys if key.env)
    if cfg.auth.jwt.hmac_secret_env:
        out.append(env.get(cfg.auth.jwt.hmac_secret_env, ""))
    for url in (cfg.history_url, cfg.rate_limit_redis_url):
        if not url:
            continue
        try:
            password = urlsplit(url).password
        except ValueError:
            password = None
        out.append(password or "")
    return [s for s in out if s]


def redact(text: str) -> str:
    for lit in _literals:
        if lit in text:
            text = text.replace(lit, "***")
    for pattern, repl in _PATTERNS:
        text = pattern.sub(repl, text)
    return text


class Redactor(logging.Filter):
    """Rewrites a record's message (and its formatted exception) with the secrets redacted."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # a malformed call: keep what can be shown
            msg = str(record.msg)
        clean = redact(msg)
        if clean != msg or record.args:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


def _trace_id() -> str | None:
    if tracing.ENABLED:
        return tracing.current_trace_id()
    return _HEADER_TRACE.get()


# control characters a client's text (a decoded path, a header) could bring into a line: a line break
# would forge a line of its own, an ANSI escape would rewrite the terminal showing it
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, 0x85) if c != 0x09} | {
    0x0A: "\\n",
    0x0D: "\\r",
    0x2028: "\\u2028",
    0x2029: "\\u2029",
}


def _escaped(text: str) -> str:
    return text.translate(_CONTROLS) if not text.isprintable() else text


class TextFormatter(logging.Formatter):
    """The default text lines, with ``rid=`` / ``trace=`` when the line belongs to a request; the message
    one line whatever it quotes (control characters escaped; a traceback follows as it is)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = _escaped(record.message)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        rid = REQUEST_ID.get()
        tid = _trace_id()
        if rid or tid:
            line += "".join((f" rid={_escaped(rid)}" if rid else "", f" trace={tid}" if tid else ""))
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, ``request_id`` and ``trace_id`` (when the
    line belongs to a request), the access log's fields, the exception."""

    def format(self, record: logging.LogRecord) -> str:
        d: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = REQUEST_ID.get()
        if rid:
            d["request_id"] = rid
        tid = _trace_id()
        if tid:
            d["trace_id"] = tid
        fields = getattr(record, "access", None)
        if isinstance(fields, dict):
            d.update(fields)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            d["exc"] = record.exc_text
        return orjson.dumps(d, default=str).decode()


def configure(
    level: str, fmt: str = "text", access: bool = False, secrets: Iterable[str | None] = ()
) -> None:
    """The root logger's one handler (stderr): its format, the redaction filter; the access log on or
    off. Called once by ``smg-node`` at start-up."""
    global ACTIVE, ACCESS
    add_secrets(secrets)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(Redactor())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    access_log.setLevel(logging.INFO)
    ACCESS = access
    ACTIVE = fmt == "json" or access


def bind_request(rid: str) -> None:
    """The request's id (the one its answer carries) on the lines logged for it from here on."""
    if ACTIVE:
        REQUEST_ID.set(rid)


# query parameters whose values are credentials in some client's habit (Google-style ``?key=``, Azure's
# ``subscription-key``, signed URLs' ``sig`` / ``signature`` / ``X-Amz-*``, OAuth's ``code`` and
# ``*_token``, ``access_key``, ``private_key``, ``jwt``...): their values are *** in the access log
_SECRET_PARAM = re.compile(
    r"(?i)^(?:[\w.-]*[-_.])?(key|secret|token|password|passwd|pwd|credentials?|signature|sig|jwt|auth\w*|"
    r"session\w*)$|^(code|x-amz-[\w-]+|x-goog-[\w-]+|(?:api|access|secret|auth|private|subscription)(?:key|token))$"
)
_QUERY_SEP = re.compile(r"([&;])")


def _safe_path(request: web.Request) -> str:
    """The request's path and query for the access log: a credential parameter's value (by its name, or
    a value holding a configured secret once decoded) as ***; the rest as sent (``&`` or ``;``)."""
    qs = request.query_string
    if not qs:
        return request.path
    out: list[str] = []
    for part in _QUERY_SEP.split(qs):
        name, eq, value = part.partition("=")
        if part in ("&", ";") or not eq:
            out.append(part)
            continue
        plain = unquote_plus(value)
        secret = _SECRET_PARAM.match(unquote_plus(name)) is not None or redact(plain) != plain
        out.append(f"{name}=***" if secret else part)
    return request.path + "?" + redact("".join(out))


@web.middleware
async def request_context(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Binds the request's ids to its log lines (the client's ``x-request-id`` until the handler names
    its own) and writes its access line (installed only when JSON logs or the access log are on)."""
    rid = request.headers.get("x-request-id")
    token = REQUEST_ID.set(rid if rid and len(rid) <= 128 and rid.isprintable() else None)
    tp = request.headers.get("traceparent")
    m = _TRACEPARENT.match(tp.strip().lower()) if tp else None
    ttoken = _HEADER_TRACE.set(m.group(1) if m else None)
    t0 = time.perf_counter()
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        got = resp.headers.get("x-request-id")
        if got:
            REQUEST_ID.set(got)
        return resp
    except BaseException:
        status = 499
        raise
    finally:
        if ACCESS:
            ms = (time.perf_counter() - t0) * 1000.0
            fields = {
                "method": request.method,
                "path": _safe_path(request),
                "status": status,
                "duration_ms": round(ms, 3),
                "remote": request.remote or "",
            }
            access_log.info(
                "%s %s %d %.1fms", request.method, fields["path"], status, ms, extra={"access": fields}
            )
        REQUEST_ID.reset(token)
        _HEADER_TRACE.reset(ttoken)
