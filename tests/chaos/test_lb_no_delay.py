"""The fleet's load balancers forward each SSE chunk at once (issue 21): HAProxy's default packet merging
held streamed first tokens back (TTFT +77 ms through a local HAProxy in front of one node, +0.1 ms with
``option http-no-delay``; ``docker/compose_check.py`` measures it on the compose fleet)."""

from __future__ import annotations

from pathlib import Path

from chaos import lb

ROOT = Path(__file__).resolve().parents[2]


def _defaults(text: str) -> list[str]:
    """The lines of the ``defaults`` section of an HAProxy config, comments stripped."""
    out: list[str] = []
    inside = False
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if raw and not raw[0].isspace():
            inside = line == "defaults"
            continue
        if inside and line:
            out.append(line)
    return out


def test_chaos_lb_config_sets_http_no_delay() -> None:
    cfg = lb.LbConfig(
        bind="127.0.0.1:8080", backends=(lb.Backend("n", "127.0.0.1:1"),), stats_socket="/tmp/s"
    )
    assert "option http-no-delay" in _defaults(lb.render_haproxy(cfg))


def test_compose_lb_config_sets_http_no_delay() -> None:
    text = (ROOT / "docker" / "haproxy.cfg").read_text()
    assert "option http-no-delay" in _defaults(text)
    assert "option http-no-delay" not in _defaults(text.replace("option http-no-delay", ""))  # the check sees
