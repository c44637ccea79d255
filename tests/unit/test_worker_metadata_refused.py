"""Link-local and cloud metadata addresses are never workers unless ``worker_allow`` names them, with the
list empty (the default) too: 169.254.0.0/16 (169.254.169.254 serves instance credentials on AWS, GCP,
Azure...), fe80::/10, AWS's fd00:ec2::254 and the name ``metadata.google.internal``, in any spelling a
resolver reads (``2852039166``, ``0xa9fea9fe``, IPv4-mapped IPv6). Refused in the configuration, by the
registry (admin API, discovery and the mesh add through it), and where a worker's name resolves (HTTP, and
gRPC on the lean transport).

The end-to-end side (a node refusing such a worker at start and on ``POST /workers``):
``tests/e2e/test_security_defaults.py``.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as sg

from shepherd.node.config import ConfigError, NodeConfig, WorkerAllow, build_config
from shepherd.node.dispatch import model_source
from shepherd.node.dispatch.workers import WorkerRegistry, make_client
from shepherd.node.engines.h2 import H2EngineClient
from shepherd.node.engines.h2_stream import RpcStatus
from shepherd.node.engines.http import AllowResolver, HttpRelayClient
from shepherd.proto.openai_errors import ApiError

pytestmark = pytest.mark.timeout(60)

METADATA_URLS = [
    "http://169.254.169.254",
    "http://169.254.169.254:80/",
    "grpc://169.254.169.254:50051",
    "http://169.254.1.1:8000",
    "http://[fe80::1]:8000",
    "http://[fd00:ec2::254]:80",
    "http://[::ffff:169.254.169.254]:80",
    "http://2852039166",  # 169.254.169.254 as one number
    "http://0xa9fea9fe:80",
    "http://169.254.43518",  # inet_aton's a.b.c form
    "http://metadata.google.internal",
    "http://Metadata.Google.Internal:80",
    "grpc://metadata.google.internal:443",
]


@pytest.mark.parametrize("url", METADATA_URLS)
def test_an_empty_allow_list_refuses_metadata_hosts(url: str) -> None:
    with pytest.raises(ConfigError, match="metadata"):
        WorkerAllow().check_url(url)
    with pytest.raises(ConfigError, match="metadata"):
        build_config({}, {"worker_urls": [url]})


def test_an_empty_allow_list_still_allows_the_rest() -> None:
    a = WorkerAllow()
    for url in ("http://10.0.0.5:8000", "grpc://127.0.0.1:1", "http://vllm.internal", "http://[fd00::1]:80"):
        a.check_url(url)
    assert a.address_allowed("10.1.2.3") and a.address_allowed("127.0.0.1") and a.address_allowed("::1")
    assert not a.address_allowed("169.254.169.254") and not a.address_allowed("fe80::1%eth0")
    assert not a.address_allowed("::ffff:169.254.169.254") and not a.address_allowed("fd00:ec2::254")


def test_an_entry_naming_them_allows_them_and_a_wide_one_does_not() -> None:
    exact = WorkerAllow(("169.254.169.254",))
    exact.check_url("http://169.254.169.254")
    assert exact.address_allowed("169.254.169.254") and not exact.address_allowed("169.254.1.1")
    WorkerAllow(("169.254.0.0/16",)).check_url("http://169.254.7.7:80")
    WorkerAllow(("fe80::/64",)).check_url("http://[fe80::1]:80")
    WorkerAllow(("metadata.google.internal",)).check_url("http://metadata.google.internal")
    everything = WorkerAllow(("0.0.0.0/0", "::/0"))
    everything.check_url("http://10.0.0.1")
    for url in ("http://169.254.169.254", "http://[fe80::1]:80", "http://metadata.google.internal"):
        with pytest.raises(ConfigError):
            everything.check_url(url)
    build_config({}, {"worker_allow": ["169.254.169.254"], "worker_urls": ["http://169.254.169.254"]})


async def test_the_registry_refuses_them_with_a_400() -> None:
    reg = WorkerRegistry(NodeConfig())
    for url in ("http://169.254.169.254", "grpc://[fe80::1]:50051", "http://metadata.google.internal"):
        with pytest.raises(ApiError) as e:
            await reg.add(url, "m")
        assert e.value.status == 400 and e.value.code == "worker_not_allowed"
    assert not reg.workers


class FixedAnswers:
    """A resolver answering fixed addresses for every name (DNS pointing at the metadata service)."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses
        self.asked: list[str] = []

    async def resolve(self, host: str, port: int = 0, family: Any = socket.AF_INET) -> list[dict[str, Any]]:
        self.asked.append(host)
        return [
            {"hostname": host, "host": a, "port": port, "family": family, "proto": 0, "flags": 0}
            for a in self.addresses
        ]

    async def close(self) -> None:
        pass


