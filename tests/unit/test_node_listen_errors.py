"""``shepherd.node.app._listen``: a bind's failure is a one-line configuration error; an unreadable file
the start reads (the mesh's keyring, its TLS files) is said as itself, not as a port not ours."""

from __future__ import annotations

import asyncio
import errno
import socket

import pytest

from shepherd.node.app import _listen
from shepherd.node.config import ConfigError


async def _raise(e: OSError) -> None:
    raise e


def test_an_unreadable_file_is_not_said_as_a_listen_failure() -> None:
    denied = PermissionError(errno.EACCES, "Permission denied", "/etc/smg/mesh.keyring")
    with pytest.raises(PermissionError) as got:
        asyncio.run(_listen("--mesh-bind/--mesh-port", "0.0.0.0", 7946, _raise(denied)))
    assert got.value.filename == "/etc/smg/mesh.keyring"


def test_a_bind_refused_or_a_host_not_resolving_is_a_configuration_error() -> None:
    with pytest.raises(ConfigError, match=r"cannot listen on 0.0.0.0:80 \(--host/--port\): Permission"):
        asyncio.run(
            _listen(
                "--host/--port", "0.0.0.0", 80, _raise(PermissionError(errno.EACCES, "Permission denied"))
            )
        )
    unknown = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    with pytest.raises(ConfigError, match=r"cannot listen on nowhere.invalid:80 \(--host/--port\): Name"):
        asyncio.run(_listen("--host/--port", "nowhere.invalid", 80, _raise(unknown)))
