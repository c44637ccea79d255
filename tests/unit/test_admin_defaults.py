"""The control plane's configuration defaults (``shepherd.node.config.check_control_plane`` and the auth
modes), and the browser guard's rules (``shepherd.auth.control.ControlGuard``) one by one."""

from __future__ import annotations

from typing import Any

import pytest

from shepherd.auth.control import ControlGuard, is_loopback
from shepherd.node.config import ConfigError, build_config, insecure_admin_in_effect

SHA = "0" * 64


def cfg(**kw: Any) -> Any:
    return build_config({}, kw)


def test_the_control_plane_follows_the_data_plane_unless_set() -> None:
    c = cfg(auth={"data_plane": "api_key", "admin_key_sha256": [SHA]})
    assert (c.auth.data_plane, c.auth.control_plane) == ("api_key", "api_key")
    c = cfg(auth={"mode": "api_key", "data_plane": "off"})  # mode names both; data plane opened explicitly
    assert (c.auth.data_plane, c.auth.control_plane) == ("off", "api_key")
    c = cfg(auth={"data_plane": "api_key", "control_plane": "off"})  # explicit: allowed on loopback
    assert c.auth.control_plane == "off" and not insecure_admin_in_effect(c)
    assert cfg().auth.metrics  # /metrics is a control route by default


@pytest.mark.parametrize(
    "kw",
    [
        {"host": "0.0.0.0"},
        {"host": "::"},
        {"host": "10.1.2.3"},
        {"host": "node-1.internal"},
        {"host": "127.0.0.1", "admin_host": "0.0.0.0", "admin_port": 30001},
        {"host": "0.0.0.0", "auth": {"data_plane": "api_key", "control_plane": "off"}},
    ],
)
def test_an_open_control_plane_on_a_reachable_address_refuses_to_start(kw: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="--insecure-admin"):
        cfg(**kw)
    c = cfg(**kw, insecure_admin=True)
    assert insecure_admin_in_effect(c)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"host": "localhost"},
        {"host": "::1"},
        {"host": "0.0.0.0", "admin_port": 30001},  # admin listener on loopback by default
        {"host": "0.0.0.0", "admin_host": "127.0.0.2", "admin_port": 30001},
        {"host": "0.0.0.0", "auth": {"mode": "api_key", "admin_key_sha256": [SHA]}},
        {"host": "0.0.0.0", "auth": {"data_plane": "api_key", "admin_key_sha256": [SHA]}},
    ],
)
def test_safe_postures_start(kw: dict[str, Any]) -> None:
    assert not insecure_admin_in_effect(cfg(**kw))


@pytest.mark.parametrize(
    "kw",
    [
        {"admin_host": "127.0.0.1"},  # no port
        {"admin_port": 30000},  # the client port
        {"admin_port": 70000},
        {"admin_allowed_origins": ["evil.example"]},  # not an origin
        {"admin_allowed_origins": ["https://ui.example/path"]},
        {"admin_allowed_origins": ["*"]},  # (the control plane: never any origin)
        {"cors_allowed_origins": ["app.example"]},
        {"cors_allowed_origins": ["ftp://app.example"]},
    ],
)
def test_bad_admin_settings(kw: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        cfg(**kw)


def test_cors_origins() -> None:
    assert cfg(cors_allowed_origins=["*"]).cors_allowed_origins == ("*",)
    assert cfg(cors_allowed_origins="https://app.example:8443").cors_allowed_origins == (
        "https://app.example:8443",
    )
    assert cfg().cors_allowed_origins == ()  # off by default


def test_loopback() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.9.9.9", "::1", "[::1]", "localhost", "a.localhost"))
    assert not any(is_loopback(h) for h in ("", "0.0.0.0", "::", "10.0.0.1", "example.com", "localhost.evil"))


def test_guard_rules() -> None:
    g = ControlGuard.build("127.0.0.1", ["https://UI.example:8443/"])
    ok: list[dict[str, str]] = [
        {},
        {"Host": "127.0.0.1:30000"},
        {"Host": "localhost"},
        {"Host": "[::1]:30000"},
        {"Host": "ui.example"},
        {"Origin": "https://ui.example:8443", "Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-origin"},
        {"Sec-Fetch-Site": "none"},
    ]
    for h in ok:
        assert g.refusal(h) is None, h
    refused = {
        "cross_origin_refused": [
            {"Origin": "http://evil.example"},
            {"Origin": "null"},
            {"Origin": "https://ui.example"},
        ],
        "cross_site_refused": [{"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "SAME-SITE"}],
        "host_not_allowed": [
            {"Host": "evil.example:30000"},
            {"Host": "127.0.0.1.nip.io"},
            {"Host": "[fe80::1]"},
        ],
    }
    for code, cases in refused.items():
        for h in cases:
            r = g.refusal(h)
            assert r is not None and r.status == 403 and r.code == code, h
    wide = ControlGuard.build("0.0.0.0", [])  # not loopback: Host is not checked (auth is required there)
    assert wide.refusal({"Host": "node-1.internal"}) is None
    assert wide.refusal({"Origin": "http://evil.example"}) is not None
