"""DNS rebinding against a control plane off loopback: with ``--insecure-admin`` (no authentication) a
page on ``evil.example`` whose name re-binds to the node's address could read ``/workers``,
``/admin/keys`` and ``/metrics`` through the visitor's browser. The control guard checks ``Host`` there:
``admin_allowed_hosts`` when given, else the listener's own address and this machine's names; IP
addresses (which rebinding cannot put in ``Host``) and loopback names pass; ``*`` turns the check off.
An authenticated control plane off loopback is checked only when ``admin_allowed_hosts`` is given; the
loopback listener's rules are as before.

A real node: ``tests/e2e/test_security_defaults.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from shepherd.auth.control import ControlGuard, machine_names
from shepherd.node.config import ConfigError, build_config

pytestmark = pytest.mark.timeout(60)

HOSTNAME = sorted(machine_names())[0]


def refused(g: ControlGuard, host: str) -> str | None:
    r = g.refusal({"Host": host})
    return None if r is None else r.code


def test_an_unauthenticated_control_plane_off_loopback_checks_host() -> None:
    g = ControlGuard.build("0.0.0.0", [], unauthenticated=True)
    assert refused(g, "evil.example:30000") == "host_not_allowed"
    assert refused(g, "evil.example") == "host_not_allowed"
    assert refused(g, "127.0.0.1.nip.io") == "host_not_allowed"
    r = g.refusal({"Host": "evil.example"})
    assert r is not None and r.status == 403 and "admin_allowed_hosts" in r.message
    for ok in (f"{HOSTNAME}:30000", HOSTNAME.upper(), "10.1.2.3:30000", "[fd00::5]:30000", "localhost:1"):
        assert refused(g, ok) is None, ok
    assert g.refusal({}) is None  # no Host: HTTP/1.0, never a browser


def test_the_listener_address_and_allowed_origins_pass() -> None:
    g = ControlGuard.build("node-a.internal", ["https://ui.example"], unauthenticated=True)
    assert refused(g, "node-a.internal:9000") is None
    assert refused(g, "ui.example") is None
    assert refused(g, "node-b.internal") == "host_not_allowed"


def test_admin_allowed_hosts_replace_the_default() -> None:
    g = ControlGuard.build("0.0.0.0", [], ["gw.example", ".svc.cluster.local"], unauthenticated=True)
    assert refused(g, "gw.example:30000") is None
    assert refused(g, "shepherd.ns.svc.cluster.local:30000") is None
    assert refused(g, "svc.cluster.local.evil.example") == "host_not_allowed"
    assert refused(g, HOSTNAME) == "host_not_allowed" or HOSTNAME == "gw.example"
    assert refused(g, "10.0.0.1") is None
    # given, they are checked with auth on too
    authed = ControlGuard.build("0.0.0.0", [], ["gw.example"])
    assert refused(authed, "evil.example") == "host_not_allowed" and refused(authed, "gw.example") is None


def test_star_and_authenticated_defaults_do_not_check() -> None:
    assert refused(ControlGuard.build("0.0.0.0", [], ["*"], unauthenticated=True), "evil.example") is None
    assert refused(ControlGuard.build("0.0.0.0", []), "evil.example") is None  # auth protects it


def test_loopback_is_as_before_plus_the_allowed_hosts() -> None:
    g = ControlGuard.build("127.0.0.1", [])
    assert refused(g, "evil.example") == "host_not_allowed"
    assert refused(g, "10.0.0.1") == "host_not_allowed"  # on loopback only local addresses
    assert refused(g, "localhost:1") is None and refused(g, "127.0.0.1:1") is None
    g = ControlGuard.build("127.0.0.1", [], ["dev.test"])
    assert refused(g, "dev.test:30000") is None and refused(g, "evil.example") == "host_not_allowed"


@pytest.mark.parametrize(
    "hosts", [["gw.example"], [".svc.cluster.local"], ["10.0.0.1"], ["[::1]"], ["*"], "gw.example"]
)
def test_the_setting(hosts: Any) -> None:
    cfg = build_config({}, {"admin_allowed_hosts": hosts})
    assert cfg.admin_allowed_hosts == ((hosts,) if isinstance(hosts, str) else tuple(hosts))


@pytest.mark.parametrize("bad", ["evil example", "http://gw.example", "a/b", "", "*.example"])
def test_bad_entries_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="admin_allowed_hosts"):
        build_config({}, {"admin_allowed_hosts": [bad]})
