"""``smg launch``'s flags on ``smg-node serve`` (and those sglang-router 0.3.2 and vllm-router 0.1.17 add to
them): such a router's command line moved over as it is starts a node, or stops with a message naming each
flag it cannot honour, never argparse's bare "unrecognized arguments".

``translate(argv)`` rewrites the argv before the node's parser reads it. Every flag of SMG 1.13.0 that the
node's parser does not take itself (``FLAGS``: its arity there) has one of three fates:

* **renamed** to the node's flag of the same meaning (``--tls-cert-path`` -> ``--tls-cert-file``,
  ``--disable-retries`` -> ``--retry-max-retries 0``, ``--redis-url`` -> ``--history-url`` ...);
* **ignored**, with a note the node logs at WARNING once it starts: tuning of SMG's own machinery (its
  tree, queues, warm-up, multimodal transport, tokenizer caches), which changes no answer and opens
  nothing here; the note says what the node does instead where it does something;
* **refused** (``SmgFlagError``, a configuration error naming the flag and what to use): a flag whose
  silent loss would change who may call, what a worker is sent, or what clients get (API keys, worker
  keys, other backends, WASM, MCP, Oracle, an admission limit).

Flags both take (``--host``, ``--worker-urls``, ``--policy``, ``--cache-threshold`` ...) pass through;
vllm-router's policy names ``consistent_hash`` and ``kv_aware`` become ``consistent_hashing`` and
``cache_aware`` (which the engines' KV events feed, as kv_aware's do).
Pure: no I/O, so the table is tested flag by flag against SMG's own ``--help``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["FLAGS", "ROUTER_FLAGS", "SmgFlagError", "Translated", "translate"]


class SmgFlagError(ValueError):
    """An SMG flag the node cannot honour (the message names it and what to use instead)."""


@dataclass(frozen=True, slots=True)
class Translated:
    argv: list[str]
    notes: list[str]  # one line per ignored flag, for the log


def _words(s: str) -> list[str]:
    return s.split()


# SMG 1.13.0's flags the node's parser does not take, with their arity there ("0" a switch, "1" one
# value, "*" zero or more, "+" one or more)
FLAGS: dict[str, str] = {
    **dict.fromkeys(
        _words(
            "--upstream-http2 --worker-overload-protection --disable-worker-overload-protection "
            "--worker-overload-shed --dp-aware --routing-key-override --dp-minimum-tokens-scheduler "
            "--enable-igw --enable-rl --epd-disaggregation --disable-load-monitoring --mm-pixel-rdma "
            "--mm-allow-private-media-hosts --log-mm-timing --log-json --trust-tenant-header "
            "--priority-scheduler-enabled --tenant-rate-limit-enabled --disable-retries "
            "--disable-circuit-breaker --disable-health-check --remove-unhealthy-workers "
            "--no-remove-unhealthy-workers --worker-auto-recovery --no-worker-auto-recovery "
            "--disable-tokenizer-autoload --tokenizer-cache-enable-l0 --tokenizer-cache-enable-l1 "
            "--enable-wasm --oracle-external-auth --control-plane-audit-enabled --enable-mesh"
        ),
        "0",
    ),
    **dict.fromkeys(
        _words(
            "--routing-key-headers --request-id-headers --storage-context-headers --ca-cert-paths "
            "--control-plane-api-keys --jwt-role-mapping --mesh-peer-urls"
        ),
        "*",
    ),
    **dict.fromkeys(
        _words("--encode --encode-selector --router-selector --prometheus-duration-buckets"), "+"
    ),
    **dict.fromkeys(
        _words(
            "--upstream-pool-idle-timeout-secs --health-check-port --encode-policy --prefix-token-count "
            "--prefix-hash-load-factor --prefix-hash-balance-abs-threshold --least-load-kv-pressure-weight "
            "--least-load-default-throughput --least-load-mean-prefill-tokens "
            "--least-load-max-waiting-requests --power-of-two-load-metric --balance-token-usage-threshold "
            "--overload-token-usage-threshold --worker-overload-waiting-requests "
            "--worker-overload-token-usage --kv-index --worker-stall-secs --worker-wedge-secs "
            "--worker-stale-secs --worker-warmup-secs --worker-warmup-share --worker-warmup-blocks "
            "--worker-warmup-thin-ratio --worker-warmup-divert-every --selection-policy "
            "--selection-accounting-ttl-ms --overlap-decay --selection-temperature "
            "--bucket-adjust-interval-secs --eviction-interval-secs --max-tree-size --block-size "
            "--cache-boundaries --cache-index --cache-ttl-secs --max-idle-secs --assignment-mode "
            "--max-buffered-request-bytes --pd-admission-wait-secs --stream-body-stall-timeout-secs "
            "--rl-control-timeout-secs --rl-fanout-concurrency --prefill-max-inflight-requests-per-worker "
            "--prefill-queue-size --prefill-queue-timeout-secs --worker-startup-delay "
            "--worker-startup-check-interval --job-queue-capacity --job-queue-concurrency "
            "--load-monitor-interval --multimodal-tensor-transport --multimodal-shm-min-bytes "
            "--multimodal-max-inflight-bytes --mm-per-request-image-limit --mm-processing "
            "--mm-pixel-cache-mb --mm-allowed-media-domains --rdma-listen-ip --rdma-slot-ttl-s --log-dir "
            "--discovery-provider --discovery-file --discovery-check-interval-secs "
            "--kv-connector-annotation --kv-engine-id-annotation --model-id-from --prometheus-port "
            "--prometheus-host --jemalloc-prof-dir --header-read-timeout-secs "
            "--idle-connection-timeout-secs --tenant-header-name --max-concurrent-requests --queue-size "
            "--queue-timeout-secs --rate-limit-tokens-per-second --max-background-responses "
            "--priority-scheduler-default-max-class --priority-scheduler-config "
            "--priority-scheduler-tenant-metric-top-n --tenant-rate-limit-config "
            "--retry-initial-backoff-ms --retry-max-backoff-ms --retry-backoff-multiplier "
            "--retry-jitter-factor --cb-window-duration-secs --health-check-endpoint --parser "
            "--tokenizer-cache-l0-max-entries --tokenizer-cache-l0-max-memory "
            "--tokenizer-cache-l1-max-memory --mcp-config-path --backend --zmq-engine-count "
            "--storage-hook-wasm-path --history-memory-max-responses --history-memory-retention-secs "
            "--oracle-wallet-path --oracle-tns-alias --oracle-connect-descriptor --oracle-username "
            "--oracle-password --oracle-pool-min --oracle-pool-max --oracle-pool-timeout-secs "
            "--postgres-db-url --postgres-pool-max --postgres-op-timeout-secs --redis-url --redis-pool-max "
            "--redis-retention-days --redis-op-timeout-secs --schema-config --client-cert-path "
            "--client-key-path --tls-cert-path --tls-key-path --api-key --tenant-api-key --jwt-jwks-uri "
            "--mesh-server-name --mesh-host --mesh-advertise-host --mesh-tls-ca-cert --mesh-tls-cert "
            "--mesh-tls-key"
        ),
        "1",
    ),
}

# the flags sglang-router 0.3.2 and vllm-router 0.1.17 have beyond SMG's (their arity)
ROUTER_FLAGS: dict[str, str] = {
    **dict.fromkeys(_words("--mini-lb --vllm-pd-disaggregation --enable-program-scheduling"), "0"),
    **dict.fromkeys(
        _words(
            "--kv-connector --vllm-discovery-address --intra-node-data-parallel-size "
            "--program-scheduling-config-json --router-temperature --kv-penalty-host "
            "--kv-penalty-external --kv-penalty-disk --kv-aware-session-affinity-ttl-secs "
            "--kv-event-source --kv-event-replay-source --kv-event-block-size --kv-event-model "
            "--pd-kv-events --wasm-middleware --wasm-middleware-sha256 --wasm-middleware-route"
        ),
        "1",
    ),
}
_ARITY = {**FLAGS, **ROUTER_FLAGS}

# vllm-router's policy names for the node's policies
_POLICY_NAMES = {"consistent_hash": "consistent_hashing", "kv_aware": "cache_aware"}
_POLICY_FLAGS = frozenset({"--policy", "--prefill-policy", "--decode-policy"})

# renamed: the node's flag of the same meaning (the values follow as given)
_RENAMED = {
    "--tls-cert-path": "--tls-cert-file",
    "--tls-key-path": "--tls-key-file",
    "--client-cert-path": "--engine-tls-cert-file",
    "--client-key-path": "--engine-tls-key-file",
    "--jwt-jwks-uri": "--jwt-jwks-url",
    "--tenant-header-name": "--auth-tenant-header",
    "--mesh-server-name": "--mesh-name",
    "--mesh-host": "--mesh-bind",
    "--mesh-advertise-host": "--mesh-advertise",
    "--mesh-tls-ca-cert": "--mesh-ca",
    "--mesh-tls-cert": "--mesh-cert",
    "--mesh-tls-key": "--mesh-key",
    "--load-monitor-interval": "--load-poll-interval-secs",
    "--model-id-from": "--model-id-source",
    "--redis-retention-days": "--history-retention-days",
    "--postgres-pool-max": "--history-pool-size",
    "--redis-pool-max": "--history-pool-size",
    "--vllm-pd-disaggregation": "--pd-disaggregation",
}

_KV_EVENTS = "KV events are read from each gRPC engine's own stream (SubscribeKvEvents)"
SMG_TENANT_HEADER = "x-smg-tenant-id"  # (SMG's --tenant-header-name default)
_JWT = frozenset({"--jwt-issuer", "--jwt-audience", "--jwt-jwks-uri"})
# switches: the node's flags that say the same
_SWITCHES = {
    "--log-json": ["--log-format", "json"],
    "--disable-retries": ["--retry-max-retries", "0"],
    "--disable-circuit-breaker": ["--cb-failure-threshold", str(1 << 30)],
}

_METRICS = "metrics are at /metrics on the admin listener (--admin-host/--admin-port), or the client port"
_AUTH = "see README 'Authentication': --auth-data-plane, --auth-admin-key-env, keys minted at /admin/keys"

_LIMITS = "rate limits per tenant: --rate-limit-rpm, -tpm, -max-concurrent or YAML rate_limits"

# refused: what to use instead
_REFUSED = {
    "--api-key": "the node sends workers no key: reach them over mTLS (--engine-tls-*) or a private network",
    "--tenant-api-key": _AUTH,
    "--control-plane-api-keys": _AUTH,
    "--jwt-role-mapping": "JWT roles come from --jwt-role-claim, --jwt-admin-roles and --jwt-admin-scopes",
    "--enable-igw": "the node serves one fleet per gateway (models: in the YAML config)",
    "--enable-rl": "no RL control plane here",
    "--rl-control-timeout-secs": "no RL control plane here",
    "--rl-fanout-concurrency": "no RL control plane here",
    "--enable-wasm": "no WASM middleware here",
    "--storage-hook-wasm-path": "no WASM storage hooks here",
    "--storage-context-headers": "no WASM storage hooks here",
    "--mcp-config-path": "no MCP tool execution in the gateway here",
    "--epd-disaggregation": "encode workers are not supported (PD is: --pd-disaggregation)",
    "--encode": "encode workers are not supported (PD is: --pd-disaggregation)",
    "--encode-policy": "encode workers are not supported",
    "--encode-selector": "encode workers are not supported",
    "--dp-aware": "data-parallel-rank routing is not supported: each engine is one worker",
    "--routing-key-override": "use --policy consistent_hashing (the routing key: README 'Routing')",
    "--routing-key-headers": "use --policy consistent_hashing (the routing key: README 'Routing')",
    "--discovery-file": "workers come from --worker-urls, POST /workers, the config or --service-discovery",
    "--router-selector": "nodes find each other through --mesh-seeds (dns:NAME for a headless service)",
    "--schema-config": "the history schema is the node's own (--history-migrations)",
    "--tenant-rate-limit-enabled": _LIMITS,
    "--tenant-rate-limit-config": _LIMITS,
    "--priority-scheduler-enabled": "no priority classes here",
    "--priority-scheduler-default-max-class": "no priority classes here",
    "--priority-scheduler-config": "no priority classes here",
    "--priority-scheduler-tenant-metric-top-n": "no priority classes here",
    "--zmq-engine-count": "engines are reached over gRPC (grpc://) or HTTP, not ZMQ",
    "--vllm-discovery-address": "PD workers come from --prefill/--decode, POST /workers or discovery",
    "--wasm-middleware": "no WASM middleware here (it would check requests: not skipped silently)",
    "--wasm-middleware-sha256": "no WASM middleware here",
    "--wasm-middleware-route": "no WASM middleware here",
    **dict.fromkeys(
        _words(
            "--oracle-wallet-path --oracle-tns-alias --oracle-connect-descriptor --oracle-username "
            "--oracle-password --oracle-external-auth --oracle-pool-min --oracle-pool-max "
            "--oracle-pool-timeout-secs"
        ),
        "no Oracle history backend: --history-backend postgres, redis, sqlite or memory",
    ),
}

# ignored (a note each): what the node does instead, where it does something
_IGNORED = {
    "--upstream-http2": "HTTP workers are reached over HTTP/1.1 with kept connections",
    "--upstream-pool-idle-timeout-secs": "",
    "--health-check-port": "/health, /liveness and /readiness are on the client port",
    "--prefix-token-count": "prefix_hash hashes the prompt's first block of tokens",
    "--prefix-hash-load-factor": "",
    "--prefix-hash-balance-abs-threshold": "",
    "--least-load-kv-pressure-weight": "least_load reads the engines' GetLoads",
    "--least-load-default-throughput": "",
    "--least-load-mean-prefill-tokens": "",
    "--least-load-max-waiting-requests": "",
    "--power-of-two-load-metric": "",
    "--balance-token-usage-threshold": "cache_aware balances on --balance-abs-threshold, -rel-threshold",
    "--overload-token-usage-threshold": "",
    "--worker-overload-waiting-requests": "an overloaded engine's RESOURCE_EXHAUSTED is retried elsewhere",
    "--worker-overload-token-usage": "",
    "--worker-overload-protection": "",
    "--disable-worker-overload-protection": "",
    "--worker-overload-shed": "",
    "--kv-index": "the cache-affinity index is fed by the engines' KV events (--no-kv-events turns that off)",
    "--worker-stall-secs": "a hung engine is found by its health checks, then one HTTP/2 PING",
    "--worker-wedge-secs": "",
    "--worker-stale-secs": "",
    "--worker-warmup-secs": "",
    "--worker-warmup-share": "",
    "--worker-warmup-blocks": "",
    "--worker-warmup-thin-ratio": "",
    "--worker-warmup-divert-every": "",
    "--selection-policy": "",
    "--selection-accounting-ttl-ms": "",
    "--overlap-decay": "",
    "--selection-temperature": "",
    "--bucket-adjust-interval-secs": "",
    "--eviction-interval-secs": "the index is bounded in bytes and evicts as it inserts",
    "--max-tree-size": "",
    "--block-size": "blocks are the engines' page size (from their KV events)",
    "--cache-boundaries": "",
    "--cache-index": "",
    "--cache-ttl-secs": "",
    "--max-idle-secs": "",
    "--assignment-mode": "",
    "--max-buffered-request-bytes": "a body is bounded by --max-payload-size",
    "--pd-admission-wait-secs": "",
    "--stream-body-stall-timeout-secs": "a stream is bounded by --request-timeout-secs",
    "--dp-minimum-tokens-scheduler": "",
    "--prefill-max-inflight-requests-per-worker": "",
    "--prefill-queue-size": "",
    "--prefill-queue-timeout-secs": "",
    "--worker-startup-delay": "",
    "--worker-startup-check-interval": "a worker not yet answering is asked again with a growing pause",
    "--job-queue-capacity": "",
    "--job-queue-concurrency": "",
    "--disable-load-monitoring": "loads are polled only for the policies that read them",
    "--multimodal-tensor-transport": "",
    "--multimodal-shm-min-bytes": "",
    "--multimodal-max-inflight-bytes": "",
    "--mm-per-request-image-limit": "",
    "--mm-processing": "",
    "--mm-pixel-cache-mb": "",
    "--mm-pixel-rdma": "",
    "--mm-allowed-media-domains": "the node fetches no media URLs",
    "--mm-allow-private-media-hosts": "the node fetches no media URLs",
    "--rdma-listen-ip": "",
    "--rdma-slot-ttl-s": "",
    "--log-mm-timing": "",
    "--log-dir": "logs go to stderr (the service manager keeps them)",
    "--discovery-check-interval-secs": "discovery watches the pods (no polling)",
    "--kv-connector-annotation": "",
    "--kv-engine-id-annotation": "",
    "--prometheus-port": _METRICS,
    "--prometheus-host": _METRICS,
    "--prometheus-duration-buckets": _METRICS,
    "--jemalloc-prof-dir": "",
    "--request-id-headers": "x-request-id is read and echoed",
    "--header-read-timeout-secs": "slow headers are bounded by the HTTP server's own timeouts",
    "--idle-connection-timeout-secs": "",
    "--queue-size": "",
    "--queue-timeout-secs": "",
    "--max-background-responses": "",
    "--retry-initial-backoff-ms": "a retry goes at once to another worker",
    "--retry-max-backoff-ms": "a retry goes at once to another worker",
    "--retry-backoff-multiplier": "a retry goes at once to another worker",
    "--retry-jitter-factor": "a retry goes at once to another worker",
    "--cb-window-duration-secs": "",
    "--health-check-endpoint": "HTTP workers are checked at /health",
    "--remove-unhealthy-workers": "an unhealthy worker stays listed and is checked until it recovers",
    "--no-remove-unhealthy-workers": "",
    "--worker-auto-recovery": "an unhealthy worker stays listed and is checked until it recovers",
    "--no-worker-auto-recovery": "",
    "--disable-tokenizer-autoload": "",
    "--parser": "",
    "--tokenizer-cache-enable-l0": "the node's token cache is always on",
    "--tokenizer-cache-enable-l1": "the node's token cache is always on",
    "--tokenizer-cache-l0-max-entries": "",
    "--tokenizer-cache-l0-max-memory": "",
    "--tokenizer-cache-l1-max-memory": "",
    "--history-memory-max-responses": "the memory backend is bounded by --history-memory-max-items/-bytes",
    "--history-memory-retention-secs": "",
    "--postgres-op-timeout-secs": "",
    "--redis-op-timeout-secs": "",
    "--control-plane-audit-enabled": "admin actions are logged",
    # (SMG's switch skips the checks at start-up; workers are admitted when they give their model)
    "--disable-health-check": "workers are health-checked from their admission",
    "--mini-lb": "PD requests go to prefill and decode from the node itself",
    "--enable-program-scheduling": "",
    "--program-scheduling-config-json": "",
    "--router-temperature": "",
    "--kv-penalty-host": "",
    "--kv-penalty-external": "",
    "--kv-penalty-disk": "",
    "--kv-aware-session-affinity-ttl-secs": "cache_aware keeps a conversation's turns together by itself",
    "--kv-event-source": _KV_EVENTS,
    "--kv-event-replay-source": _KV_EVENTS,
    "--kv-event-block-size": _KV_EVENTS,
    "--kv-event-model": _KV_EVENTS,
    "--pd-kv-events": _KV_EVENTS,
}


def _values(argv: Sequence[str], i: int, arity: str) -> tuple[list[str], int]:
    """The values of the flag at ``argv[i]`` (as ``--flag v`` or ``--flag=v``) and the next index."""
    head, eq, inline = argv[i].partition("=")
    if eq:
        return [inline], i + 1
    j = i + 1
    if arity == "0":
        return [], j
    if arity == "1":
        if j >= len(argv):
            raise SmgFlagError(f"{head} expects a value")
        return [argv[j]], j + 1
    vals: list[str] = []
    while j < len(argv) and not argv[j].startswith("--"):
        vals.append(argv[j])
        j += 1
    if arity == "+" and not vals:
        raise SmgFlagError(f"{head} expects at least one value")
    return vals, j


def translate(argv: Sequence[str]) -> Translated:
    """``argv`` with SMG's flags renamed or dropped (module doc); ``SmgFlagError`` for a refused one."""
    out: list[str] = []
    notes: list[str] = []
    given = {a.partition("=")[0] for a in argv if a.startswith("--")}
    i = 0
    while i < len(argv):
        a = argv[i]
        flag = a.partition("=")[0]
        arity = _ARITY.get(flag) if a.startswith("--") else None
        if flag == "--history-backend" and (a == "--history-backend=none" or argv[i + 1 : i + 2] == ["none"]):
            raise SmgFlagError(
                "SMG's --history-backend none is not supported: the node keeps what clients store "
                "(memory by default, bounded by --history-memory-max-items and -bytes); clients that send "
                "store:false keep nothing"
            )
        if flag in _POLICY_FLAGS:
            vals, i = _values(argv, i, "1")
            policy = _POLICY_NAMES.get(vals[0], vals[0])
            if policy != vals[0]:
                notes.append(f"{flag} {vals[0]} (vllm-router's name) is the node's {policy}")
            out += [flag, policy]
            continue
        if arity is None:
            out.append(a)
            i += 1
            continue
        vals, i = _values(argv, i, arity)
        if flag in _REFUSED:
            raise SmgFlagError(f"SMG's {flag} is not supported by this node: {_REFUSED[flag]}")
        if flag in _RENAMED:
            out += [_RENAMED[flag], *vals]
        elif flag == "--trust-tenant-header":  # (SMG's default header name, unless the line names one)
            out.append("--auth-trust-tenant-header")
            if "--tenant-header-name" not in given and "--auth-tenant-header" not in given:
                out += ["--auth-tenant-header", SMG_TENANT_HEADER]
        elif flag in _SWITCHES:
            out += _SWITCHES[flag]
        elif flag in ("--postgres-db-url", "--redis-url"):
            other = "--redis-url" if flag == "--postgres-db-url" else "--postgres-db-url"
            if other in given or "--history-url" in given:
                raise SmgFlagError(f"SMG's {flag} with {other} or --history-url: give one --history-url")
            out += ["--history-url", *vals]
        elif flag == "--ca-cert-paths":
            if len(vals) > 1:
                raise SmgFlagError(
                    f"SMG's {flag} with {len(vals)} files: --engine-tls-ca-file takes one (concatenate them)"
                )
            out += ["--engine-tls-ca-file", *vals] if vals else []
        elif flag == "--mesh-peer-urls":
            out += ["--mesh-seeds", *vals] if vals else []
        elif flag == "--enable-mesh":
            if "--mesh-port" not in given:
                out += ["--mesh-port", "39527"]  # (SMG's default mesh port)
        elif flag == "--backend":
            if vals[0] not in ("sglang", "vllm"):
                raise SmgFlagError(
                    f"SMG's --backend {vals[0]} is not supported: the node serves SGLang, vLLM, TensorRT-LLM "
                    "and MLX engines (their kind is found by asking them)"
                )
            notes.append(f"SMG's --backend {vals[0]} is ignored: each engine's kind is found by asking it")
        elif flag == "--kv-connector":
            if vals[0] != "nixl":
                raise SmgFlagError(
                    f"vllm-router's --kv-connector {vals[0]} is not supported: vLLM PD here hands the "
                    "prefill's kv_transfer_params to decode (NIXL's pull)"
                )
            notes.append("vllm-router's --kv-connector nixl is what vLLM PD here does (no flag needed)")
        elif flag == "--intra-node-data-parallel-size":
            if vals[0] != "1":
                raise SmgFlagError(
                    "vllm-router's --intra-node-data-parallel-size is not supported: an engine is a worker"
                )
        elif flag == "--discovery-provider":
            if vals[0] != "kubernetes":
                raise SmgFlagError(f"SMG's --discovery-provider {vals[0]} is not supported: use kubernetes")
            out.append("--service-discovery")
        elif flag in ("--max-concurrent-requests", "--rate-limit-tokens-per-second"):
            if vals[0] not in ("-1", "0"):
                raise SmgFlagError(
                    f"SMG's {flag} is not supported by this node: admission limits are per tenant, "
                    "--rate-limit-max-concurrent and --rate-limit-rpm (a tenant 'default' when auth is off)"
                )
        else:
            why = _IGNORED[flag]
            notes.append(f"SMG's {flag} is ignored" + (f": {why}" if why else " (no such knob here)"))
    if given & _JWT and not any(g.startswith("--auth-") or g == "--config" for g in given):
        # SMG's JWT flags are its control plane's authentication: here they only configure JWT until a
        # plane uses it; the control plane's is turned on, as SMG's is (the data plane stays as it was)
        out += ["--auth-control-plane", "jwt"]
        notes.append("SMG's --jwt-* flags: the control plane takes JWTs (--auth-control-plane jwt)")
    return Translated(out, notes)
