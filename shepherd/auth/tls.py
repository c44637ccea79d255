"""TLS material: the client-facing server context (with reload without restart) and engine client TLS.

Server: ``server_context`` builds the SSLContext of the client port (TLS 1.2+, client certificates
checked against a CA for mTLS: required, or optional with ``auth.client_cert.verify: optional``; what a
verified certificate may do is ``shepherd.auth.client_cert``'s). ``ServerTls`` keeps that one live
context and reloads the certificate and key into it when their files change (a bounded periodic check
of mtime/size/inode) or on SIGHUP: ``load_cert_chain`` on the live context applies to every new
handshake, connections already open keep their certificate. A pair is checked in a scratch context
first: a failed reload (e.g. the certificate written before its key) keeps the old pair and is retried
at the next check. Renewed client CAs are added to the trust store (OpenSSL cannot remove a CA from a
live context: removing one takes a restart).

Engines: ``EngineTls`` names a CA bundle (default: the system's) and an optional client certificate
and key (mTLS). The lean h2 client gets an SSLContext with ALPN ``h2``; grpcio gets
``grpc.ssl_channel_credentials``. Contexts are built once per material.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc

log = logging.getLogger("shepherd.tls")


class TlsConfigError(ValueError):
    """TLS settings that do not go together, or files that cannot be loaded."""


def server_context(
    cert_file: str, key_file: str, client_ca_file: str | None = None, *, client_cert_optional: bool = False
) -> ssl.SSLContext:
    """With ``client_ca_file``, clients must present a certificate from it (``client_cert_optional``:
    they may present none; one presented is still verified, and a bad one fails the handshake)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_file, key_file)
    if client_ca_file:
        ctx.load_verify_locations(cafile=client_ca_file)
        ctx.verify_mode = ssl.CERT_OPTIONAL if client_cert_optional else ssl.CERT_REQUIRED
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


FileSig = tuple[int, int, int]


