"""Auth and TLS settings: YAML mapping and CLI flags into the frozen config, and the checks on them."""

from __future__ import annotations

from pathlib import Path

import pytest

from shepherd.auth.certs import generate_ca, generate_node_cert
from shepherd.auth.config import AuthConfig, AuthConfigError, auth_config, merge_auth
from shepherd.auth.keys import hash_key
from shepherd.node.cli import config_from_args
from shepherd.node.config import ConfigError, NodeConfig, build_config


def test_default_is_off() -> None:
    cfg = NodeConfig()
    assert cfg.auth == AuthConfig() and not cfg.auth.enabled
    assert build_config({}, {}).auth == AuthConfig()


def test_mode_sets_both_planes_and_a_plane_overrides_it() -> None:
    c = auth_config(
        {
            "mode": "api_key",
            "control_plane": "both",
            "admin_key_sha256": hash_key("x"),
            "jwt": {"issuer": "https://i"},
        }
    )
    assert (c.data_plane, c.control_plane) == ("api_key", "both")
    assert c.keys[0].role == "admin" and c.keys[0].sha256 == hash_key("x")


@pytest.mark.parametrize(
    "raw",
    [
        {"mode": "on"},
        {"data_plane": "basic"},
        {"colour": "blue"},
        {"keys": [{"name": "k"}]},  # neither sha256 nor env
        {"keys": [{"name": "k", "sha256": "zz"}]},
        {"keys": [{"name": "k", "env": "E", "role": "root"}]},
        {"mode": "jwt"},  # no key source
        {"mode": "jwt", "jwt": {"issuer": "https://i", "algorithms": ["none"]}},
        {"mode": "jwt", "jwt": {"issuer": "https://i", "algorithms": ["HS256"]}},  # no secret
        {"mode": "jwt", "jwt": {"issuer": "https://i", "algorithms": []}},
        {"mode": "jwt", "jwt": {"issuer": "https://i", "wat": 1}},
        {"mode": "jwt", "jwt": {"issuer": "https://i", "leeway_secs": -1}},
    ],
)
def test_bad_settings_are_refused_with_a_message(raw: dict[str, object]) -> None:
    with pytest.raises(AuthConfigError):
        auth_config(raw)


@pytest.mark.parametrize(
    "jwt",
    [
        {"issuer": "http://idp.example.com"},  # discovery in the clear
        {"issuer": "https://idp.example.com", "jwks_url": "http://idp.example.com/keys"},
        {"jwks_url": "http://10.0.0.7/keys"},
        {"jwks_url": "ftp://idp.example.com/keys"},
        {"jwks_url": "https:///keys"},
    ],
)
def test_keys_are_never_fetched_in_the_clear_off_loopback(jwt: dict[str, object]) -> None:
    # (SMG: crates/auth/src/jwks.rs validate_url, plain http to localhost only): an on-path attacker
    # would hand the node its own keys and mint admin tokens
    with pytest.raises(AuthConfigError, match="HTTPS"):
        auth_config({"mode": "jwt", "jwt": jwt})


@pytest.mark.parametrize(
    "jwt",
    [
        {"issuer": "https://idp.example.com"},
        {"issuer": "http://127.0.0.1:8080/realms/x"},
        {"issuer": "http://localhost:8080"},
        {"jwks_url": "http://[::1]:9000/keys"},
        {"issuer": "http://idp.example.com", "public_key_files": ["k.pem"]},  # iss checked, nothing fetched
    ],
)
def test_https_and_loopback_key_urls_are_accepted(jwt: dict[str, object]) -> None:
    assert auth_config({"mode": "jwt", "jwt": jwt}).uses_jwt


def test_merge_is_one_level_deep_for_jwt() -> None:
    merged = merge_auth(
        {"mode": "jwt", "jwt": {"issuer": "https://a", "audience": ["x"]}}, {"jwt": {"audience": ["y"]}}
    )
    assert merged == {"mode": "jwt", "jwt": {"issuer": "https://a", "audience": ["y"]}}


def test_cli_flags_and_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("T_ADMIN", "sk-smg-test-admin")
    y = tmp_path / "n.yaml"
    y.write_text(
        "auth:\n  data_plane: api_key\n  jwt:\n    issuer: https://idp.example\n    audience: [smg]\n"
        "  keys:\n    - {name: b, role: user, sha256: " + hash_key("u") + "}\n"
    )
    cfg = config_from_args(
        [
            "serve",
            "--config",
            str(y),
            "--auth-control-plane",
            "both",
            "--auth-admin-key-env",
            "T_ADMIN",
            "--auth-trust-tenant-header",
            "--jwt-role-claim",
            "roles",
            "--jwt-algorithms",
            "RS256",
            "EdDSA",
        ]
    )
    a = cfg.auth
    assert (a.data_plane, a.control_plane, a.trust_tenant_header) == ("api_key", "both", True)
    assert a.jwt.issuer == "https://idp.example" and a.jwt.audience == ("smg",)
    assert a.jwt.role_claim == "roles" and a.jwt.algorithms == ("RS256", "EdDSA")
    assert {k.name for k in a.keys} == {"b", "bootstrap-admin-env-0"}
    assert config_from_args(["serve"]).auth == AuthConfig()


def test_missing_bootstrap_env_fails_at_config_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("T_NOPE", raising=False)
    with pytest.raises(ConfigError, match="T_NOPE"):
        config_from_args(["serve", "--auth-mode", "api_key", "--auth-admin-key-env", "T_NOPE"])


def test_jwt_key_file_is_loaded_at_config_time(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing\.pem"):
        config_from_args(
            ["serve", "--auth-mode", "jwt", "--jwt-public-key-file", str(tmp_path / "missing.pem")]
        )


def test_tls_settings(tmp_path: Path) -> None:
    ca = generate_ca()
    node = generate_node_cert(ca, "localhost")
    (tmp_path / "c.pem").write_bytes(node.cert_pem)
    (tmp_path / "k.pem").write_bytes(node.key_pem)
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem)
    c, k, caf = str(tmp_path / "c.pem"), str(tmp_path / "k.pem"), str(tmp_path / "ca.pem")
    cfg = config_from_args(
        [
            *("serve", "--tls-cert-file", c, "--tls-key-file", k, "--tls-client-ca-file", caf),
            *("--engine-tls-ca-file", caf, "--engine-tls-cert-file", c, "--engine-tls-key-file", k),
            *("--tls-reload-interval-secs", "2", "--worker-urls", "grpcs://127.0.0.1:1"),
        ]
    )
    assert (cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file) == (c, k, caf)
    assert cfg.engine_tls_cert_file == c and cfg.tls_reload_interval_secs == 2.0
    with pytest.raises(ConfigError, match="go together"):
        config_from_args(["serve", "--tls-cert-file", c])
    with pytest.raises(ConfigError, match="go together"):
        config_from_args(["serve", "--engine-tls-cert-file", c])
    with pytest.raises(ConfigError, match="needs"):
        config_from_args(["serve", "--tls-client-ca-file", caf])
    with pytest.raises(ConfigError, match="cannot load"):
        config_from_args(["serve", "--tls-cert-file", c, "--tls-key-file", caf])
