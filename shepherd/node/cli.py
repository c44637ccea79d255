"""``smg-node``: run a gateway node. Flags mirror ``smg launch`` where the concept is the same; SMG's other
flags are renamed, ignored with a warning or refused with a message (``smg_flags``)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import resource
import sys
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from shepherd.auth import config as auth_flags
from shepherd.node.smg_flags import SmgFlagError, translate

if TYPE_CHECKING:
    from shepherd.node.config import NodeConfig

log = logging.getLogger("shepherd.node")


def _attempts(value: str) -> int:
    """``--retry-max-retries N``: SMG's attempts in all (its retry loop calls the worker N times, at least
    once) -> the node's retries after the first attempt."""
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {n}")
    return max(1, n) - 1


def _mesh_arguments(s: argparse.ArgumentParser) -> None:
    m = s.add_argument_group("mesh (off unless --mesh-port is given; sealed and mTLS: keys + certificates)")
    m.add_argument("--mesh-port", type=int, help="UDP gossip + TCP sync port (e.g. 7946); turns the mesh on")
    m.add_argument("--mesh-name", help="this node's mesh name, as in its certificate (default: host name)")
    m.add_argument("--mesh-bind", help="address to bind (default 127.0.0.1)")
    m.add_argument(
        "--mesh-advertise", help="host[:port] the other nodes reach (required for a wildcard bind)"
    )
    m.add_argument(
        "--mesh-seeds",
        nargs="+",
        action="extend",
        metavar="SEED",
        help="nodes to join through: HOST[:PORT], or dns:NAME[:PORT] (every A/AAAA record of NAME, e.g. a "
        "headless service; re-resolved until joined)",
    )
    m.add_argument(
        "--mesh-dns-refresh-interval",
        type=float,
        help="dns: seeds are resolved again this often while the mesh is small, s (default 30)",
    )
    m.add_argument("--mesh-keyring-file", help="file of base64 AES keys, one a line, the first primary")
    m.add_argument(
        "--mesh-keys", nargs="+", action="extend", metavar="B64", help="base64 AES keys (after the file's)"
    )
    m.add_argument("--mesh-cluster", help="cluster name bound into every sealed packet")
    m.add_argument("--mesh-cert", help="this node's certificate (PEM; `smg-node certs` makes dev ones)")
    m.add_argument("--mesh-key", help="its private key (PEM)")
    m.add_argument("--mesh-ca", help="the mesh CA bundle (PEM)")
    m.add_argument(
        "--mesh-dev-pki",
        metavar="DIR",
        help="DEVELOPMENT ONLY: a CA, key file and this node's certificate in DIR, made if missing "
        "(nodes sharing DIR trust each other)",
    )
    m.add_argument("--mesh-probe-interval", type=float, help="SWIM probe interval, s (default 0.4)")
    m.add_argument("--mesh-probe-timeout", type=float, help="SWIM probe timeout, s (default interval / 2)")
    m.add_argument("--mesh-push-pull-interval", type=float, help="full TCP sync period, s (default 15)")
    m.add_argument("--mesh-suspicion-mult", type=int, help="suspicion timeout multiplier (default 5)")
    m.add_argument("--mesh-gossip-interval", type=float, help="gossip period, s (default 0.2)")
    m.add_argument(
        "--mesh-index-replication",
        choices=("auto", "all", "none", "ends"),
        help="prefix-index deltas sent to the nodes routing the same model: auto (default: routing "
        "decisions for workers without a live KV-event stream), all (every worker's), none, ends (every "
        "routing decision as a turn end, its prompt's last block name: sparse, a few bytes a request)",
    )
    m.add_argument(
        "--mesh-index-turn-ends",
        type=int,
        help="with --mesh-index-replication ends: the peers' turn ends kept per model (default 8388608, "
        "16 bytes each)",
    )


