"""shepherd.node.observe: when tracing is on (flags and the standard OTEL_* variables), what the log lines
carry (request and trace ids, JSON) and what they never carry (secrets), and the no-op path of tracing
while it is off."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from shepherd.node.config import ConfigError, build_config
from shepherd.node.observe import logs, tracing


def test_tracing_is_off_unless_asked_for() -> None:
    assert tracing.settings_from(False, None, None, {}) is None
    assert tracing.settings_from(False, None, None, {"OTEL_SERVICE_NAME": "x"}) is None
    on = tracing.settings_from(True, None, None, {})
    assert on == tracing.TraceSettings(None, "grpc")
    assert tracing.settings_from(False, "collector:4317", None, {}) == tracing.TraceSettings(
        "collector:4317", "grpc"
    )


def test_the_standard_environment_turns_tracing_on_and_picks_the_protocol() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    assert tracing.settings_from(False, None, None, env) == tracing.TraceSettings(None, "http/protobuf")
    assert tracing.settings_from(False, None, None, {"OTEL_TRACES_EXPORTER": "otlp"}) is not None
    traces_env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317/"}
    assert tracing.settings_from(False, None, None, traces_env) is not None
    # the flag's protocol wins over the environment's
    got = tracing.settings_from(True, "c:4317", "grpc", {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert got == tracing.TraceSettings("c:4317", "grpc")


def test_the_environment_can_keep_tracing_off() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "none"}
    assert tracing.settings_from(False, None, None, env) is None
    assert tracing.settings_from(True, "c:4317", None, {"OTEL_SDK_DISABLED": "true"}) is None
    with pytest.raises(ValueError, match="protocol"):
        tracing.settings_from(True, None, None, {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def test_while_tracing_is_off_the_request_path_gets_the_shared_noop() -> None:
    assert not tracing.ENABLED
    st = tracing.stage("render_tokenize", {"a": 1}, cache_stats=lambda: (0, 0, 1, 0, 0, 0))
    assert st is tracing.NOOP
    with st as s:
        s.set("x", 1)
        s.routed(object(), None)
    assert tracing.client_stage("POST /v1/completions", "http://w:1") is tracing.NOOP
    assert tracing.rpc_server("peer", "get_response", {"traceparent": "x"}) is tracing.NOOP
    assert tracing.inject({"a": "b"}) == {"a": "b"}
    assert tracing.grpc_header_block(lambda k, v: k + v) == b""
    store = object()
    assert tracing.traced_store(store) is store
    assert tracing.current_trace_id() is None


@pytest.fixture
def root_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    saved = (logs.ACTIVE, logs.ACCESS, list(logs._literals))
    try:
        yield
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)
        logs.ACTIVE, logs.ACCESS = saved[0], saved[1]
        logs._literals[:] = saved[2]


@pytest.mark.parametrize(
    ("line", "secret"),
    [
        ("headers: {'Authorization': 'Bearer sk-smg-abcdef123456'}", "sk-smg-abcdef123456"),
        ("authorization: Bearer eyJhbGciOiJIUzI1NiJ9.e30.sig", "eyJhbGciOiJIUzI1NiJ9.e30.sig"),
        ("x-api-key=hunter2hunter2 rest", "hunter2hunter2"),
        ('{"api_key": "k-123456789"}', "k-123456789"),
        ("connecting to postgresql://smg:s3cr3t-pw@db:5432/smg", "s3cr3t-pw"),
        ("redis://:r3dis-pass@cache:6379/0 down", "r3dis-pass"),
        ("GET /v1/models?api_key=q-secret-9 200", "q-secret-9"),
        ("client sent sk-proj-0123456789abcdef", "sk-proj-0123456789abcdef"),
    ],
)
def test_redact_removes_credentials(line: str, secret: str) -> None:
    out = logs.redact(line)
    assert secret not in out and "***" in out


def test_configured_secrets_are_redacted_wherever_they_appear(
    tmp_path: Path, root_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    mesh_key = "bWVzaC1rZXktb25lLW9mLXRoaXJ0eS10d28tYnl0ZXM="
    file_key = "ZmlsZS1rZXktb2YtdGhlLW1lc2gta2V5cmluZy1maWxl"
    ring = tmp_path / "ring"
    ring.write_text(f"{file_key}\n")
    cfg = build_config({}, {"mesh_keys": [mesh_key], "mesh_keyring_file": str(ring)})
    secrets = logs.config_secrets(cfg, {})
    assert mesh_key in secrets and file_key in secrets
    logs.configure("info", "json", False, secrets)
    log = logging.getLogger("shepherd.test")
    log.warning("keyring %s and %s loaded", mesh_key, file_key)
    try:
        raise RuntimeError(f"boom with {mesh_key}")
    except RuntimeError:
        log.exception("failed")
    err = capsys.readouterr().err
    assert mesh_key not in err and file_key not in err
    lines = [json.loads(ln) for ln in err.splitlines()]
    assert lines[0]["msg"] == "keyring *** and *** loaded" and lines[0]["level"] == "warning"
    assert "boom with ***" in lines[1]["exc"]


def test_json_lines_carry_the_request_and_trace_ids(
    root_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    logs.configure("info", "json", True)
    log = logging.getLogger("shepherd.test")
    log.info("outside a request")
    token = logs.REQUEST_ID.set(None)
    ttoken = logs._HEADER_TRACE.set("0af7651916cd43dd8448eb211c80319c")
    try:
        logs.bind_request("chatcmpl-42")
        log.info("inside")
    finally:
        logs.REQUEST_ID.reset(token)
        logs._HEADER_TRACE.reset(ttoken)
    first, second = (json.loads(ln) for ln in capsys.readouterr().err.splitlines())
    assert "request_id" not in first and "trace_id" not in first
    assert second["request_id"] == "chatcmpl-42"
    assert second["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert second["logger"] == "shepherd.test" and second["ts"].endswith("Z")


def test_text_lines_stay_text(root_logging: None, capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure("info", "text", False)
    assert not logs.ACTIVE  # the default: no middleware, no request binding
    logging.getLogger("shepherd.test").info("password=abc12345 plain")
    err = capsys.readouterr().err
    assert "INFO shepherd.test: password= *** plain" in err


def test_the_flags_reach_the_configuration() -> None:
    from shepherd.node.cli import config_from_args  # not at the top: the CLI module imports the node lazily

    cfg = config_from_args(
        [
            "serve", "--enable-trace", "--otlp-traces-endpoint", "c:4317", "--otlp-traces-protocol",
            "http/protobuf", "--otlp-metrics-endpoint", "c:4317", "--log-format", "json", "--access-log",
        ]
    )  # fmt: skip
    assert cfg.enable_trace and cfg.otlp_traces_endpoint == "c:4317"
    assert cfg.otlp_traces_protocol == "http/protobuf" and cfg.otlp_metrics_endpoint == "c:4317"
    assert cfg.log_format == "json" and cfg.access_log
    plain = config_from_args(["serve"])
    assert not plain.enable_trace and plain.log_format == "text" and not plain.access_log


def test_bad_settings_are_configuration_errors() -> None:
    with pytest.raises(ConfigError, match="log_format"):
        build_config({"log_format": "xml"}, {})
    with pytest.raises(ConfigError, match="otlp_traces_protocol"):
        build_config({"otlp_traces_protocol": "udp"}, {})


@pytest.mark.parametrize(
    ("query", "secret"),
    [
        ("key=AIzaSyD-secret-value&limit=5", "AIzaSyD-secret-value"),
        ("sig=Zm9vYmFyYmF6cXV4&se=2030", "Zm9vYmFyYmF6cXV4"),
        ("X-Amz-Signature=abcdef0123456789&X-Amz-Expires=60", "abcdef0123456789"),
        ("id_token=eyJhbGciOi.e30.x", "eyJhbGciOi.e30.x"),
        ("code=4/0AfJohXk&state=s", "4/0AfJohXk"),
        ("subscription-key=0123456789abcdef", "0123456789abcdef"),
        ("access_key=AKIAIOSFODNN7&limit=5", "AKIAIOSFODNN7"),
        ("apikey=zz-secret-1", "zz-secret-1"),
        ("jwt=eyJhbGciOi.e30.y", "eyJhbGciOi.e30.y"),
        ("a=1;key=sekrit-v", "sekrit-v"),
    ],
)
async def test_the_access_log_hides_credential_query_values(
    query: str, secret: str, root_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    logs.configure("info", "json", True)

    async def ok(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    await logs.request_context(make_mocked_request("GET", f"/v1/models?{query}"), ok)
    line = json.loads(capsys.readouterr().err.splitlines()[-1])
    assert secret not in line["path"] and "***" in line["path"], line
    assert line["path"].startswith("/v1/models?")
    if "limit=5" in query:
        assert "limit=5" in line["path"]  # what is no credential stays readable


def test_a_text_log_line_is_one_line_whatever_a_client_sent() -> None:
    """A decoded %0a in a path (or an ANSI escape) reaching the access or audit log: escaped, so no forged
    line and no terminal rewrite; a traceback still follows on lines of its own."""
    fmt = logs.TextFormatter()
    rec = logging.LogRecord(
        "shepherd.access",
        logging.INFO,
        __file__,
        1,
        "%s %s",
        ("GET", "/v1/x\n2026 forged\x1b[31m\u2028"),
        None,
    )
    line = fmt.format(rec)
    assert "\n" not in line and "\x1b" not in line and "\u2028" not in line
    assert "/v1/x\\n2026 forged\\x1b[31m\\u2028" in line
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        rec = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    assert fmt.format(rec).count("\n") >= 2  # the traceback as it is