async def test_a_name_resolving_to_a_metadata_address_is_not_dialed_with_an_empty_list() -> None:
    r = AllowResolver(WorkerAllow())
    r._inner = FixedAnswers(["169.254.169.254", "fe80::1"])  # type: ignore[assignment]
    with pytest.raises(OSError):
        await r.resolve("rebound.example", 80)
    r._inner = FixedAnswers(["169.254.169.254", "10.0.0.7"])  # type: ignore[assignment]
    assert [x["host"] for x in await r.resolve("rebound.example", 80)] == ["10.0.0.7"]
    r._inner = FixedAnswers(["127.0.0.1"])  # type: ignore[assignment]
    assert [x["host"] for x in await r.resolve("localhost", 80)] == ["127.0.0.1"]


async def test_the_http_relay_checks_resolutions_with_an_empty_list() -> None:
    """The relay puts the checking resolver on its connections whatever the list holds."""
    client = HttpRelayClient("http://w.example:8000", allow=WorkerAllow())
    try:
        resolver = client.session().connector._resolver  # type: ignore[union-attr]
        assert isinstance(resolver, AllowResolver)
    finally:
        await client.close()


async def test_a_grpc_workers_name_resolving_to_a_metadata_address_is_not_dialed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lean gRPC client (the default transport) checks where a name it was not told to trust
    resolves, on every connection: only the allowed addresses are dialed (none left: UNAVAILABLE, no
    connection tried); IP addresses and names ``worker_allow`` lists are dialed as they are."""
    accepted: list[str] = []

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer.get_extra_info("peername")[0])
        writer.close()  # no SETTINGS: the client's connect fails after the dial

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    answers: dict[str, list[str]] = {}
    asked: list[str] = []

    async def fake_getaddrinfo(host: str, p: Any, **kw: Any) -> list[Any]:
        asked.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, p)) for a in answers[host]]

    monkeypatch.setattr(loop, "getaddrinfo", fake_getaddrinfo)
    try:
        client = make_client(f"grpc://rebound.example:{port}", allow=WorkerAllow())
        assert isinstance(client, H2EngineClient)
        answers["rebound.example"] = ["169.254.169.254"]
        with pytest.raises(RpcStatus, match="resolves to no address"):
            await client.call_unary("/x/Y", sg.HealthCheckRequest(), sg.HealthCheckResponse, 2.0)
        assert asked == ["rebound.example"] and accepted == []
        await client.close()
        client = make_client(f"grpc://rebound.example:{port}", allow=WorkerAllow())
        assert isinstance(client, H2EngineClient)
        answers["rebound.example"] = ["169.254.169.254", "127.0.0.1"]
        with pytest.raises(RpcStatus):
            await client.call_unary("/x/Y", sg.HealthCheckRequest(), sg.HealthCheckResponse, 2.0)
        assert accepted == ["127.0.0.1"]  # the metadata address was left out
        await client.close()
        listed = make_client(f"grpc://rebound.example:{port}", allow=WorkerAllow(("rebound.example",)))
        assert isinstance(listed, H2EngineClient)
        assert await listed._addresses(loop) == ["rebound.example"]  # vouched for: dialed as given
        await listed.close()
    finally:
        server.close()
        await server.wait_closed()


async def test_the_start_up_probe_does_not_dial_a_name_resolving_to_a_metadata_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The client asking a worker for GetModelInfo / GetTokenizer at start has the node's worker_allow
    too: a worker's name resolving to 169.254.169.254 is not dialed; one worker_allow lists is."""
    loop = asyncio.get_running_loop()

    async def fake_getaddrinfo(host: str, p: Any, **kw: Any) -> list[Any]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("169.254.169.254", p))]

    monkeypatch.setattr(loop, "getaddrinfo", fake_getaddrinfo)
    client = model_source._client("grpc://rebound.example:50051", NodeConfig())
    assert isinstance(client, H2EngineClient)
    try:
        with pytest.raises(OSError, match="resolves to no address worker_allow allows"):
            await client._addresses(loop)
    finally:
        await client.close()
    listed = model_source._client(
        "grpc://rebound.example:50051", NodeConfig(worker_allow=("rebound.example",))
    )
    assert isinstance(listed, H2EngineClient)
    try:
        assert await listed._addresses(loop) == ["rebound.example"]
    finally:
        await listed.close()