def _history_arguments(s: argparse.ArgumentParser) -> None:
    h = s.add_argument_group("history storage (Responses, Conversations; the node's API keys)")
    h.add_argument("--history-backend", choices=("memory", "sqlite", "postgres", "redis"))
    h.add_argument(
        "--history-url", help="sqlite:///path.db, postgresql://user@host/db or redis://host:6379/0"
    )
    h.add_argument("--history-retention-days", type=float, help="purge records older (default 30; 0: never)")
    h.add_argument(
        "--reasoning-keyring-file",
        metavar="PATH",
        help="keys of reasoning items' encrypted_content, as --mesh-keyring-file's (the first seals, all "
        "open): blobs open after a restart and on every node given the file (default: the mesh's keys, or a "
        "key of the process)",
    )
    h.add_argument(
        "--history-allow-local",
        action="store_const",
        const=True,
        help="in a mesh, keep conversations in this node's memory anyway (lost when it restarts)",
    )
    h.add_argument("--history-memory-max-items", type=int, help="memory backend bound (oldest evicted)")
    h.add_argument("--history-memory-max-bytes", type=int, help="memory backend bound on item bytes (1 GiB)")
    h.add_argument(
        "--history-migrations",
        choices=("apply", "refuse"),
        help="postgres schema migrations: apply at start under an advisory lock, or refuse and print the SQL",
    )
    h.add_argument("--history-pool-size", type=int, help="postgres / redis connections (default 8)")
    h.add_argument("--data-dir", help="the node's durable records (API keys) in DIR/node.db")


