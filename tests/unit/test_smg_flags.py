"""SMG's ``smg launch`` flags on ``smg-node serve`` (``shepherd.node.smg_flags``): every flag of SMG 1.13.0
(its ``--help``, below) is taken by the node's parser, renamed to the node's flag of the same meaning,
ignored with a note, or refused with a message naming it; never argparse's "unrecognized arguments"."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.node.cli import _parser, config_from_args
from shepherd.node.config import ConfigError, ModelConfig
from shepherd.node.dispatch.gateway import model_parsers
from shepherd.node.smg_flags import FLAGS, ROUTER_FLAGS, SmgFlagError, translate


def _words(s: str) -> list[str]:
    return s.split()


# ``smg launch --help`` of smg 1.13.0 (pip install smg==1.13.0): each flag and its arity
SMG_1_13 = dict(
    f.rsplit(":", 1)
    for f in _words(
        "--host:1 --port:1 --worker-urls:* --upstream-http2:0 --upstream-pool-idle-timeout-secs:1 "
        "--health-check-port:1 --policy:1 --encode-policy:1 --prefill-policy:1 --decode-policy:1 "
        "--cache-threshold:1 --prefix-token-count:1 --prefix-hash-load-factor:1 "
        "--prefix-hash-balance-abs-threshold:1 --least-load-kv-pressure-weight:1 "
        "--least-load-default-throughput:1 --least-load-mean-prefill-tokens:1 "
        "--least-load-max-waiting-requests:1 --power-of-two-load-metric:1 --balance-abs-threshold:1 "
        "--balance-rel-threshold:1 --balance-token-usage-threshold:1 --overload-token-usage-threshold:1 "
        "--worker-overload-waiting-requests:1 --worker-overload-token-usage:1 "
        "--worker-overload-protection:0 --disable-worker-overload-protection:0 --worker-overload-shed:0 "
        "--kv-index:1 --worker-stall-secs:1 --worker-wedge-secs:1 --worker-stale-secs:1 "
        "--worker-warmup-secs:1 --worker-warmup-share:1 --worker-warmup-blocks:1 "
        "--worker-warmup-thin-ratio:1 --worker-warmup-divert-every:1 --selection-policy:1 "
        "--selection-accounting-ttl-ms:1 --overlap-decay:1 --selection-temperature:1 "
        "--bucket-adjust-interval-secs:1 --eviction-interval-secs:1 --max-tree-size:1 --block-size:1 "
        "--cache-boundaries:1 --cache-index:1 --cache-ttl-secs:1 --max-idle-secs:1 --assignment-mode:1 "
        "--max-payload-size:1 --max-buffered-request-bytes:1 --pd-admission-wait-secs:1 "
        "--stream-body-stall-timeout-secs:1 --sse-keepalive-secs:1 --dp-aware:0 --routing-key-override:0 "
        "--routing-key-headers:* --dp-minimum-tokens-scheduler:0 --enable-igw:0 --enable-rl:0 "
        "--rl-control-timeout-secs:1 --rl-fanout-concurrency:1 --pd-disaggregation:0 "
        "--epd-disaggregation:0 --encode:+ --prefill:+ --decode:1 "
        "--prefill-max-inflight-requests-per-worker:1 --prefill-queue-size:1 "
        "--prefill-queue-timeout-secs:1 --worker-startup-timeout-secs:1 --worker-startup-delay:1 "
        "--worker-startup-check-interval:1 --job-queue-capacity:1 --job-queue-concurrency:1 "
        "--load-monitor-interval:1 --disable-load-monitoring:0 --multimodal-tensor-transport:1 "
        "--multimodal-shm-min-bytes:1 --multimodal-max-inflight-bytes:1 --mm-per-request-image-limit:1 "
        "--mm-processing:1 --mm-pixel-cache-mb:1 --mm-pixel-rdma:0 --mm-allowed-media-domains:1 "
        "--mm-allow-private-media-hosts:0 --rdma-listen-ip:1 --rdma-slot-ttl-s:1 --log-mm-timing:0 "
        "--log-dir:1 --log-level:1 --log-json:0 --service-discovery:0 --discovery-provider:1 "
        "--discovery-file:1 --discovery-check-interval-secs:1 --selector:+ --service-discovery-port:1 "
        "--service-discovery-namespace:1 --kv-connector-annotation:1 --kv-engine-id-annotation:1 "
        "--encode-selector:+ --prefill-selector:+ --decode-selector:+ --router-selector:+ "
        "--model-id-from:1 --model-alias:1 --prometheus-port:1 --prometheus-host:1 "
        "--prometheus-duration-buckets:+ --jemalloc-prof-dir:1 --request-id-headers:* "
        "--storage-context-headers:* --request-timeout-secs:1 --shutdown-grace-period-secs:1 "
        "--header-read-timeout-secs:1 --idle-connection-timeout-secs:1 --trust-tenant-header:0 "
        "--tenant-header-name:1 --cors-allowed-origins:* --max-concurrent-requests:1 --queue-size:1 "
        "--queue-timeout-secs:1 --rate-limit-tokens-per-second:1 --max-background-responses:1 "
        "--priority-scheduler-enabled:0 --priority-scheduler-default-max-class:1 "
        "--priority-scheduler-config:1 --priority-scheduler-tenant-metric-top-n:1 "
        "--tenant-rate-limit-enabled:0 --tenant-rate-limit-config:1 --retry-max-retries:1 "
        "--retry-initial-backoff-ms:1 --retry-max-backoff-ms:1 --retry-backoff-multiplier:1 "
        "--retry-jitter-factor:1 --disable-retries:0 --cb-failure-threshold:1 --cb-success-threshold:1 "
        "--cb-timeout-duration-secs:1 --cb-window-duration-secs:1 --disable-circuit-breaker:0 "
        "--health-failure-threshold:1 --health-success-threshold:1 --health-check-timeout-secs:1 "
        "--health-check-interval-secs:1 --health-check-endpoint:1 --disable-health-check:0 "
        "--remove-unhealthy-workers:0 --no-remove-unhealthy-workers:0 --worker-auto-recovery:0 "
        "--no-worker-auto-recovery:0 --model-path:1 --tokenizer-path:1 --chat-template:1 "
        "--disable-tokenizer-autoload:0 --parser:1 --tokenizer-cache-enable-l0:0 "
        "--tokenizer-cache-l0-max-entries:1 --tokenizer-cache-enable-l1:0 "
        "--tokenizer-cache-l0-max-memory:1 --tokenizer-cache-l1-max-memory:1 --reasoning-parser:1 "
        "--tool-call-parser:1 --mcp-config-path:1 --backend:1 --zmq-engine-count:1 --enable-wasm:0 "
        "--storage-hook-wasm-path:1 --history-backend:1 --history-memory-max-responses:1 "
        "--history-memory-max-items:1 --history-memory-retention-secs:1 --oracle-wallet-path:1 "
        "--oracle-tns-alias:1 --oracle-connect-descriptor:1 --oracle-username:1 --oracle-password:1 "
        "--oracle-external-auth:0 --oracle-pool-min:1 --oracle-pool-max:1 --oracle-pool-timeout-secs:1 "
        "--postgres-db-url:1 --postgres-pool-max:1 --postgres-op-timeout-secs:1 --redis-url:1 "
        "--redis-pool-max:1 --redis-retention-days:1 --redis-op-timeout-secs:1 --schema-config:1 "
        "--client-cert-path:1 --client-key-path:1 --ca-cert-paths:* --tls-cert-path:1 --tls-key-path:1 "
        "--enable-trace:0 --otlp-traces-endpoint:1 --api-key:1 --tenant-api-key:1 "
        "--control-plane-api-keys:* --control-plane-audit-enabled:0 --jwt-issuer:1 --jwt-audience:1 "
        "--jwt-jwks-uri:1 --jwt-role-mapping:* --enable-mesh:0 --mesh-server-name:1 --mesh-host:1 "
        "--mesh-advertise-host:1 --mesh-port:1 --mesh-peer-urls:* --mesh-tls-ca-cert:1 --mesh-tls-cert:1 "
        "--mesh-tls-key:1 "
    )
)

# a value each flag's parser accepts
SAMPLE = {"--backend": "vllm", "--discovery-provider": "kubernetes", "--policy": "round_robin"}


def _argv(flag: str, arity: str) -> list[str]:
    v = SAMPLE.get(flag, "7")
    return [flag] if arity == "0" else [flag, v]


def test_the_list_is_smgs_and_the_table_covers_what_the_parser_lacks() -> None:
    assert len(SMG_1_13) == 215 and SMG_1_13["--worker-urls"] == "*"
    serve = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    ours = set(serve._option_string_actions)
    assert set(SMG_1_13) - ours == set(FLAGS)  # (no SMG flag falls through to argparse)
    assert all(FLAGS[f] == SMG_1_13[f] for f in FLAGS)


@pytest.mark.parametrize("flag", sorted(FLAGS))
def test_every_flag_is_renamed_ignored_or_refused(flag: str) -> None:
    argv = ["serve", *_argv(flag, FLAGS[flag])]
    try:
        t = translate(argv)
    except SmgFlagError as e:
        assert flag in str(e)
        return
    assert flag not in t.argv
    _parser().parse_args(t.argv)  # (SystemExit here: a renamed flag the parser does not take)
    if len(t.argv) == 1:  # nothing left: the flag was dropped, with a note saying so
        assert any(flag in n for n in t.notes) or flag in ("--max-concurrent-requests", "--mesh-peer-urls")


def test_an_smg_command_line_becomes_the_nodes_config() -> None:
    cfg = config_from_args(
        [
            "serve",
            "--host", "127.0.0.1", "--port", "30000",
            "--worker-urls", "grpc://127.0.0.1:50051",
            "--policy", "cache_aware", "--cache-threshold", "0.5",
            "--disable-retries", "--disable-circuit-breaker", "--log-json", "--log-level", "warn",
            "--trust-tenant-header", "--tenant-header-name", "X-Team",
            "--history-backend", "postgres", "--postgres-db-url=postgresql://u@db/h",
            "--postgres-pool-max", "4",
            "--prometheus-port", "29000", "--queue-size", "100", "--max-concurrent-requests", "-1",
            "--load-monitor-interval", "5", "--mesh-peer-urls",
        ]
    )  # fmt: skip
    assert (cfg.max_retries, cfg.cb_failure_threshold > 10**6, cfg.log_format, cfg.log_level) == (
        0,
        True,
        "json",
        "warning",
    )
    assert cfg.auth.trust_tenant_header and cfg.auth.tenant_header == "x-team"
    assert (cfg.history_backend, cfg.history_url, cfg.history_pool_size) == (
        "postgres",
        "postgresql://u@db/h",
        4,
    )
    assert cfg.load_poll_interval_secs == 5 and cfg.cache_threshold == 0.5
    notes = translate(["--prometheus-port", "29000", "--queue-size", "100"]).notes
    assert len(notes) == 2 and "/metrics" in notes[0]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--api-key", "k"], "--api-key"),
        (["--tenant-api-key", "t:k"], "--tenant-api-key"),
        (["--control-plane-api-keys", "a:b:admin:k"], "--control-plane-api-keys"),
        (["--backend", "openai"], "--backend openai"),
        (["--max-concurrent-requests", "64"], "--rate-limit-max-concurrent"),
        (["--oracle-username", "u"], "Oracle"),
        (["--ca-cert-paths", "a.pem", "b.pem"], "one"),
        (["--redis-url", "redis://h", "--postgres-db-url", "postgresql://h"], "--history-url"),
        (["--discovery-provider", "file"], "kubernetes"),
        (["--tls-cert-path"], "expects a value"),
        (["--history-backend", "none"], "--history-backend none"),
        (["--history-backend=none"], "--history-backend none"),
    ],
)
def test_what_is_refused_is_a_configuration_error_naming_it(argv: list[str], says: str) -> None:
    with pytest.raises(ConfigError, match=says.replace("-", "\\-")):
        config_from_args(["serve", "--worker-urls", "grpc://127.0.0.1:1", *argv])


def test_values_stay_with_their_flags() -> None:
    t = translate(
        ["serve", "--mesh-peer-urls", "a:1", "b:2", "--host", "h", "--enable-mesh", "--log-dir", "/x"]
    )
    assert t.argv == ["serve", "--mesh-seeds", "a:1", "b:2", "--host", "h", "--mesh-port", "39527"]
    assert [n.split(" is ")[0] for n in t.notes] == ["SMG's --log-dir"]
    assert translate(["--enable-mesh", "--mesh-port", "7000"]).argv == ["--mesh-port", "7000"]


# SMG's parser names (its --reasoning-parser / --tool-call-parser choices) that name a family the node has
SMG_PARSERS = {
    "--tool-call-parser": {
        "deepseek": "deepseek_v3", "deepseek31": "deepseek_v31", "deepseek32": "deepseek_v32",
        "glm45_moe": "glm45", "glm47_moe": "glm45", "kimik2": "kimi_k2", "qwen": "hermes",
        "qwen_coder": "qwen3_coder", "qwen_xml": "qwen3_coder", "llama": "llama3", "mistral": "mistral",
        "pythonic": "pythonic", "json": "json", "minimax_m2": "minimax_m2", "cohere": "cohere",
        "passthrough": None, "plain": None,
    },
    "--reasoning-parser": {
        "deepseek_r1": "deepseek_r1", "qwen3": "qwen3", "qwen3_thinking": "qwen3_thinking", "glm45": "glm45",
        "glm": "glm45", "glm4": "glm45", "kimi": "kimi", "kimi_thinking": "kimi_k2", "kimi_k25": "kimi_k2",
        "minimax_m2": "minimax", "step3": "step3", "passthrough": None, "plain": None,
    },
}  # fmt: skip


@pytest.mark.parametrize("flag", sorted(SMG_PARSERS))
def test_smgs_parser_names_name_the_nodes_families(flag: str) -> None:
    for name, family in SMG_PARSERS[flag].items():
        cfg = config_from_args(["serve", "--worker-urls", "grpc://127.0.0.1:1", flag, name])
        got = model_parsers(ModelConfig("m", ""), cfg.reasoning_parser, cfg.tool_call_parser)
        assert got[0 if flag == "--reasoning-parser" else 1] == family, name


def test_smgs_jwt_flags_protect_the_control_plane_as_in_smg() -> None:
    cfg = config_from_args(
        ["serve", "--worker-urls", "grpc://127.0.0.1:1", "--jwt-issuer", "https://idp.example"]
    )
    assert (cfg.auth.data_plane, cfg.auth.control_plane) == ("off", "jwt")
    cfg = config_from_args(["serve", "--jwt-jwks-uri", "https://idp.example/keys", "--auth-mode", "api_key"])
    assert cfg.auth.control_plane == "api_key"  # (a node's own auth flags: left as they say)


def test_list_flags_given_twice_keep_both_as_smgs_repeated_flags_do() -> None:
    cfg = config_from_args(
        [
            "serve",
            "--worker-urls", "grpc://127.0.0.1:1", "--worker-urls", "grpc://127.0.0.1:2",
            "--model-alias", "a=qwen3", "--model-alias", "b=qwen3",
            "--service-discovery", "--selector", "app=x", "--selector", "tier=y",
        ]
    )  # fmt: skip
    assert cfg.worker_urls == ("grpc://127.0.0.1:1", "grpc://127.0.0.1:2")
    assert cfg.model_aliases == ("a=qwen3", "b=qwen3")
    assert cfg.selector == ("app=x", "tier=y")


# ``--help`` of sglang-router 0.3.2 (python -m sglang_router.launch_router) and vllm-router 0.1.17
ROUTERS = {
    "sglang-router": _words(
        "--api-key --assignment-mode --backend --balance-abs-threshold --balance-rel-threshold "
        "--bucket-adjust-interval-secs --ca-cert-paths --cache-threshold --cb-failure-threshold "
        "--cb-success-threshold --cb-timeout-duration-secs --cb-window-duration-secs --chat-template "
        "--client-cert-path --client-key-path --control-plane-api-keys --control-plane-audit-enabled "
        "--cors-allowed-origins --decode --decode-policy --decode-selector --disable-circuit-breaker "
        "--disable-health-check --disable-retries --dp-aware --enable-igw --enable-trace "
        "--eviction-interval-secs --health-check-endpoint --health-check-interval-secs "
        "--health-check-timeout-secs --health-failure-threshold --health-success-threshold "
        "--history-backend --host --jwt-audience --jwt-issuer --jwt-jwks-uri --jwt-role-mapping --log-dir "
        "--log-level --max-concurrent-requests --max-idle-secs --max-payload-size --max-tree-size "
        "--mcp-config-path --mini-lb --model-path --oracle-connect-descriptor --oracle-password "
        "--oracle-pool-max --oracle-pool-min --oracle-pool-timeout-secs --oracle-tns-alias "
        "--oracle-username --oracle-wallet-path --otlp-traces-endpoint --pd-disaggregation --policy "
        "--port --postgres-db-url --postgres-pool-max --prefill --prefill-policy --prefill-selector "
        "--prometheus-duration-buckets --prometheus-host --prometheus-port --queue-size "
        "--queue-timeout-secs --rate-limit-tokens-per-second --reasoning-parser --redis-pool-max "
        "--redis-retention-days --redis-url --request-id-headers --request-timeout-secs "
        "--retry-backoff-multiplier --retry-initial-backoff-ms --retry-jitter-factor "
        "--retry-max-backoff-ms --retry-max-retries --selector --service-discovery "
        "--service-discovery-namespace --service-discovery-port --shutdown-grace-period-secs "
        "--tls-cert-path --tls-key-path --tokenizer-cache-enable-l0 --tokenizer-cache-enable-l1 "
        "--tokenizer-cache-l0-max-entries --tokenizer-cache-l1-max-memory --tokenizer-path "
        "--tool-call-parser --worker-startup-check-interval --worker-startup-timeout-secs --worker-urls "
    ),
    "vllm-router": _words(
        "--api-key --balance-abs-threshold --balance-rel-threshold --cache-threshold "
        "--cb-failure-threshold --cb-success-threshold --cb-timeout-duration-secs "
        "--cb-window-duration-secs --cors-allowed-origins --decode --decode-policy --decode-selector "
        "--disable-circuit-breaker --disable-retries --enable-igw --enable-program-scheduling "
        "--eviction-interval-secs --health-check-endpoint --health-check-interval-secs "
        "--health-check-timeout-secs --health-failure-threshold --health-success-threshold --host "
        "--intra-node-data-parallel-size --kv-aware-session-affinity-ttl-secs --kv-connector "
        "--kv-event-block-size --kv-event-model --kv-event-replay-source --kv-event-source "
        "--kv-penalty-disk --kv-penalty-external --kv-penalty-host --log-dir --log-level "
        "--max-concurrent-requests --max-payload-size --max-tree-size --mini-lb --pd-kv-events --policy "
        "--port --prefill --prefill-policy --prefill-selector --program-scheduling-config-json "
        "--prometheus-host --prometheus-port --queue-size --queue-timeout-secs "
        "--rate-limit-tokens-per-second --request-id-headers --request-timeout-secs "
        "--retry-backoff-multiplier --retry-initial-backoff-ms --retry-jitter-factor "
        "--retry-max-backoff-ms --retry-max-retries --router-temperature --selector --service-discovery "
        "--service-discovery-namespace --service-discovery-port --vllm-discovery-address "
        "--vllm-pd-disaggregation --wasm-middleware --wasm-middleware-route --wasm-middleware-sha256 "
        "--worker-startup-check-interval --worker-startup-timeout-secs --worker-urls "
    ),
}


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_the_other_routers_flags_are_taken_too(router: str) -> None:
    serve = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    ours = set(serve._option_string_actions)
    missing = [f for f in ROUTERS[router] if f not in ours and f not in FLAGS and f not in ROUTER_FLAGS]
    assert not missing
    for flag, arity in ROUTER_FLAGS.items():
        try:
            t = translate(["serve", *_argv(flag, arity)])
        except SmgFlagError as e:
            assert flag in str(e)
            continue
        assert flag not in t.argv
        _parser().parse_args(t.argv)


def test_vllm_routers_policy_names_and_pd_flags() -> None:
    t = translate(["--policy", "consistent_hash", "--prefill-policy=kv_aware", "--decode-policy", "random"])
    assert t.argv == [
        "--policy",
        "consistent_hashing",
        "--prefill-policy",
        "cache_aware",
        "--decode-policy",
        "random",
    ]
    assert len(t.notes) == 2
    assert translate(["--vllm-pd-disaggregation", "--kv-connector", "nixl"]).argv == ["--pd-disaggregation"]
    for bad in (
        ["--kv-connector", "mooncake"],
        ["--intra-node-data-parallel-size", "2"],
        ["--wasm-middleware", "m.wasm"],
    ):
        with pytest.raises(SmgFlagError, match=bad[0]):
            translate(bad)
    assert translate(["--intra-node-data-parallel-size", "1"]).argv == []


def test_smgs_trusted_tenant_header_is_its_own_name_unless_the_line_names_one() -> None:
    cfg = config_from_args(["serve", "--trust-tenant-header"])
    assert cfg.auth.trust_tenant_header and cfg.auth.tenant_header == "x-smg-tenant-id"
    cfg = config_from_args(["serve", "--auth-trust-tenant-header"])  # (the node's own flag: its own header)
    assert cfg.auth.trust_tenant_header and cfg.auth.tenant_header is None


_VOCAB = [*FLAGS, *ROUTER_FLAGS, "--policy", "--host", "--worker-urls", "none", "7", "a=b", "--x=1", "", "-"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_VOCAB) | st.text(max_size=12), max_size=12))
def test_any_argv_translates_or_is_refused_by_name(argv: list[str]) -> None:
    try:
        t = translate(argv)
    except SmgFlagError as e:
        assert any(a.partition("=")[0] in str(e) for a in argv if a.startswith("--")), e  # (names it)
        return
    assert all(isinstance(a, str) for a in t.argv) and len(t.argv) <= 3 * len(argv) + 4


@pytest.mark.parametrize(("attempts", "retries"), [("0", 0), ("1", 0), ("2", 1), ("3", 2), ("5", 4)])
def test_retry_max_retries_counts_attempts_as_smg_does(attempts: str, retries: int) -> None:
    """SMG's retry loop calls the worker ``--retry-max-retries`` times in all (at least once): the same
    command line makes as many attempts here (the node's ``max_retries`` counts those after the first)."""
    base = ["serve", "--worker-urls", "grpc://127.0.0.1:50051"]
    assert config_from_args([*base, "--retry-max-retries", attempts]).max_retries == retries
    assert config_from_args(base).max_retries == 2  # (3 attempts unless told)


def test_retry_max_retries_refuses_a_negative_count() -> None:
    with pytest.raises(SystemExit):
        config_from_args(["serve", "--worker-urls", "grpc://127.0.0.1:50051", "--retry-max-retries", "-1"])
