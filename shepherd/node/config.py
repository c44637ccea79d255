"""Node configuration: frozen dataclasses, built from embedded defaults, a YAML file and CLI flags.

YAML keys are the CLI flag names in snake_case (``worker_urls``, ``model_path``, ``policy``, ...), plus a
``models`` list for several models behind one node::

    port: 30000
    worker_urls: [grpc://10.0.0.5:50051]
    models:
      - name: qwen3
        model_path: /models/qwen3
        worker_urls: [grpc://10.0.0.6:50051]
        policy: round_robin
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import ipaddress
import math
import re
import socket
import types
import typing
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from shepherd.auth.certs import validate_node_name
from shepherd.auth.config import AuthConfig, AuthConfigError, merge_auth
from shepherd.auth.control import is_loopback
from shepherd.auth.load import load_auth_config
from shepherd.auth.tls import TlsConfigError, check_settings
from shepherd.mesh.dns_seeds import is_dns_seed, parse_dns_seed
from shepherd.mesh.keyring import Keyring
from shepherd.mesh.runtime_config import parse_addr
from shepherd.node.gc_tuning import GEN0_THRESHOLD
from shepherd.parsers import OFF as PARSERS_OFF
from shepherd.parsers import reasoning_family_name, tool_family_name
from shepherd.policies.cache_aware import CacheAwareConfig
from shepherd.policies.simple import POLICY_NAMES

_CA = CacheAwareConfig()  # cache_aware's defaults

EMBEDDED_MODEL_DIR = Path(__file__).parent.parent / "tokens" / "assets" / "qwen3"

WORKER_SCHEMES = ("grpc", "grpcs", "sglang", "vllm", "trtllm", "mlx", "http", "https")


class ConfigError(ValueError):
    """A configuration value is wrong; the message says which and why."""


MODEL_KINDS = ("generate", "embed")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    model_path: str
    worker_urls: tuple[str, ...] = ()
    chat_template: str | None = None
    policy: str | None = None  # None: the node's policy
    context_length: int | None = None  # None: from the engine, else the tokenizer
    reasoning_parser: str | None = None  # None: the node's, else by model name; "none": off
    tool_call_parser: str | None = None  # None: the node's, else by model name; "none": off
    kind: str | None = None  # "generate" | "embed"; None: what the engines report (GetModelInfo)
    matryoshka: bool = False  # an embedding model whose vectors may be truncated (``dimensions``)
    served_name: str | None = None  # the engine's name for it when clients use another (an alias)


@dataclass(frozen=True, slots=True)
class RateLimitRule:
    """One entry of ``rate_limits``: limits of a tenant ("*": every tenant, each on its own count), on
    all models together (model None) or on one model. None: that limit is not set."""

    tenant: str
    model: str | None = None
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None


@dataclass(frozen=True, slots=True)
class NodeConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    worker_urls: tuple[str, ...] = ()
    model_path: str | None = None
    model_id: str | None = None
    chat_template: str | None = None
    # no model_path: the served name and tokenizer from the gRPC engines (node.dispatch.model_source),
    # cached here (None: $XDG_CACHE_HOME/shepherd/tokenizers, else ~/.cache/shepherd/tokenizers)
    tokenizer_cache_dir: str | None = None
    model_aliases: tuple[str, ...] = ()  # NAME=SERVED: clients send NAME for the engine's SERVED model
    policy: str = "cache_aware"  # (SMG's and sglang-router's default: DESIGN §5)
    # cache_aware's parameters (shepherd.policies.cache_aware; the first three are SGLang's / SMG's flags)
    cache_threshold: float = _CA.cache_threshold
    balance_abs_threshold: int = _CA.balance_abs_threshold
    balance_rel_threshold: float = _CA.balance_rel_threshold
    cache_move_base: float = _CA.move_base
    cache_move_tokens_per_load: float = _CA.move_tokens_per_load
    conversation_weight: float = _CA.conversation_weight
    conversation_lifetime_secs: float = _CA.conversation_lifetime_s
    shared_prefix_tokens_per_load: float = _CA.shared_tokens_per_load
    shared_prefix_after: int = _CA.shared_after
    engine_transport: str = "h2"  # "h2" (lean asyncio HTTP/2 gRPC client) or "grpcio"
    http_server: str = "lean"  # "lean" (httptools on asyncio: shepherd.node.http.server) or "aiohttp"
    kv_events: bool = True  # subscribe to gRPC engines' KV events to feed the prefix index
    models: tuple[ModelConfig, ...] = ()
    tokenizer_workers: int = 2
    procs: int = 1  # event-loop processes on the port (shepherd.node.procs: a mesh on loopback when > 1)
    reuse_port: bool = False  # SO_REUSEPORT on the listeners (set by --procs for its children)
    gc_gen0_threshold: int = (
        GEN0_THRESHOLD  # after start-up: gc.freeze() and this gen-0 threshold (0: CPython's)
    )
    tokenizer_inline_max_chars: int | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    request_timeout_secs: float = 600.0
    # no --model-path nor --model-id (or a models: entry without model_path): how long the start waits
    # for a gRPC worker to give the model's name and tokenizer (engines load weights for minutes); 0: once.
    # And a worker not admitted this long after it was added (no model info yet): said at ERROR, shown
    # failed, still asked (dispatch.workers.WorkerRegistry._admit)
    worker_startup_timeout_secs: float = 600.0
    max_retries: int = 2
    health_check_interval_secs: float = 5.0
    health_check_timeout_secs: float = 2.0
    health_failure_threshold: int = 3
    health_success_threshold: int = 2
    cb_failure_threshold: int = 5
    cb_success_threshold: int = 2
    cb_timeout_duration_secs: float = 10.0
    load_poll_interval_secs: float = 2.0
    shutdown_grace_secs: float = 30.0
    sse_keepalive_secs: float = 15.0
    stream_interval: int | None = None
    reasoning_parser: str | None = None  # every model's default (None: by model name; "none": off)
    tool_call_parser: str | None = None
    # chat answers' reasoning field(s): "both" (reasoning and reasoning_content), "reasoning" (vLLM's
    # current name) or "reasoning_content" (DeepSeek's API, older vLLM)
    reasoning_field: str = "both"
    # a strict json_schema / strict tool violated by the engine's answer: False (default) returns the
    # answer with the violation reported (x-smg-schema-violation, schema_violation); True answers 422
    reject_schema_violations: bool = False
    log_level: str = "info"
    # observability (shepherd.node.observe): traces off unless asked for (flags or OTEL_* variables)
    enable_trace: bool = False
    otlp_traces_endpoint: str | None = None  # turns tracing on; host:port or URL (default localhost:4317)
    otlp_traces_protocol: str | None = None  # grpc | http/protobuf (None: OTEL_EXPORTER_OTLP_PROTOCOL, grpc)
    otlp_metrics_endpoint: str | None = None  # OTLP export of the GenAI metrics (same protocol)
    log_format: str = "text"  # text | json (request id and trace id on every line of a request)
    access_log: bool = False  # one line per request (shepherd.access)
    # rate limits (shepherd.node.api.admission): YAML list of {tenant, model?, rpm?, tpm?, max_concurrent?};
    # the rate_limit_* flags give every tenant a default (a tenant "*" rule on all models)
    rate_limits: tuple[RateLimitRule, ...] = ()
    rate_limit_rpm: int | None = None
    rate_limit_tpm: int | None = None
    rate_limit_max_concurrent: int | None = None
    rate_limit_token_estimate: int = 1024  # tokens reserved for the output when max_tokens is absent
    rate_limit_propagation_secs: float = 1.0  # τ: a node's counts reach every peer within this
    # τ follows the staleness observed, up to this (LimiterConfig.propagation_max; 0: off, τ fixed at
    # rate_limit_propagation_secs); None: 15 s, at most the window
    rate_limit_propagation_max_secs: float | None = None
    rate_limit_window_secs: float = 60.0  # rpm/tpm count per window this long (60: as named; less: tests)
    rate_limit_unreachable_grace_secs: float = 300.0  # an unreachable member counts in N this long
    # where the counts live: "mesh" (gossiped shards) or "redis" (one shared store; README "Where gossip
    # stops"; shepherd.node.api.ratelimit_redis), its URL (a secret: never logged), key prefix, the bound
    # on one Redis call (past it the node admits its own share: limit / N) and the concurrency lease
    rate_limit_backend: str = "mesh"
    rate_limit_redis_url: str | None = None
    rate_limit_redis_prefix: str = "shepherd:rl:"
    rate_limit_redis_timeout_secs: float = 0.1
    rate_limit_redis_lease_secs: float = 30.0
    auth: AuthConfig = field(default_factory=AuthConfig)  # YAML: an ``auth`` mapping (see shepherd.auth)
    tls_cert_file: str | None = None  # TLS on the client port
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None  # clients must present a certificate from this CA (mTLS)
    tls_reload_interval_secs: float = 10.0  # check the cert files this often and reload them (0: only SIGHUP)
    engine_tls_ca_file: str | None = None  # TLS to gRPC engines (every gRPC worker when any is set; grpcs://)
    engine_tls_cert_file: str | None = None
    engine_tls_key_file: str | None = None
    # mesh (shepherd.node.cluster.mesh_node): off unless mesh_port is set; sealed (keyring), mTLS (certs)
    mesh_port: int | None = None  # UDP gossip and TCP push-pull, same number
    mesh_name: str | None = None  # this node's mesh name = its certificate's (default: the host name)
    mesh_bind: str = "127.0.0.1"
    mesh_advertise: str | None = None  # host[:port] the others reach us at (required for a wildcard bind)
    mesh_seeds: tuple[str, ...] = ()  # host[:port] of nodes to join through (retried until one answers)
    # dns:NAME[:PORT] seeds (every A/AAAA record, shepherd.mesh.dns_seeds) are resolved again this often
    # while the mesh is small (and with a back-off of up to it until joined)
    mesh_dns_refresh_interval: float = 30.0
    mesh_keyring_file: str | None = None  # one base64 AES key per line, the first primary
    mesh_keys: tuple[str, ...] = ()  # base64 AES keys (after the file's)
    mesh_cluster: str = ""  # cluster name bound into every sealed packet
    # keys of the Responses API's reasoning blobs (``encrypted_content``), in the mesh keyring's file format
    # (the first seals, every key opens), read at start: blobs a node sealed open after its restart, and on
    # every node given the same file (plain nodes behind one load balancer). Default: the mesh's keyring, or
    # a key of the process
    reasoning_keyring_file: str | None = None
    mesh_cert: str | None = None  # this node's certificate (``smg-node certs`` makes development ones)
    mesh_key: str | None = None
    mesh_ca: str | None = None
    mesh_dev_pki: str | None = None  # DEVELOPMENT ONLY: a dir with a shared CA + key, made if missing
    mesh_probe_interval: float | None = None  # SWIM tuning (None: the LAN defaults of shepherd.mesh)
    mesh_probe_timeout: float | None = None
    mesh_push_pull_interval: float | None = None
    mesh_suspicion_mult: int | None = None
    mesh_gossip_interval: float | None = None
    # which routing decisions' prefix-index deltas the mesh sends (README "Mesh at scale"): "auto" (those
    # of workers without a live KV-event stream here: the engine's events tell every node the rest),
    # "all" (every worker's), "none" (no index replication), "ends" (every worker's routing decisions as
    # turn ends, one 11-byte record each, never blocks: sparse replication). KV-event inserts are never sent.
    mesh_index_replication: str = "auto"
    # with "ends": the peers' turn ends a node keeps per model (16 bytes each; two generations, so between
    # half and all of it: follow-ups up to half of it / (peers x their rate) seconds apart are found)
    mesh_index_turn_ends: int = 1 << 23
    # PD disaggregation (shepherd.node.dispatch.pd): a prefill pool and a decode pool, each its own policy
    pd_disaggregation: bool = False
    prefill_urls: tuple[str, ...] = ()
    prefill_bootstrap_ports: tuple[int | None, ...] = ()  # per prefill URL (None: SGLang's default 8998)
    decode_urls: tuple[str, ...] = ()
    prefill_policy: str | None = None  # None: the node's policy
    decode_policy: str | None = None
    # Kubernetes worker discovery (shepherd.node.discovery): off unless service_discovery; SMG's flags
    service_discovery: bool = False
    selector: tuple[str, ...] = ()  # KEY=VALUE labels of regular worker pods
    prefill_selector: tuple[str, ...] = ()  # PD: prefill worker pods
    decode_selector: tuple[str, ...] = ()  # PD: decode worker pods
    service_discovery_namespace: str | None = None  # None: the service account's (or kubeconfig's)
    service_discovery_port: int = 8000  # a pod's worker port unless its ports annotation says otherwise
    service_discovery_protocol: str = "grpc"  # worker URL scheme of discovered pods
    worker_ports_annotation: str = "smg.ai/worker-ports"  # comma-separated ports: one worker each
    bootstrap_port_annotation: str = "sglang.ai/bootstrap-port"  # a prefill pod's bootstrap port(s)
    model_id_source: str | None = None  # "namespace", "label:KEY", "annotation:KEY" (None: the model)
    # history storage (shepherd.storage; the Responses and Conversations APIs, the node's own records)
    history_backend: str = "memory"  # memory | sqlite | postgres | redis
    history_url: str | None = None  # sqlite:///path.db, postgresql://..., redis://... (memory: none)
    history_retention_days: float = 30.0  # records older than this are purged (0: kept for ever)
    history_allow_local: bool = False  # a mesh node may keep conversations in memory (lost on restart)
    history_memory_max_items: int = 200_000  # memory backend: items kept before the oldest are evicted
    history_memory_max_bytes: int = 1 << 30  # memory backend: and the JSON bytes of their items
    history_migrations: str = "apply"  # postgres: "apply" (advisory lock) or "refuse" (print the SQL)
    history_pool_size: int = 8  # postgres / redis connections
    history_chain_max_depth: int = 1000  # previous_response_id hops followed before a 400
    data_dir: str | None = None  # the node's own durable records (API keys): <data_dir>/node.db (SQLite)
    # security (docs/SECURITY.md): the control plane and what workers may be
    admin_host: str | None = None  # the control plane's own listener: /admin/*, /workers*, /mesh/*, /metrics
    admin_port: int | None = None
    insecure_admin: bool = False  # allow an unauthenticated control plane on a non-loopback address
    admin_allowed_origins: tuple[str, ...] = ()  # browser Origins allowed on the control plane
    # browser Origins allowed on the data plane (CORS: shepherd.node.api.cors; '*' any; none: off)
    cors_allowed_origins: tuple[str, ...] = ()
    # Host names the control plane answers off loopback (auth.control.ControlGuard; "*": any); default,
    # with --insecure-admin: the listener's address and this machine's name
    admin_allowed_hosts: tuple[str, ...] = ()
    worker_allow: tuple[str, ...] = ()  # hosts / CIDRs workers may be on (empty: any but link-local/metadata)
    max_client_connections: int = 10_000  # client connections served at once (more are refused)
    max_connections_per_client: int = 0  # client connections one address may hold at once (0: no cap)
    # load balancers (IPs / CIDRs) whose connections open with a PROXY protocol header (v1 or v2) naming
    # the client they relay (shepherd.node.http.proxy_protocol): that address is the client's
    proxy_protocol_from: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    # where this configuration came from (set by the CLI, not YAML keys): SIGHUP and POST /admin/reload
    # read the file again and apply the same flags over it (shepherd.node.api.reload)
    config_file: str | None = None
    config_overrides: dict[str, Any] = field(default_factory=dict)

    def model_configs(self) -> tuple[ModelConfig, ...]:
        """The models this node serves: the ``models`` list, else one model from the top-level flags."""
        if self.models:
            return self.models
        path = self.model_path or str(EMBEDDED_MODEL_DIR)
        name = self.model_id or Path(path).name
        urls = self.worker_urls
        if self.pd_disaggregation:
            urls = (*urls, *self.prefill_urls, *self.decode_urls)
        return (ModelConfig(name=name, model_path=path, worker_urls=urls, chat_template=self.chat_template),)


_HOST_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?")


def check_worker_url(url: str) -> str:
    """A worker URL is ``scheme://host[:port]`` (a trailing ``/`` allowed), nothing else: no path, query,
    fragment or user info (for HTTP workers too: the node appends ``/v1/...`` to it, and anything more
    would point the relay somewhere else). gRPC schemes need the port."""
    scheme, sep, rest = url.partition("://")
    if not sep or not rest:
        raise ConfigError(f"worker URL {url!r} must look like grpc://host:port or http://host:port")
    if scheme not in WORKER_SCHEMES:
        raise ConfigError(
            f"worker URL {url!r}: unknown scheme {scheme!r} (use one of {', '.join(WORKER_SCHEMES)})"
        )
    if len(url) > 2048 or any(c.isspace() or not c.isprintable() for c in url):
        raise ConfigError(f"worker URL {url[:80]!r} holds spaces or control characters, or is too long")
    if any(c in url for c in "?#@\\%"):
        raise ConfigError(
            f"worker URL {url!r}: a worker URL is scheme://host:port only (no path, query, fragment, "
            "user info or escapes)"
        )
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
        host = parts.hostname
    except ValueError as e:
        raise ConfigError(f"worker URL {url!r}: {e}") from None
    ip = _ip(host) if host else None
    if not host or len(host) > 253 or not (_HOST_NAME.fullmatch(host) or ip is not None):
        raise ConfigError(f"worker URL {url!r} has no valid host")
    if ip is not None and ip.is_unspecified:  # 0.0.0.0 / :: are a listener's "any", not an engine's address
        raise ConfigError(f"worker URL {url!r}: {host} is no address to dial (name the engine's host)")
    # gRPC clients strip trailing slashes (several URLs of one engine may differ by them); HTTP: one at most
    if parts.path not in ("", "/") and (scheme in ("http", "https") or parts.path.strip("/")):
        raise ConfigError(f"worker URL {url!r}: a worker URL is scheme://host:port only (no path)")
    if scheme not in ("http", "https"):
        if port is None or not 0 < port < 65536:
            raise ConfigError(f"worker URL {url!r} needs a port in 1-65535")
    elif port is not None and not 0 < port < 65536:
        raise ConfigError(f"worker URL {url!r} needs a port in 1-65535")
    return url


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


_NUMERIC_V4 = re.compile(r"(0x[0-9a-f]+|[0-9]+)(\.(0x[0-9a-f]+|[0-9]+)){0,3}")


def worker_endpoint(url: str) -> tuple[str, str, int | None]:
    """The engine a (checked) worker URL dials: (``grpc`` for every gRPC scheme, ``http`` for HTTP and
    HTTPS; the host as an address where it is one in any spelling the resolver takes: ``0x7f000001``,
    ``127.1``, ``::ffff:127.0.0.1``; else the name, lower case, without a trailing dot; the port).
    Two URLs of one endpoint are one engine (``sglang://h:1`` and ``grpc://h:1``)."""
    scheme = url.partition("://")[0]
    parts = urllib.parse.urlsplit(url)
    host = (parts.hostname or "").rstrip(".").lower()
    ip = _ip(host)
    if ip is None and _NUMERIC_V4.fullmatch(host):
        with contextlib.suppress(OSError):
            ip = ipaddress.IPv4Address(socket.inet_aton(host))
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    port = parts.port if parts.port is not None else {"http": 80, "https": 443}.get(scheme)
    return ("http" if scheme in ("http", "https") else "grpc", host if ip is None else str(ip), port)


# link-local addresses, where clouds serve instance metadata and credentials (AWS, GCP, Azure, ...:
# 169.254.169.254; AWS over IPv6: fd00:ec2::254), and the metadata services' names: never a worker
# unless an entry of ``worker_allow`` names them
METADATA_NETWORKS: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = (
    ipaddress.ip_network("169.254.0.0/16"),
    ipaddress.ip_network("fe80::/10"),
    ipaddress.ip_network("fd00:ec2::254/128"),
)
METADATA_NAMES = frozenset({"metadata.google.internal"})


def _metadata_net(
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    return next((n for n in METADATA_NETWORKS if ip.version == n.version and ip in n), None)


def _inside_metadata(net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> bool:
    """``net`` lies inside a metadata network (so an entry of it names metadata addresses)."""
    return any(
        net.version == m.version and net.network_address in m and net.broadcast_address in m
        for m in METADATA_NETWORKS
    )


def _host_address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` as the address a resolver takes it for: an IP literal (a ``%zone`` ignored), or an IPv4
    address in a spelling ``inet_aton`` reads (``2852039166``, ``0xa9fea9fe``, ``169.254.43518``);
    IPv4-mapped IPv6 as its IPv4 address. None: a name."""
    h = host.strip("[]").partition("%")[0].rstrip(".").lower()
    ip = _ip(h)
    if ip is None and _NUMERIC_V4.fullmatch(h):
        with contextlib.suppress(OSError):
            ip = ipaddress.IPv4Address(socket.inet_aton(h))
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip


class WorkerAllow:
    """``worker_allow``: the hosts and networks workers may be on (empty: any but the metadata ones).

    Entries: an IP address or a CIDR (``10.0.0.0/8``, ``fd00::/8``), checked with ``ipaddress``; a host
    name, matching that name exactly (case-insensitive, a trailing dot ignored); or a name starting
    with a dot (``.svc.cluster.local``), matching every name that ends with it (``a.svc.cluster.local``,
    not ``svc.cluster.local`` itself).

    A worker URL is allowed when its host is an IP address inside an allowed network, or a name listed
    by name (the operator vouches for that name, whatever it resolves to). A name not listed is allowed
    for HTTP workers only, and only at connect time: every connection resolves it and dials only the
    addresses inside the allowed networks (``HttpRelayClient``'s resolver), so a name that resolves (or
    re-binds) elsewhere is never dialed. A gRPC worker's name must be listed (or use its IP address).

    Link-local and cloud metadata addresses (``METADATA_NETWORKS``: 169.254.0.0/16, fe80::/10,
    fd00:ec2::254) and names (``metadata.google.internal``) are refused, with the list empty too, unless
    an entry names them: a network inside one of those (``169.254.169.254``, ``169.254.0.0/16``; a wider
    one such as ``0.0.0.0/0`` does not count), or the name. An HTTP worker's name, and a gRPC worker's
    on the lean HTTP/2 transport (``H2EngineClient``), is checked where it resolves with the list empty
    too (a name resolving to 169.254.169.254 is never dialed); with the grpcio transport a gRPC worker's
    name is not (grpcio resolves on its own).
    """

    __slots__ = ("entries", "metadata_nets", "names", "networks", "suffixes")

    def __init__(self, entries: tuple[str, ...] = ()) -> None:
        self.entries = entries
        self.names: frozenset[str] = frozenset()
        self.suffixes: tuple[str, ...] = ()
        nets: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        names: set[str] = set()
        suffixes: list[str] = []
        for raw in entries:
            e = raw.strip().lower().rstrip(".")
            if not e:
                raise ConfigError("worker_allow: an empty entry")
            if e.startswith(".") and _HOST_NAME.fullmatch(e[1:]):
                suffixes.append(e)
                continue
            try:
                nets.append(ipaddress.ip_network(e.strip("[]"), strict=False))
                continue
            except ValueError:
                pass
            if not _HOST_NAME.fullmatch(e) or "/" in e:
                raise ConfigError(f"worker_allow: {raw!r} is not an IP address, a CIDR or a host name")
            names.add(e)
        self.networks = tuple(nets)
        self.names = frozenset(names)
        self.suffixes = tuple(suffixes)
        # the entries that name metadata addresses: networks inside a metadata network
        self.metadata_nets = tuple(n for n in nets if _inside_metadata(n))

    @property
    def empty(self) -> bool:
        """No entry: every worker but the metadata ones is allowed."""
        return not self.entries

    @property
    def any(self) -> bool:
        """Every address is allowed, nothing is checked where names resolve: never (metadata addresses
        are refused with an empty list too), so HTTP workers always resolve through the check."""
        return False

    def name_listed(self, host: str) -> bool:
        h = host.lower().rstrip(".")
        return h in self.names or any(h.endswith(s) for s in self.suffixes)

    def address_allowed(self, address: str) -> bool:
        """``address`` (an IP address; a ``%zone`` suffix ignored) may be dialed: inside an allowed
        network (any address with the list empty), and a metadata address only when an entry names it."""
        ip = _host_address(address)
        if ip is None:
            return False
        if _metadata_net(ip) is not None:
            return any(ip.version == n.version and ip in n for n in self.metadata_nets)
        if self.empty:
            return True
        return any(ip.version == n.version and ip in n for n in self.networks)

    def resolve_check(self, host: str) -> bool:
        """Connections to ``host`` must check the addresses it resolves to (a name not listed by name)."""
        return _ip(host.strip("[]").partition("%")[0]) is None and not self.name_listed(host)

    def check_url(self, url: str) -> None:
        """ConfigError when ``url`` (already through ``check_worker_url``) is not allowed."""
        host = urllib.parse.urlsplit(url).hostname or ""
        ip = _host_address(host)
        if ip is not None:
            if self.address_allowed(str(ip)):
                return
            if _metadata_net(ip) is not None:
                raise ConfigError(
                    f"worker URL {url!r}: {host} is a link-local / cloud metadata address (instance "
                    "credentials live there); to allow it, name it in worker_allow (e.g. --worker-allow "
                    f"{ip}, with the networks of the other workers)"
                )
            raise ConfigError(f"worker URL {url!r}: {host} is not in worker_allow")
        if self.name_listed(host):
            return
        if host.lower().rstrip(".") in METADATA_NAMES:
            raise ConfigError(
                f"worker URL {url!r}: {host} is a cloud metadata service (instance credentials live "
                "there); list the name in worker_allow to allow it"
            )
        if self.empty:
            return
        if url.partition("://")[0] not in ("http", "https"):
            raise ConfigError(
                f"worker URL {url!r}: a gRPC worker's host name must be listed in worker_allow (or use its "
                "IP address): its connections are not checked where they resolve"
            )
        if not self.networks:
            raise ConfigError(f"worker URL {url!r}: {host} is not in worker_allow")


_NOT_SETTINGS = frozenset({"extra", "config_file", "config_overrides"})  # never from a file or a flag


def _fields() -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(NodeConfig)}


# the one model of the top-level settings (``model_configs``): meaningless beside a ``models`` list
_ONE_MODEL_KEYS = ("worker_urls", "model_path", "model_id", "chat_template")
# a dataclass's scalar settings: each one's type, and whether None is allowed
_SCALARS: dict[type, dict[str, tuple[type, bool]]] = {}
# intervals a node loops on: 0 would spin (a health round right after the last one, forever)
_POSITIVE_SECS = ("health_check_interval_secs", "health_check_timeout_secs", "load_poll_interval_secs")


def _scalar_types(cls: type) -> dict[str, tuple[type, bool]]:
    found = _SCALARS.get(cls)
    if found is None:
        found = {}
        for name, hint in typing.get_type_hints(cls).items():
            args = set(typing.get_args(hint)) if typing.get_origin(hint) is types.UnionType else {hint}
            optional = type(None) in args
            rest = args - {type(None)}
            if len(rest) == 1 and (t := rest.pop()) in (bool, int, float, str):
                found[name] = (t, optional)
        _SCALARS[cls] = found
    return found


def _check_scalars(values: dict[str, Any], cls: type = NodeConfig, where: str = "") -> None:
    """Each scalar setting of the file has its field's type (of ``cls``: the node's, or a model entry's):
    YAML's ``"false"`` (a string, quoted) is not ``false``, so a quoted ``insecure_admin: "false"`` must
    not read as true, nor ``port: "abc"`` reach a comparison; an int serves where a float is asked,
    never a bool where a number is."""
    scalars = _scalar_types(cls)
    for key, val in values.items():
        spec = scalars.get(key)
        if spec is None or (val is None and spec[1]):
            continue
        want = spec[0]
        if want is bool:
            ok = isinstance(val, bool)
        elif want is int:
            ok = isinstance(val, int) and not isinstance(val, bool)
        elif want is float:
            ok = isinstance(val, (int, float)) and not isinstance(val, bool) and math.isfinite(val)
        else:
            ok = isinstance(val, str)
        if not ok:
            kind = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[want]
            raise ConfigError(f"{where}{key} must be {kind}{' or null' if spec[1] else ''}, not {val!r}")
    for key in _POSITIVE_SECS:
        if key in values and values[key] <= 0:
            raise ConfigError(f"{key} must be > 0")


def _coerce_rate_limit(raw: Any) -> RateLimitRule:
    if not isinstance(raw, dict) or not isinstance(raw.get("tenant"), str) or not raw["tenant"]:
        raise ConfigError("each entry of 'rate_limits' needs a 'tenant' (a name, or '*' for every tenant)")
    known = {f.name for f in dataclasses.fields(RateLimitRule)}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"unknown keys in the rate limit of tenant {raw['tenant']!r}: {sorted(unknown)}")
    if raw.get("model") is not None and not isinstance(raw["model"], str):
        raise ConfigError(f"rate limit of tenant {raw['tenant']!r}: 'model' must be a string")
    for k in ("rpm", "tpm", "max_concurrent"):
        v = raw.get(k)
        if v is not None and (type(v) is not int or v < 1):
            raise ConfigError(f"rate limit of tenant {raw['tenant']!r}: {k} must be a positive integer")
    return RateLimitRule(**raw)


def _coerce_model(raw: Any) -> ModelConfig:
    if not isinstance(raw, dict) or "name" not in raw:
        raise ConfigError("each entry of 'models' needs at least 'name'")
    if not raw.get("model_path"):  # from its gRPC engines at start-up (GetTokenizer)
        raw = {**raw, "model_path": ""}
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"unknown keys in model {raw.get('name')!r}: {sorted(unknown)}")
    if raw.get("kind") not in (None, *MODEL_KINDS):
        raise ConfigError(f"model {raw.get('name')!r}: 'kind' must be one of {MODEL_KINDS}")
    _check_scalars(raw, ModelConfig, f"model {raw.get('name')!r}: ")
    urls_raw = raw.get("worker_urls", ())
    if isinstance(urls_raw, str):  # one URL alone: a list of one
        urls_raw = (urls_raw,)
    elif not isinstance(urls_raw, (list, tuple)):
        raise ConfigError(f"model {raw.get('name')!r}: worker_urls must be a list of worker URLs")
    urls = tuple(check_worker_url(str(u)) for u in urls_raw)
    return ModelConfig(**{**raw, "worker_urls": urls})


def cache_aware_config(cfg: NodeConfig) -> CacheAwareConfig:
    """cache_aware's parameters from the node's settings (ValueError when out of range)."""
    return CacheAwareConfig(
        cache_threshold=float(cfg.cache_threshold),
        balance_abs_threshold=int(cfg.balance_abs_threshold),
        balance_rel_threshold=float(cfg.balance_rel_threshold),
        move_base=float(cfg.cache_move_base),
        move_tokens_per_load=float(cfg.cache_move_tokens_per_load),
        conversation_weight=float(cfg.conversation_weight),
        conversation_lifetime_s=float(cfg.conversation_lifetime_secs),
        shared_tokens_per_load=float(cfg.shared_prefix_tokens_per_load),
        shared_after=int(cfg.shared_prefix_after),
    )


def build_config(file_values: dict[str, Any], overrides: dict[str, Any]) -> NodeConfig:
    """Defaults < YAML file < CLI overrides (only keys whose value is not None)."""
    fields = _fields()
    values: dict[str, Any] = {}
    for source in (file_values, {k: v for k, v in overrides.items() if v is not None}):
        for key, val in source.items():
            if key not in fields or key in _NOT_SETTINGS:
                raise ConfigError(f"unknown configuration key {key!r}")
            values[key] = merge_auth(values.get(key), val) if key == "auth" else val
    _check_scalars(values)
    for key in ("worker_urls", "prefill_urls", "decode_urls"):  # one URL alone: a list of one
        if isinstance(values.get(key), str):
            values[key] = (values[key],)
        elif key in values and not isinstance(values[key], (list, tuple)):
            raise ConfigError(f"{key} must be a list of worker URLs")
    if "worker_urls" in values:
        values["worker_urls"] = tuple(check_worker_url(str(u)) for u in values["worker_urls"])
    if "rate_limits" in values:
        if not isinstance(values["rate_limits"], (list, tuple)):
            raise ConfigError("'rate_limits' must be a list")
        values["rate_limits"] = tuple(_coerce_rate_limit(r) for r in values["rate_limits"])
    if "models" in values:
        values["models"] = tuple(_coerce_model(m) for m in values["models"])
        top = [k for k in _ONE_MODEL_KEYS if values.get(k)]
        if values["models"] and top:
            raise ConfigError(
                f"{', '.join(top)} and 'models' are both given: with 'models', each model names its own "
                "worker_urls, model_path and chat_template (the top-level ones would be ignored); move "
                "them into the model's entry, or drop 'models'"
            )
    for key in ("prefill_urls", "decode_urls"):
        if key in values:
            values[key] = tuple(check_worker_url(str(u)) for u in values[key])
    if "prefill_bootstrap_ports" in values:
        values["prefill_bootstrap_ports"] = tuple(
            None if v is None else int(v) for v in values["prefill_bootstrap_ports"]
        )
    for key in (
        "mesh_seeds", "mesh_keys", "worker_allow", "admin_allowed_origins", "admin_allowed_hosts", "selector",
        "proxy_protocol_from", "cors_allowed_origins",
        "prefill_selector", "decode_selector", "model_aliases",
    ):  # fmt: skip
        if isinstance(values.get(key), str):
            values[key] = (values[key],)
        elif key in values:
            values[key] = tuple(str(v) for v in values[key])
    if "auth" in values:
        try:
            values["auth"] = load_auth_config(values["auth"])
        except AuthConfigError as e:
            raise ConfigError(str(e)) from None
    try:
        cfg = NodeConfig(**values)
    except TypeError as e:
        raise ConfigError(str(e)) from None
    if cfg.policy not in POLICY_NAMES:
        raise ConfigError(f"policy {cfg.policy!r} is unknown (one of {', '.join(POLICY_NAMES)})")
    try:
        cache_aware_config(cfg)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"cache_aware: {e}") from None
    for m in cfg.models:
        if m.policy is not None and m.policy not in POLICY_NAMES:
            raise ConfigError(
                f"model {m.name!r}: policy {m.policy!r} is unknown (one of {', '.join(POLICY_NAMES)})"
            )
    _check_parsers(cfg)
    _check_pd(cfg)
    _check_discovery(cfg)
    if cfg.engine_transport not in ("h2", "grpcio"):
        raise ConfigError(f"engine_transport {cfg.engine_transport!r}: use 'h2' or 'grpcio'")
    if cfg.http_server not in ("lean", "aiohttp"):
        raise ConfigError(f"http_server {cfg.http_server!r}: use 'lean' or 'aiohttp'")
    if cfg.log_format not in ("text", "json"):
        raise ConfigError(f"log_format {cfg.log_format!r}: use 'text' or 'json'")
    if cfg.otlp_traces_protocol not in (None, "grpc", "http/protobuf"):
        raise ConfigError(f"otlp_traces_protocol {cfg.otlp_traces_protocol!r}: use 'grpc' or 'http/protobuf'")
    try:
        check_settings(
            cfg.tls_cert_file,
            cfg.tls_key_file,
            cfg.tls_client_ca_file,
            cfg.engine_tls_ca_file,
            cfg.engine_tls_cert_file,
            cfg.engine_tls_key_file,
        )
    except TlsConfigError as e:
        raise ConfigError(str(e)) from None
    if cfg.auth.client_cert.enabled and not cfg.tls_client_ca_file:
        raise ConfigError(
            "auth.client_cert maps client certificates to callers: it needs TLS on the client port "
            "(tls_cert_file, tls_key_file) and tls_client_ca_file to verify them"
        )
    if not 0 < cfg.port < 65536:
        raise ConfigError(f"port {cfg.port} out of range")
    if cfg.worker_startup_timeout_secs < 0:
        raise ConfigError("worker_startup_timeout_secs must be >= 0 (0: ask the workers once)")
    if cfg.gc_gen0_threshold < 0:
        raise ConfigError("gc_gen0_threshold must be >= 0 (0 keeps CPython's collector settings)")
    if cfg.tokenizer_workers < 0:
        raise ConfigError("tokenizer_workers must be >= 0")
    if not 1 <= cfg.procs <= 256:
        raise ConfigError("procs must be within 1..256")
    for k in ("rate_limit_rpm", "rate_limit_tpm", "rate_limit_max_concurrent"):
        if getattr(cfg, k) is not None and getattr(cfg, k) < 1:
            raise ConfigError(f"{k} must be a positive integer")
    if cfg.rate_limit_token_estimate < 0 or cfg.rate_limit_propagation_secs <= 0:
        raise ConfigError("rate_limit_token_estimate must be >= 0 and rate_limit_propagation_secs > 0")
    if (
        cfg.rate_limit_window_secs <= cfg.rate_limit_propagation_secs
        or cfg.rate_limit_unreachable_grace_secs < 0
    ):
        raise ConfigError(
            "rate_limit_window_secs must exceed rate_limit_propagation_secs, and "
            "rate_limit_unreachable_grace_secs must be >= 0"
        )
    pmax = cfg.rate_limit_propagation_max_secs
    if pmax is not None and (
        not isinstance(pmax, (int, float))
        or isinstance(pmax, bool)
        or (pmax != 0 and not cfg.rate_limit_propagation_secs <= pmax <= cfg.rate_limit_window_secs)
    ):
        raise ConfigError(
            "rate_limit_propagation_max_secs must be 0 (off) or between rate_limit_propagation_secs "
            "and rate_limit_window_secs"
        )
    check_rate_limit_backend(cfg)
    if cfg.max_client_connections < 1:
        raise ConfigError("max_client_connections must be >= 1")
    check_client_front(cfg)
    if not 1024 <= cfg.mesh_index_turn_ends <= 1 << 28:
        raise ConfigError("mesh_index_turn_ends must be between 1,024 and 268,435,456")
    if cfg.mesh_index_replication not in MESH_INDEX_REPLICATION:
        raise ConfigError(
            f"mesh_index_replication {cfg.mesh_index_replication!r} is unknown "
            f"(one of {', '.join(MESH_INDEX_REPLICATION)})"
        )
    allow = WorkerAllow(cfg.worker_allow)  # entries checked here; each worker URL against them
    for mc in cfg.model_configs():
        for url in mc.worker_urls:
            allow.check_url(url)
    check_control_plane(cfg)
    if cfg.reasoning_keyring_file is not None:
        try:
            Keyring.from_file(cfg.reasoning_keyring_file)
        except (OSError, UnicodeDecodeError, ValueError) as e:  # (KeyringError is a ValueError)
            raise ConfigError(f"reasoning_keyring_file {cfg.reasoning_keyring_file!r}: {e}") from None
    if cfg.mesh_port is not None or cfg.mesh_seeds:
        try:
            cfg = check_mesh_config(cfg)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return check_history(cfg, explicit_backend="history_backend" in values)


def control_listener(cfg: NodeConfig) -> tuple[str, int]:
    """Where the control routes are served: the admin listener when set, else the client port."""
    if cfg.admin_port is not None:
        return cfg.admin_host or "127.0.0.1", cfg.admin_port
    return cfg.host, cfg.port


def insecure_admin_in_effect(cfg: NodeConfig) -> bool:
    """The control plane is unauthenticated on an address other machines reach (``--insecure-admin``)."""
    return cfg.auth.control_plane == "off" and not is_loopback(control_listener(cfg)[0])


def check_control_plane(cfg: NodeConfig) -> None:
    """Secure defaults of the control plane (SECURITY.md): an unauthenticated control plane only on
    loopback, unless ``insecure_admin`` says otherwise; a sane admin listener."""
    if cfg.admin_host is not None and cfg.admin_port is None:
        raise ConfigError("admin_host needs admin_port (the admin listener is off without it)")
    if cfg.admin_port is not None:
        if not 0 < cfg.admin_port < 65536:
            raise ConfigError(f"admin_port {cfg.admin_port} out of range")
        if cfg.admin_port == cfg.port:
            raise ConfigError("admin_port must differ from port (the admin listener is a listener apart)")
    for key in ("admin_allowed_origins", "cors_allowed_origins"):
        for o in getattr(cfg, key):
            if o == "*" and key == "cors_allowed_origins":
                continue
            parts = urllib.parse.urlsplit(o)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/"):
                raise ConfigError(f"{key}: {o!r} is not an origin (scheme://host[:port])")
    for h in cfg.admin_allowed_hosts:
        e = h.strip().rstrip(".")
        name = e[1:] if e.startswith(".") else e
        if e != "*" and not (_HOST_NAME.fullmatch(name) or _ip(name.strip("[]")) is not None):
            raise ConfigError(
                f"admin_allowed_hosts: {h!r} is not a host name, a .suffix, an IP address or '*'"
            )
    host, port = control_listener(cfg)
    if insecure_admin_in_effect(cfg) and not cfg.insecure_admin:
        where = "the admin listener" if cfg.admin_port is not None else "the client port"
        raise ConfigError(
            f"the control plane (/admin/*, /workers*, /mesh/*, /metrics) would be served without "
            f"authentication on {host}:{port} ({where}), which other machines reach: anyone there could "
            "add or delete workers mesh-wide and mint API keys. Turn auth on (--auth-mode api_key with "
            "--auth-admin-key-env VAR, or --auth-control-plane), serve it on loopback (--admin-host "
            "127.0.0.1 --admin-port N, or --host 127.0.0.1), or accept the risk with --insecure-admin"
        )


def _check_pd(cfg: NodeConfig) -> None:
    for name in ("prefill_policy", "decode_policy"):
        v = getattr(cfg, name)
        if v is not None and v not in POLICY_NAMES:
            raise ConfigError(f"{name} {v!r} is unknown (one of {', '.join(POLICY_NAMES)})")
    if not cfg.pd_disaggregation:
        if cfg.prefill_urls or cfg.decode_urls:
            raise ConfigError("prefill / decode workers need pd_disaggregation (--pd-disaggregation)")
        return
    discovered = cfg.service_discovery and cfg.prefill_selector and cfg.decode_selector
    if not discovered and (not cfg.prefill_urls or not cfg.decode_urls):
        raise ConfigError(
            "PD disaggregation needs at least one prefill and one decode worker (or, with "
            "service_discovery, a prefill_selector and a decode_selector)"
        )
    if cfg.models:
        raise ConfigError("PD disaggregation serves one model (the top-level one), not a 'models' list")
    if cfg.prefill_bootstrap_ports and len(cfg.prefill_bootstrap_ports) != len(cfg.prefill_urls):
        raise ConfigError("prefill_bootstrap_ports needs one entry (or null) per prefill URL")
    for url in (*cfg.prefill_urls, *cfg.decode_urls):
        if url.partition("://")[0] in ("http", "https"):
            raise ConfigError(f"PD worker {url!r}: PD disaggregation needs gRPC engines")
    both = set(cfg.prefill_urls) & set(cfg.decode_urls)
    if both:
        raise ConfigError(f"a worker cannot be in both pools: {sorted(both)}")


DISCOVERY_PROTOCOLS = ("grpc", "grpcs", "sglang", "vllm", "http", "https")


def _check_discovery(cfg: NodeConfig) -> None:
    """Kubernetes discovery settings (``shepherd.node.discovery``): the selectors its mode needs, each
    ``KEY=VALUE``, and lightkube installed (the ``k8s`` extra)."""
    selectors = {"selector": cfg.selector, "prefill_selector": cfg.prefill_selector}
    selectors["decode_selector"] = cfg.decode_selector
    if not cfg.service_discovery:
        given = [k for k, v in selectors.items() if v]
        if given or cfg.model_id_source:
            what = ", ".join(given) or "model_id_source"
            raise ConfigError(f"{what} need service_discovery (--service-discovery)")
        return
    for key, entries in selectors.items():
        for entry in entries:
            for part in filter(None, (p.strip() for p in entry.split(","))):
                k, sep, _ = part.partition("=")
                if not sep or not k.strip() or "!" in k:
                    raise ConfigError(f"{key}: {part!r} is not KEY=VALUE")
    if (cfg.prefill_selector or cfg.decode_selector) and not cfg.pd_disaggregation:
        raise ConfigError("prefill_selector / decode_selector need pd_disaggregation (--pd-disaggregation)")
    if not (cfg.selector or cfg.prefill_selector or cfg.decode_selector):
        raise ConfigError("service_discovery needs a selector (--selector KEY=VALUE, or the PD selectors)")
    if cfg.pd_disaggregation and bool(cfg.prefill_selector) != bool(cfg.decode_selector):
        raise ConfigError("PD discovery needs both a prefill_selector and a decode_selector")
    if cfg.service_discovery_protocol not in DISCOVERY_PROTOCOLS:
        protocols = ", ".join(DISCOVERY_PROTOCOLS)
        raise ConfigError(
            f"service_discovery_protocol {cfg.service_discovery_protocol!r}: one of {protocols}"
        )
    if not 0 < cfg.service_discovery_port < 65536:
        raise ConfigError(f"service_discovery_port {cfg.service_discovery_port} out of range")
    src = cfg.model_id_source
    if src is not None and src.lower() != "namespace":
        kind, sep, key = src.partition(":")
        if kind not in ("label", "annotation") or not sep or not key.strip():
            raise ConfigError(f"model_id_source {src!r}: 'namespace', 'label:KEY' or 'annotation:KEY'")
    if cfg.models and src is None:
        raise ConfigError("service_discovery on a node serving several models needs model_id_source")
    if importlib.util.find_spec("lightkube") is None:
        raise ConfigError(
            "service_discovery needs the lightkube package: pip install 'shepherd[k8s]' (or lightkube)"
        )


def _check_parsers(cfg: NodeConfig) -> None:
    if cfg.reasoning_field not in ("both", "reasoning", "reasoning_content"):
        raise ConfigError(
            f"reasoning_field {cfg.reasoning_field!r}: one of 'both', 'reasoning', 'reasoning_content'"
        )
    entries = [("", cfg.reasoning_parser, cfg.tool_call_parser)]
    entries += [(f"model {m.name!r}: ", m.reasoning_parser, m.tool_call_parser) for m in cfg.models]
    for where, reasoning, tool in entries:
        try:
            if reasoning is not None and reasoning.lower() not in PARSERS_OFF:
                reasoning_family_name(reasoning)
            if tool is not None and tool.lower() not in PARSERS_OFF:
                tool_family_name(tool)
        except ValueError as e:
            raise ConfigError(f"{where}{e}") from None


def load_yaml(path: str | Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def default_node_name() -> str:
    """The host name, made a valid node identity (1-63 of ``[A-Za-z0-9._-]``)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).strip("-._")[:63]
    return name or "node"


MESH_INDEX_REPLICATION = ("auto", "all", "none", "ends")


def check_mesh_config(cfg: NodeConfig) -> NodeConfig:
    """Validate the ``mesh_*`` settings (``ValueError`` saying what is wrong); fills ``mesh_name``."""
    if cfg.mesh_port is None:
        raise ValueError("mesh_seeds need mesh_port (the mesh is off without it)")
    port = cfg.mesh_port
    if not 0 <= port < 65536:
        raise ValueError(f"mesh_port {port} out of range")
    name = validate_node_name(cfg.mesh_name or default_node_name())
    for s in cfg.mesh_seeds:  # host[:port], or dns:NAME[:PORT] (every A/AAAA record: shepherd.mesh.dns_seeds)
        parse_dns_seed(s, port or 7946) if is_dns_seed(s) else parse_addr(s, port or 7946)
    if cfg.mesh_advertise is not None:
        parse_addr(cfg.mesh_advertise, port or 7946)
    elif cfg.mesh_bind in ("0.0.0.0", "::", ""):
        raise ValueError(
            "mesh_advertise (host[:port] the other nodes reach) is required with a wildcard mesh_bind"
        )
    files = (cfg.mesh_cert, cfg.mesh_key, cfg.mesh_ca)
    if any(files) and not all(files):
        raise ValueError("mesh_cert, mesh_key and mesh_ca go together")
    if cfg.mesh_dev_pki is None and not (all(files) and (cfg.mesh_keyring_file or cfg.mesh_keys)):
        raise ValueError(
            "the mesh is sealed and mutually authenticated: give mesh_keyring_file or mesh_keys, and "
            "mesh_cert, mesh_key, mesh_ca (development certificates: `smg-node certs`), or, for development "
            "only, --mesh-dev-pki DIR (a CA and a key shared through DIR, made if missing)"
        )
    if cfg.mesh_keys:
        Keyring.from_b64(cfg.mesh_keys)  # KeyringError is a ValueError
    for k in ("mesh_probe_interval", "mesh_probe_timeout", "mesh_push_pull_interval", "mesh_gossip_interval"):
        v = getattr(cfg, k)
        if v is not None and not v > 0:
            raise ValueError(f"{k} must be > 0")
    if not cfg.mesh_dns_refresh_interval > 0:
        raise ValueError("mesh_dns_refresh_interval must be > 0")
    if cfg.mesh_suspicion_mult is not None and cfg.mesh_suspicion_mult < 1:
        raise ValueError("mesh_suspicion_mult must be >= 1")
    return dataclasses.replace(cfg, mesh_name=name)


RATE_LIMIT_BACKENDS = ("mesh", "redis")


def check_rate_limit_backend(cfg: NodeConfig) -> None:
    """The ``rate_limit_backend`` settings (``ConfigError``; the URL, which may hold a password, is never
    quoted back)."""
    b, url = cfg.rate_limit_backend, cfg.rate_limit_redis_url
    if b not in RATE_LIMIT_BACKENDS:
        raise ConfigError(f"rate_limit_backend {b!r} is unknown (one of {', '.join(RATE_LIMIT_BACKENDS)})")
    if b == "mesh":
        if url is not None:
            raise ConfigError("rate_limit_redis_url is for rate_limit_backend redis (the backend is mesh)")
        return
    if url is None:
        raise ConfigError("rate_limit_backend redis needs rate_limit_redis_url (redis://host:6379/0)")
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme not in _HISTORY_SCHEMES["redis"] or len(url) > 4096 or not url.isprintable():
        raise ConfigError("rate_limit_redis_url must be a redis://, rediss:// or unix:// URL")
    if not cfg.rate_limit_redis_prefix or not cfg.rate_limit_redis_prefix.isprintable():
        raise ConfigError("rate_limit_redis_prefix must be a non-empty printable string")
    if not 0 < cfg.rate_limit_redis_timeout_secs <= 10:
        raise ConfigError("rate_limit_redis_timeout_secs must be within (0, 10]")
    if not cfg.rate_limit_redis_lease_secs >= 3 * cfg.rate_limit_redis_timeout_secs:
        raise ConfigError("rate_limit_redis_lease_secs must be at least 3 x rate_limit_redis_timeout_secs")


HISTORY_BACKENDS = ("memory", "sqlite", "postgres", "redis")
_HISTORY_SCHEMES = {
    "sqlite": ("sqlite",),
    "postgres": ("postgres", "postgresql"),
    "redis": ("redis", "rediss", "unix"),
}


def check_client_front(cfg: NodeConfig) -> None:
    """``max_connections_per_client`` and ``proxy_protocol_from`` (the lean server's, plain or TLS)."""
    if cfg.max_connections_per_client < 0:
        raise ConfigError("max_connections_per_client must be >= 0 (0: no cap)")
    if not (cfg.proxy_protocol_from or cfg.max_connections_per_client):
        return
    if cfg.http_server != "lean":
        raise ConfigError("proxy_protocol_from and max_connections_per_client need http_server lean")
    for raw in cfg.proxy_protocol_from:
        try:
            net = ipaddress.ip_network(raw, strict=False)
        except ValueError:
            raise ConfigError(f"proxy_protocol_from: {raw!r} is not an IP address or a CIDR") from None
        if isinstance(net, ipaddress.IPv6Network) and net.network_address.ipv4_mapped is not None:
            raise ConfigError(
                f"proxy_protocol_from: {raw!r} is an IPv4-mapped address: write the IPv4 one (a mapped peer "
                "is matched as IPv4)"
            )


def check_history(cfg: NodeConfig, *, explicit_backend: bool = True) -> NodeConfig:
    """Validate the ``history_*`` settings and ``data_dir`` (``ConfigError`` saying what is wrong); a
    ``sqlite`` backend without ``history_url`` gets ``<data_dir>/history.db``. In a mesh, a ``memory``
    backend chosen explicitly is refused unless ``history_allow_local`` says the trade-off is accepted
    (the default backend is let through with a warning at start: ``shepherd.node.cluster.history``)."""
    b = cfg.history_backend
    if b not in HISTORY_BACKENDS:
        raise ConfigError(f"history_backend {b!r} is unknown (one of {', '.join(HISTORY_BACKENDS)})")
    if cfg.data_dir is not None and (not cfg.data_dir or "\x00" in cfg.data_dir):
        raise ConfigError("data_dir must be a directory path")
    url = cfg.history_url
    if b == "memory":
        if url is not None:
            raise ConfigError("history_url is for the sqlite, postgres and redis backends, not memory")
    elif url is None:
        if b != "sqlite":
            raise ConfigError(f"history_backend {b} needs history_url ({_HISTORY_SCHEMES[b][0]}://...)")
        if cfg.data_dir is None:
            raise ConfigError("history_backend sqlite needs history_url (sqlite:///path.db) or data_dir")
        url = "sqlite:///" + str(Path(cfg.data_dir).absolute() / "history.db")  # sqlite:////abs/path.db
        cfg = dataclasses.replace(cfg, history_url=url)
    else:
        scheme = url.partition("://")[0].lower() if "://" in url else ""
        if scheme not in _HISTORY_SCHEMES[b] or len(url) > 4096 or not url.isprintable():
            raise ConfigError(
                f"history_url must be a {_HISTORY_SCHEMES[b][0]}:// URL for history_backend {b}"
            )
    if not cfg.history_retention_days >= 0:
        raise ConfigError("history_retention_days must be >= 0 (0: records are kept for ever)")
    if cfg.history_memory_max_items < 1 or cfg.history_memory_max_bytes < 1:
        raise ConfigError("history_memory_max_items and history_memory_max_bytes must be >= 1")
    if cfg.history_migrations not in ("apply", "refuse"):
        raise ConfigError("history_migrations must be 'apply' or 'refuse'")
    if cfg.history_pool_size < 1:
        raise ConfigError("history_pool_size must be >= 1")
    if not 1 <= cfg.history_chain_max_depth <= 100_000:
        raise ConfigError("history_chain_max_depth must be in 1..100000")
    mesh_on = cfg.mesh_port is not None
    if mesh_on and b == "memory" and explicit_backend and not cfg.history_allow_local:
        raise ConfigError(
            "history_backend memory in a mesh keeps each conversation and response only in the memory of "
            "the node that made it: other nodes reach it through that node, and it is lost when that node "
            "restarts. Set history_allow_local (--history-allow-local) to accept this, or use "
            "history_backend sqlite (with data_dir or history_url), postgres or redis"
        )
    return cfg