def _security_arguments(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("control plane and workers (see SECURITY.md)")
    g.add_argument(
        "--admin-host",
        help="the control plane's own listener (/admin/*, /workers*, /mesh/*, /metrics; default 127.0.0.1 "
        "with --admin-port): the client port then serves none of it",
    )
    g.add_argument("--admin-port", type=int)
    g.add_argument(
        "--insecure-admin",
        action="store_const",
        const=True,
        help="allow an unauthenticated control plane on a non-loopback address (logged loudly)",
    )
    g.add_argument(
        "--admin-allowed-origins",
        nargs="+",
        action="extend",
        metavar="ORIGIN",
        help="browser Origins allowed on /admin",
    )
    g.add_argument(
        "--cors-allowed-origins",
        nargs="+",
        action="extend",
        metavar="ORIGIN",
        help="browser Origins allowed on the data plane (CORS; '*': any; default: none, off)",
    )
    g.add_argument(
        "--admin-allowed-hosts",
        nargs="+",
        action="extend",
        metavar="HOST",
        help="Host names the control plane answers on a non-loopback listener (DNS rebinding guard; "
        "default with --insecure-admin: the listener's address and this machine's name; .suffix "
        "matches names under it; '*': any)",
    )
    g.add_argument(
        "--worker-allow",
        nargs="+",
        action="extend",
        metavar="HOST_OR_CIDR",
        help="hosts and CIDRs workers may be on (default: any but link-local / cloud metadata addresses, "
        "which only an entry naming them allows)",
    )
    g.add_argument("--max-client-connections", type=int, help="client connections at once (default 10000)")
    g.add_argument(
        "--max-connections-per-client",
        type=int,
        help="client connections one address (an IPv6 /64) may hold at once (default 0: no cap); behind a "
        "load balancer, with --proxy-protocol-from",
    )
    g.add_argument(
        "--proxy-protocol-from",
        nargs="+",
        action="extend",
        metavar="IP_OR_CIDR",
        help="load balancers whose connections open with a PROXY protocol header (v1 or v2: HAProxy's "
        "send-proxy, AWS NLB's proxy protocol): the client it names is the connection's address "
        "(logs, traces, the failed-authentication limiter, --max-connections-per-client); their "
        "connections without one are closed; with --tls-cert-file the header comes before the client's TLS "
        "(a balancer passing TLS through)",
    )


def _discovery_arguments(s: argparse.ArgumentParser) -> None:
    d = s.add_argument_group("Kubernetes worker discovery (SMG's flags; needs the k8s extra: lightkube)")
    d.add_argument(
        "--service-discovery",
        action="store_const",
        const=True,
        help="add and remove workers as pods matching the selectors come, go and turn ready",
    )
    d.add_argument(
        "--selector", nargs="+", action="extend", metavar="KEY=VALUE", help="labels of regular worker pods"
    )
    d.add_argument(
        "--prefill-selector", nargs="+", action="extend", metavar="KEY=VALUE", help="PD: prefill worker pods"
    )
    d.add_argument(
        "--decode-selector", nargs="+", action="extend", metavar="KEY=VALUE", help="PD: decode worker pods"
    )
    d.add_argument(
        "--service-discovery-namespace", help="namespace to watch (default: the service account's)"
    )
    d.add_argument("--service-discovery-port", type=int, help="worker port of a pod (default 8000)")
    d.add_argument(
        "--service-discovery-protocol",
        choices=("grpc", "grpcs", "sglang", "vllm", "http", "https"),
        help="worker URL scheme of discovered pods (default grpc)",
    )
    d.add_argument(
        "--worker-ports-annotation", help="pod annotation listing its worker ports (smg.ai/worker-ports)"
    )
    d.add_argument(
        "--bootstrap-port-annotation",
        help="prefill pod annotation with its bootstrap port (sglang.ai/bootstrap-port)",
    )
    d.add_argument(
        "--model-id-source",
        metavar="SOURCE",
        help="a pod's model id: namespace, label:KEY or annotation:KEY (default: the node's model)",
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="smg-node", description="Shepherd gateway node")
    sub = p.add_subparsers(dest="command", required=True)
    s = argparse.ArgumentParser(add_help=False)  # the flags of serve (join takes them too)
    s.add_argument("--config", help="YAML file with the same settings (flags override it)")
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument(
        "--worker-urls",
        nargs="+",
        action="extend",
        metavar="URL",
        help="engines: grpc://h:p (SGLang, vLLM, TensorRT-LLM or MLX, detected), sglang://h:p, vllm://h:p, "
        "trtllm://h:p, mlx://h:p, http://h:p (relay)",
    )
    s.add_argument(
        "--policy", help="round_robin (default), random, power_of_two, least_load, cache_aware, ..."
    )
    ca = s.add_argument_group("cache_aware (README: Routing); the first three as in SGLang / SMG")
    ca.add_argument("--cache-threshold", type=float, help="a match at or below this share is a miss (0.3)")
    ca.add_argument("--balance-abs-threshold", type=int, help="imbalanced: max - min load above this (64)")
    ca.add_argument("--balance-rel-threshold", type=float, help="and max above this times min (1.5)")
    ca.add_argument("--cache-move-base", type=float, help="load a follow-up's move must save (10)")
    ca.add_argument(
        "--cache-move-tokens-per-load", type=float, help="and 1 per this many tokens to prefill again (256)"
    )
    ca.add_argument(
        "--conversation-weight", type=float, help="load one carried conversation adds for new ones (1)"
    )
    ca.add_argument(
        "--conversation-lifetime-secs", type=float, help="a placement's weight decays with this (60)"
    )
    ca.add_argument(
        "--shared-prefix-tokens-per-load", type=float, help="a missing shared prefix: 1 per this many (512)"
    )
    ca.add_argument(
        "--shared-prefix-after", type=int, help="a prefix end that ended this many matches is shared (1)"
    )
    pd = s.add_argument_group("PD disaggregation (SGLang bootstrap or vLLM KV transfer, by engine kind)")
    pd.add_argument("--pd-disaggregation", action="store_true", default=None, help="prefill/decode pools")
    pd.add_argument(
        "--prefill",
        action="append",
        nargs="+",
        metavar=("URL", "BOOTSTRAP_PORT"),
        help="a prefill worker and its SGLang bootstrap port (default 8998); repeatable",
    )
    pd.add_argument("--decode", dest="decode_urls", action="append", metavar="URL", help="repeatable")
    pd.add_argument("--prefill-policy", help="policy of the prefill pool (default: --policy)")
    pd.add_argument("--decode-policy", help="policy of the decode pool (default: --policy)")
    s.add_argument(
        "--model-path",
        help="dir with tokenizer.json(.xz) + tokenizer_config.json (default: from the gRPC engines, "
        "GetTokenizer; else the embedded qwen3)",
    )
    s.add_argument("--tokenizer-path", dest="model_path_alias", help="alias of --model-path")
    s.add_argument(
        "--model-id",
        help="model name served to clients (default: the engine's served name, else the model dir's name)",
    )
    s.add_argument(
        "--model-alias",
        dest="model_aliases",
        nargs="+",
        action="extend",
        metavar="NAME=SERVED",
        help="clients send NAME (and /v1/models lists it) for the engine's SERVED model",
    )
    s.add_argument(
        "--tokenizer-cache-dir",
        help="where tokenizers fetched from engines (GetTokenizer) are kept, by sha256 "
        "(default: $XDG_CACHE_HOME/shepherd/tokenizers or ~/.cache/shepherd/tokenizers)",
    )
    s.add_argument("--chat-template", help="a .jinja file overriding the tokenizer's template")
    s.add_argument("--tokenizer-workers", type=int, help="tokenizer pool processes (0: all inline)")
    s.add_argument(
        "--procs",
        type=int,
        help="event-loop processes on the one port (SO_REUSEPORT), meshed on loopback (default 1)",
    )
    s.add_argument("--reuse-port", action="store_const", const=True, help="SO_REUSEPORT on the listeners")
    s.add_argument("--tokenizer-inline-max-chars", type=int)
    s.add_argument(
        "--max-payload-size", dest="max_body_bytes", type=int, help="largest request body in bytes"
    )
    s.add_argument("--request-timeout-secs", type=float)
    s.add_argument(
        "--worker-startup-timeout-secs",
        type=float,
        help="no --model-path nor --model-id: wait this long for a gRPC worker to give the model; a worker "
        "not admitted (no model info) this long after it was added is said at ERROR, shown failed (600)",
    )
    s.add_argument(
        "--retry-max-retries",
        dest="max_retries",
        type=_attempts,
        metavar="N",
        help="attempts of a request in all, as SMG counts them: N - 1 retries on another worker (0 and 1: "
        "none; the YAML's max_retries counts the retries); default 3",
    )
    s.add_argument("--health-check-interval-secs", type=float)
    s.add_argument("--health-check-timeout-secs", type=float)
    s.add_argument("--health-failure-threshold", type=int)
    s.add_argument("--health-success-threshold", type=int)
    s.add_argument("--cb-failure-threshold", type=int)
    s.add_argument("--cb-success-threshold", type=int)
    s.add_argument("--cb-timeout-duration-secs", type=float)
    s.add_argument("--load-poll-interval-secs", type=float)
    s.add_argument("--shutdown-grace-period-secs", dest="shutdown_grace_secs", type=float)
    s.add_argument("--sse-keepalive-secs", type=float)
    s.add_argument("--stream-interval", type=int, help="ask engines for this many tokens per stream message")
    s.add_argument(
        "--engine-transport", choices=("h2", "grpcio"), help="gRPC client: h2 (lean asyncio) or grpcio"
    )
    s.add_argument(
        "--http-server",
        choices=("lean", "aiohttp"),
        help="client-facing HTTP/1.1 server: lean (httptools on asyncio, default) or aiohttp",
    )
    s.add_argument(
        "--gc-gen0-threshold",
        type=int,
        help="after start-up freeze the heap and collect generation 0 every N allocations "
        "(default 20000; 0 keeps CPython's defaults)",
    )
    s.add_argument(
        "--no-kv-events",
        dest="kv_events",
        action="store_const",
        const=False,
        help="do not subscribe to engines' KV events (the prefix index learns from routing decisions only)",
    )
    rl = s.add_argument_group("rate limits (per tenant, mesh-wide; YAML 'rate_limits': per tenant/model)")
    rl.add_argument("--rate-limit-rpm", type=int, help="default requests per minute of every tenant")
    rl.add_argument("--rate-limit-tpm", type=int, help="default tokens per minute of every tenant")
    rl.add_argument("--rate-limit-max-concurrent", type=int, help="default concurrent requests per tenant")
    rl.add_argument("--rate-limit-token-estimate", type=int, help="output tokens reserved without max_tokens")
    rl.add_argument("--rate-limit-propagation-secs", type=float, help="bound on the mesh's gossip delay")
    rl.add_argument(
        "--rate-limit-propagation-max-secs",
        type=float,
        help="the lease's τ follows the staleness of the peers' counts, up to this (default 15, at most the "
        "window; 0: τ stays --rate-limit-propagation-secs)",
    )
    rl.add_argument(
        "--rate-limit-window-secs",
        type=float,
        help="rpm/tpm are counted per window this long (default 60, as named; shorter windows are for tests)",
    )
    rl.add_argument(
        "--rate-limit-unreachable-grace-secs",
        type=float,
        help="an unreachable member that did not leave counts in the mesh size this long (default 300): "
        "a partitioned side admits its share, a crashed node lowers the others' share as long",
    )
    rl.add_argument(
        "--rate-limit-backend",
        choices=("mesh", "redis"),
        help="where the counts live: mesh (gossiped, default) or redis (one shared counter store)",
    )
    rl.add_argument("--rate-limit-redis-url", metavar="URL", help="redis://[user:password@]host:6379/0")
    rl.add_argument("--rate-limit-redis-prefix", help="key prefix in Redis (default shepherd:rl:)")
    rl.add_argument(
        "--rate-limit-redis-timeout-secs",
        type=float,
        help="bound on one Redis call (default 0.1); past it, and while Redis is down, the node admits "
        "limit / N on its own counts (N: the mesh's nodes)",
    )
    rl.add_argument(
        "--rate-limit-redis-lease-secs",
        type=float,
        help="a concurrency slot expires this long after its node last renewed it (a crashed node's "
        "in-flight requests stop counting; default 30)",
    )
    s.add_argument(
        "--reasoning-parser", help="reasoning parser family (qwen3, deepseek_r1, ...; default: by model name)"
    )
    s.add_argument(
        "--tool-call-parser", help="tool-call parser family (hermes, llama3, ...; default: by model name)"
    )
    s.add_argument(
        "--reasoning-field",
        choices=["both", "reasoning", "reasoning_content"],
        help="chat answers carry reasoning as 'reasoning' (vLLM), 'reasoning_content', or both (default)",
    )
    s.add_argument(
        "--reject-schema-violations",
        action="store_true",
        default=None,
        help="answer 422 when the engine's output breaks a strict json_schema or strict tool "
        "(default: return it, the violation in x-smg-schema-violation and the choice's schema_violation)",
    )
    s.add_argument("--log-level", choices=["debug", "info", "warning", "warn", "error"])
    ob = s.add_argument_group("observability (traces off by default; OTEL_* variables are read too)")
    ob.add_argument("--enable-trace", action="store_const", const=True, help="OpenTelemetry traces (OTLP)")
    ob.add_argument("--otlp-traces-endpoint", metavar="URL", help="collector (host:4317); turns traces on")
    ob.add_argument("--otlp-traces-protocol", choices=("grpc", "http/protobuf"), help="default grpc")
    ob.add_argument("--otlp-metrics-endpoint", metavar="URL", help="OTLP export of the GenAI metrics")
    ob.add_argument("--log-format", choices=("text", "json"), help="json: one object a line, with ids")
    ob.add_argument("--access-log", action="store_const", const=True, help="one log line per request")
    auth_flags.add_arguments(s)  # --auth-*, --jwt-*, --tls-*, --engine-tls-*
    _mesh_arguments(s)
    _history_arguments(s)
    _security_arguments(s)
    _discovery_arguments(s)
    sub.add_parser("serve", parents=[s], help="run a node")
    j = sub.add_parser(
        "join", parents=[s], help="run a node that joins a mesh through SEED... (serve's flags)"
    )
    j.add_argument(
        "seeds",
        nargs="+",
        action="extend",
        metavar="SEED",
        help="host[:port] of mesh nodes (tried until one answers), or dns:NAME[:PORT] (every A/AAAA record)",
    )
    c = sub.add_parser("certs", help="write a development CA and mesh node certificates (mTLS)")
    c.add_argument("--out", required=True, help="directory for <name>.pem and <name>-key.pem")
    c.add_argument("--nodes", required=True, help="comma-separated node names")
    c.add_argument("--ca-dir", help="dir of ca.pem + ca-key.pem: reused if there, else made (default --out)")
    return p


def config_from_args(argv: list[str]) -> Any:
    # the node's modules are imported in the functions that need them, not at the top: they import
    # grpcio, which reads its settings (GRPC_ENABLE_FORK_SUPPORT) once, at import, and main sets them first
    from shepherd.node.config import ConfigError, build_config, load_yaml

    try:
        argv = translate(argv).argv  # SMG's own flags: renamed, ignored or refused (smg_flags)
    except SmgFlagError as e:
        raise ConfigError(str(e)) from None
    args = _parser().parse_args(argv)
    values = vars(args)
    command = values.pop("command")
    config_file = values.pop("config", None)
    file_values = load_yaml(config_file) if config_file else {}
    if command == "join":  # serve, with seeds (and the mesh on, on its default port unless one is set)
        values["mesh_seeds"] = [
            *values.pop("seeds"),
            *(values.get("mesh_seeds") or file_values.get("mesh_seeds") or []),
        ]
        if values.get("mesh_port") is None and file_values.get("mesh_port") is None:
            values["mesh_port"] = 7946
    values["auth"] = auth_flags.pop_overrides(values)
    prefill = values.pop("prefill", None)
    if prefill:
        values["prefill_urls"], values["prefill_bootstrap_ports"] = _prefill_args(prefill)
    alias = values.pop("model_path_alias")
    if alias and not values.get("model_path"):
        values["model_path"] = alias
    if values.get("log_level") == "warn":
        values["log_level"] = "warning"
    cfg = build_config(file_values, values)
    if config_file:  # SIGHUP / POST /admin/reload: the file read again, these flags over it
        cfg = dataclasses.replace(cfg, config_file=str(config_file), config_overrides=values)
    return cfg


def _prefill_args(entries: list[list[str]]) -> tuple[list[str], list[int | None]]:
    """``--prefill URL [BOOTSTRAP_PORT]`` entries -> (URLs, ports or None)."""
    from shepherd.node.config import ConfigError  # not at the top: see config_from_args

    urls: list[str] = []
    ports: list[int | None] = []
    for e in entries:
        if len(e) > 2 or (len(e) == 2 and not e[1].isdigit()):
            raise ConfigError(f"--prefill takes a URL and an optional bootstrap port, not {' '.join(e)!r}")
        urls.append(e[0])
        ports.append(int(e[1]) if len(e) == 2 else None)
    return urls, ports


def _certs(argv: list[str]) -> int:
    """``smg-node certs``: a development CA (reused if present) and one certificate per node name."""
    from shepherd.auth.certs import CertError, write_dev_pki  # not at the top: see config_from_args

    args = _parser().parse_args(argv)
    names = [n.strip() for n in args.nodes.split(",") if n.strip()]
    if not names:
        print("smg-node certs: --nodes needs at least one name", file=sys.stderr)
        return 2
    try:
        files = write_dev_pki(args.out, names, ca_dir=args.ca_dir)
    except (CertError, OSError) as e:
        print(f"smg-node certs: {e}", file=sys.stderr)
        return 2
    for name, f in files.items():
        print(f"{name}: cert={f.cert} key={f.key} ca={f.ca}")
    return 0


def _raise_open_files_limit() -> None:
    """The soft open-files limit raised to the hard one (what a service manager allows): each client
    connection is a descriptor, and the connection cap shrinks to fit the soft limit (LeanServer)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY:
            hard = 1 << 20
        if soft != resource.RLIM_INFINITY and soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):  # not allowed here: the cap adapts
        pass


def main(argv: list[str] | None = None) -> None:
    # grpcio reads its experiments at import: the poller-based engine costs fewer wake-ups per message
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
    from shepherd.node.config import ConfigError  # not at the top: after the env (config_from_args)

    try:
        if (sys.argv[1:] if argv is None else argv)[:1] == ["certs"]:
            raise SystemExit(_certs(sys.argv[1:] if argv is None else argv))
        cfg = config_from_args(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"smg-node: configuration error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if cfg.procs > 1:  # N event-loop processes on the port, meshed on loopback (shepherd.node.procs)
        from shepherd.node import procs  # not at the top: see config_from_args

        try:
            procs.check(cfg)
        except procs.ProcsError as e:
            print(f"smg-node: configuration error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        raise SystemExit(procs.supervise(sys.argv[1:] if argv is None else argv, cfg))
    from shepherd.node.observe import logs  # not at the top: see config_from_args

    logs.configure(cfg.log_level, cfg.log_format, cfg.access_log, logs.config_secrets(cfg))
    for note in translate(sys.argv[1:] if argv is None else argv).notes:  # (refusals raised above)
        log.warning("%s", note)
    _raise_open_files_limit()
    from shepherd.node.app import serve  # not at the top: see config_from_args
    from shepherd.storage.types import StorageError  # not at the top: see config_from_args

    try:
        try:
            import uvloop  # optional at run time: without it, asyncio's own loop

            uvloop.run(serve(cfg))
        except ImportError:  # pragma: no cover - uvloop is a dependency; keep the node usable without it
            asyncio.run(serve(cfg))
    except KeyboardInterrupt:
        pass
    except ConfigError as e:  # found at start-up (engines asked, stores opened): as the flags' errors
        print(f"smg-node: configuration error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except StorageError as e:  # the history backend could not be opened (unreachable, its schema)
        print(f"smg-node: configuration error: {history_unavailable(cfg, e)}", file=sys.stderr)
        raise SystemExit(2) from None


def redact_url(url: str | None) -> str:
    """``url`` with its password (if any) replaced by ``***``: what an error message may show."""
    if not url:
        return "(no URL)"
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "(an unreadable URL)"
    if not password:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def history_unavailable(cfg: NodeConfig, e: BaseException) -> str:
    """The history backend and its URL (password redacted) and why it failed: one line when it is
    unreachable (a refused schema migration keeps its SQL as it is)."""
    from shepherd.storage.types import StorageUnavailable  # not at the top: see config_from_args

    url = cfg.history_url
    text = (" ".join(str(e).split()) if isinstance(e, StorageUnavailable) else str(e)) or type(e).__name__
    try:
        password = urlsplit(url).password if url else None
    except ValueError:
        password = None
    if password:
        text = text.replace(password, "***")
    return (
        f"history_backend {cfg.history_backend} at {redact_url(url)} cannot be used: {text} (check "
        "--history-url and that the database is reachable)"
    )


if __name__ == "__main__":
    main()