def _load_checked(live: ssl.SSLContext, cert_file: str, key_file: str) -> None:
    """Load a certificate and key into a live context only once they are known to be a pair: a failed
    ``load_cert_chain`` leaves a context with the new certificate and the old key, which fails every
    handshake. The bytes are read once and loaded from a private copy into a scratch context, then
    into the live one, so a file replaced in between cannot break it."""
    cert, key = Path(cert_file).read_bytes(), Path(key_file).read_bytes()
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="smg-tls-", dir=shm) as d:
        c, k = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
        for path, data in ((c, cert), (k, key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(c, k)
        live.load_cert_chain(c, k)


def _sig(path: str) -> FileSig | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class ServerTls:
    """The client port's live SSLContext and its reloader."""

    def __init__(
        self,
        cert_file: str,
        key_file: str,
        client_ca_file: str | None = None,
        reload_interval_secs: float = 10.0,
        *,
        client_cert_optional: bool = False,
    ) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.client_ca_file = client_ca_file
        self.interval = reload_interval_secs
        self.context = server_context(
            cert_file, key_file, client_ca_file, client_cert_optional=client_cert_optional
        )
        self.reloads = 0  # successful reloads (observability and tests)
        self._sigs = self._current()
        self._failed: tuple[FileSig | None, ...] | None = None
        self._task: asyncio.Task[None] | None = None
        self._sighup = False

    def _current(self) -> tuple[FileSig | None, ...]:
        files = [self.cert_file, self.key_file] + ([self.client_ca_file] if self.client_ca_file else [])
        return tuple(_sig(f) for f in files)

    def reload(self, force: bool = False) -> bool:
        """Load the files again when they changed (or ``force``); True when the context was updated."""
        sigs = self._current()
        if not force and (sigs == self._sigs or None in sigs):
            return False
        try:
            _load_checked(self.context, self.cert_file, self.key_file)
            if self.client_ca_file and sigs[2:] != self._sigs[2:]:
                self.context.load_verify_locations(cafile=self.client_ca_file)
        except (ssl.SSLError, OSError) as e:
            if sigs != self._failed:  # say it once per version of the files
                log.warning("TLS certificate reload failed, keeping the current one: %s", e)
                self._failed = sigs
            return False
        self._sigs = sigs
        self._failed = None
        self.reloads += 1
        log.info("TLS certificate reloaded from %s", self.cert_file)
        return True

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.reload()

    def start(self, sighup: bool = True) -> None:
        """Check the files every ``interval`` seconds (0: never) and reload on SIGHUP."""
        loop = asyncio.get_running_loop()
        if self.interval > 0:
            self._task = loop.create_task(self._watch())
        if sighup:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(signal.SIGHUP, functools.partial(self.reload, True))
                self._sighup = True

    async def close(self) -> None:
        if self._sighup:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            self._sighup = False
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


@dataclass(frozen=True, slots=True)
class EngineTls:
    """TLS to gRPC engines: a CA bundle (None: the system's) and an optional client cert/key (mTLS)."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    @classmethod
    def configured(cls, ca_file: str | None, cert_file: str | None, key_file: str | None) -> EngineTls | None:
        """The material when any is given, else None (plaintext unless the URL is ``grpcs://``)."""
        if ca_file is None and cert_file is None and key_file is None:
            return None
        return cls(ca_file, cert_file, key_file)

    def ssl_context(self) -> ssl.SSLContext:
        return _client_context(self)

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        return _grpc_credentials(self)


@functools.cache
def _client_context(t: EngineTls) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=t.ca_file)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if t.cert_file:
        ctx.load_cert_chain(t.cert_file, t.key_file)
    ctx.set_alpn_protocols(["h2"])
    return ctx


@functools.cache
def _grpc_credentials(t: EngineTls) -> grpc.ChannelCredentials:
    def read(p: str | None) -> bytes | None:
        return Path(p).read_bytes() if p else None

    return grpc.ssl_channel_credentials(
        root_certificates=read(t.ca_file), private_key=read(t.key_file), certificate_chain=read(t.cert_file)
    )


def check_settings(
    cert_file: str | None,
    key_file: str | None,
    client_ca_file: str | None,
    engine_ca_file: str | None,
    engine_cert_file: str | None,
    engine_key_file: str | None,
) -> None:
    """Pairs that go together, and files that load (so a bad path fails the node at start)."""
    if bool(cert_file) != bool(key_file):
        raise TlsConfigError("tls_cert_file and tls_key_file go together")
    if client_ca_file and not cert_file:
        raise TlsConfigError("tls_client_ca_file needs tls_cert_file and tls_key_file")
    if bool(engine_cert_file) != bool(engine_key_file):
        raise TlsConfigError("engine_tls_cert_file and engine_tls_key_file go together")
    try:
        if cert_file and key_file:
            server_context(cert_file, key_file, client_ca_file)
        t = EngineTls.configured(engine_ca_file, engine_cert_file, engine_key_file)
        if t is not None:
            _client_context(t)
    except (ssl.SSLError, OSError) as e:
        raise TlsConfigError(f"cannot load TLS material: {e}") from None


class _TlsSettings(Protocol):
    @property
    def tls_cert_file(self) -> str | None: ...
    @property
    def tls_key_file(self) -> str | None: ...
    @property
    def tls_client_ca_file(self) -> str | None: ...
    @property
    def tls_reload_interval_secs(self) -> float: ...


def server_tls(cfg: _TlsSettings) -> ServerTls | None:
    """The client port's TLS from a node's settings; None when it serves plain HTTP. The client
    certificate mode comes from ``cfg.auth.client_cert`` when the settings have one."""
    cc = getattr(getattr(cfg, "auth", None), "client_cert", None)
    identities = cc is not None and bool(getattr(cc, "enabled", False))
    if not cfg.tls_cert_file or not cfg.tls_key_file:
        if identities:
            log.warning("auth.client_cert maps certificates, but the client port serves plain HTTP: unused")
        return None
    if identities and not cfg.tls_client_ca_file:
        log.warning("auth.client_cert maps certificates, but without tls_client_ca_file none is asked for")
    return ServerTls(
        cfg.tls_cert_file,
        cfg.tls_key_file,
        cfg.tls_client_ca_file,
        cfg.tls_reload_interval_secs,
        client_cert_optional=cc is not None and getattr(cc, "verify", "required") == "optional",
    )
