"""Node admission: config to rules, the 429 answer and its headers, and the handlers' guard."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from shepherd.auth.principal import PRINCIPAL_KEY, Principal
from shepherd.mesh.ratelimit import Limits
from shepherd.node.api.admission import TICKET_KEY, UNLIMITED, Admission, RateLimited, tokens_used
from shepherd.node.cli import config_from_args
from shepherd.node.config import ConfigError, NodeConfig, RateLimitRule, build_config
from shepherd.node.openai.requests import parse_chat


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def adm(*rules: RateLimitRule, clock: Clock | None = None, estimate: int = 100) -> Admission:
    return Admission(rules, node="n0", gen=1, token_estimate=estimate, clock=clock or Clock())


def test_config_rules_and_defaults() -> None:
    cfg = build_config(
        {
            "rate_limits": [
                {"tenant": "*", "rpm": 100},
                {"tenant": "*", "model": "qwen3", "tpm": 5000},
                {"tenant": "gold", "rpm": 1000, "max_concurrent": 8},
            ]
        },
        {"rate_limit_tpm": 20_000},
    )
    assert cfg.rate_limits[2] == RateLimitRule("gold", None, 1000, None, 8)
    a = Admission.from_config(cfg)
    assert a is not None
    # the flags' default replaces the YAML "*" all-models rule
    assert a.rules_for("x", "qwen3") == [(("x", ""), Limits(tpm=20_000)), (("x", "qwen3"), Limits(tpm=5000))]
    assert a.rules_for("gold", "other") == [(("gold", ""), Limits(rpm=1000, max_concurrent=8))]
    assert Admission.from_config(NodeConfig()) is None  # nothing configured: no admission at all


@pytest.mark.parametrize(
    "bad",
    [
        {"rate_limits": [{"rpm": 5}]},
        {"rate_limits": [{"tenant": "a", "rpm": 0}]},
        {"rate_limits": [{"tenant": "a", "rpm": "10"}]},
        {"rate_limits": [{"tenant": "a", "burst": 10}]},
        {"rate_limits": {"tenant": "a"}},
        {"rate_limit_rpm": -1},
        {"rate_limit_propagation_max_secs": 0.5},  # below rate_limit_propagation_secs (1)
        {"rate_limit_propagation_max_secs": 61},  # above the window (60)
        {"rate_limit_propagation_max_secs": -1},
        {"rate_limit_propagation_max_secs": "15"},
    ],
)
def test_bad_rate_limit_config(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        build_config(bad, {})


def test_propagation_max_reaches_the_limiter() -> None:
    def limiter_pmax(file_values: dict[str, object], flags: dict[str, object]) -> float:
        a = Admission.from_config(build_config({"rate_limit_rpm": 100, **file_values}, flags))
        assert a is not None
        return a.limiter.cfg.propagation_max

    assert limiter_pmax({}, {}) == 15.0  # on by default: τ follows the staleness, up to 15 s
    assert limiter_pmax({"rate_limit_window_secs": 10}, {}) == 10.0  # at most the window
    assert limiter_pmax({"rate_limit_propagation_max_secs": 30}, {}) == 30.0
    assert (
        limiter_pmax({"rate_limit_propagation_max_secs": 30}, {"rate_limit_propagation_max_secs": 0.0}) == 0.0
    )
    cfg = config_from_args(["serve", "--rate-limit-rpm", "100", "--rate-limit-propagation-max-secs", "20"])
    assert cfg.rate_limit_propagation_max_secs == 20.0


def test_429_envelope_and_headers() -> None:
    a = adm(RateLimitRule("*", None, rpm=2, tpm=10_000))
    p = Principal("k1", "team", "user")
    t1 = a.admit(p, "m", 100, 50)
    assert t1.headers == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "30s",
        "x-ratelimit-limit-tokens": "10000",
        "x-ratelimit-remaining-tokens": "9850",
        "x-ratelimit-reset-tokens": "900ms",
    }
    a.admit(p, "m", 100, None)  # no max_tokens: the estimate (100) is reserved
    with pytest.raises(RateLimited) as ei:
        a.admit(p, "m", 100, 50)
    e = ei.value
    env = orjson.loads(e.body())["error"]
    assert e.status == 429
    # OpenAI's: code rate_limit_exceeded, type the limit ("requests": RPM, "tokens": TPM)
    assert (env["type"], env["code"]) == ("requests", "rate_limit_exceeded")
    assert "requests per min" in env["message"] and "tenant 'team'" in env["message"]
    assert int(e.headers["retry-after"]) >= 1 and int(e.headers["retry-after-ms"]) > 0
    assert e.headers["x-ratelimit-remaining-requests"] == "0"
    assert e.headers["x-ratelimit-remaining-tokens"] == str(10_000 - 150 - 200)
    assert a.rejected["requests"] == 1 and a.admitted == 2
    assert a.admit("other-tenant", "m", 1, 1) is not UNLIMITED  # its own count


def test_request_too_large_has_no_retry_after() -> None:
    a = adm(RateLimitRule("t", None, tpm=1000))
    with pytest.raises(RateLimited) as ei:
        a.admit("t", "m", 900, 200)
    assert "retry-after" not in ei.value.headers
    assert "Request too large" in ei.value.message
    assert orjson.loads(ei.value.body())["error"]["type"] == "tokens"


def test_a_request_within_the_limit_above_a_partitioned_share_is_not_too_large() -> None:
    """A side that reaches 1 of 3 members admits a third of each limit: a request that fits the limit but
    not that third waits for the share to grow back (Retry-After), it is not "too large" (no Retry-After,
    "Reduce the prompt": the SDKs then give up), nor is an RPM refusal worded as a TPM one."""
    a = adm(RateLimitRule("t", None, rpm=2, tpm=3000))
    a.limiter.set_membership(["n0"], 3)
    with pytest.raises(RateLimited) as ei:
        a.admit("t", "m", 1000, 500)
    e = ei.value
    assert "Request too large" not in e.message and "TPM" not in e.message
    assert "requests per min" in e.message or "share of the RPM limit" in e.message
    assert int(e.headers["retry-after"]) >= 1
    b = adm(RateLimitRule("t", None, tpm=3000))
    b.limiter.set_membership(["n0"], 3)
    with pytest.raises(RateLimited) as ei:
        b.admit("t", "m", 1000, 500)
    assert "Request too large" not in ei.value.message and int(ei.value.headers["retry-after"]) >= 1
    with pytest.raises(RateLimited) as ei:
        b.admit("t", "m", 1000, 2500)  # above the limit itself: that one is never admitted
    assert "Request too large" in ei.value.message and "retry-after" not in ei.value.headers


def test_unlimited_tenant_costs_one_lookup() -> None:
    a = adm(RateLimitRule("gold", "m", rpm=1))
    assert a.admit("silver", "m", 10, 10) is UNLIMITED
    assert UNLIMITED.headers == {}
    UNLIMITED.settle(5)


@dataclass
class St:
    tokens: int
    finished: bool = False


@dataclass
class Jb:
    ids: list[int]
    states: Sequence[St] = field(default_factory=list)


def test_tokens_used_counts_what_ran() -> None:
    jobs = [Jb([1] * 10, [St(5, True), St(3)]), Jb([1] * 7, [St(0), St(0)]), Jb([1] * 4, [St(0, True)])]
    assert tokens_used(jobs) == (10 + 8) + 0 + 4


def request_for(tenant: str) -> web.Request:
    req = make_mocked_request("POST", "/v1/chat/completions")
    req[PRINCIPAL_KEY] = Principal("s", tenant, "user")
    return req


async def test_guard_settles_and_sets_headers() -> None:
    clock = Clock()
    a = adm(RateLimitRule("*", None, rpm=10, tpm=1000, max_concurrent=1), clock=clock)
    sampling = parse_chat(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}
    ).sampling
    jobs = [Jb([1] * 50, [St(20, True)])]
    seen: list[object] = []

    async def run() -> web.StreamResponse:
        seen.append(req.get(TICKET_KEY))
        # while this request runs, the tenant's one concurrency slot is taken
        with pytest.raises(RateLimited):
            a.admit("t", "m", 1, 1)
        return web.Response(text="ok")

    req = request_for("t")
    resp = await a.guard(req, "m", 50, sampling, run, jobs)
    assert resp.status == 200 and seen[0] is not None
    assert resp.headers["x-ratelimit-remaining-requests"] == "9"
    assert resp.headers["x-ratelimit-remaining-tokens"] == "850"  # right after admission: 50 + 100 reserved
    # settled with the real usage (70 tokens) and the slot released
    t = a.admit("t", "m", 1, 1)
    assert t.headers["x-ratelimit-remaining-tokens"] == str(1000 - 70 - 2)
    t.release()

    async def fails() -> web.StreamResponse:
        raise ConnectionResetError  # a client disconnect: the request still settles

    with pytest.raises(ConnectionResetError):
        await a.guard(request_for("t"), "m", 50, sampling, fails, [Jb([1] * 50, [St(0)])])
    a.admit("t", "m", 1, 1).release()  # the slot came back

    a2 = adm(RateLimitRule("t", None, rpm=1))
    a2.admit("t", "m", 1, 1)
    refused = await a2.guard(request_for("t"), "m", 1, sampling, run)
    assert refused.status == 429 and "retry-after" in refused.headers
    assert isinstance(refused, web.Response) and refused.body is not None
    assert orjson.loads(bytes(refused.body))["error"]["code"] == "rate_limit_exceeded"  # type: ignore[arg-type]


def test_set_rules_replaces_the_cache() -> None:
    a = adm(RateLimitRule("t", None, rpm=1))
    assert a.rules_for("t", "m")
    a.set_rules([dataclasses.replace(RateLimitRule("u", None), rpm=3)])
    assert a.rules_for("t", "m") == []
    assert a.rules_for("u", "m") == [(("u", ""), Limits(rpm=3))]


def test_a_refusal_by_the_lease_says_so_not_a_full_count() -> None:
    """A refusal whose mesh-wide count has room (this node's share is in use until the others' counts
    arrive: a gossip round, or a --procs sibling) does not read "Limit 10, Used 8, Requested 1" as if the
    limit were reached; a full count keeps OpenAI's wording."""
    from shepherd.mesh.ratelimit import Denial, Quota
    from shepherd.node.api.admission import denial_error

    lease = denial_error(Denial(("t", ""), "requests", 10, 8.0, 1, 0.4, Quota()), now=0.0)
    assert "share of the RPM limit" in str(lease.message) and "Rate limit reached" not in str(lease.message)
    full = denial_error(Denial(("t", ""), "requests", 10, 9.4, 1, 3.0, Quota()), now=0.0)
    assert "Rate limit reached for requests per min (RPM) of tenant 't': Limit 10, Used 9" in str(
        full.message
    )
    conc = denial_error(Denial(("t", ""), "concurrency", 2, 1.0, 1, 0.4, Quota()), now=0.0)
    assert "share of the concurrent requests limit" in str(conc.message)
    assert "Too many concurrent" in str(
        denial_error(Denial(("t", ""), "concurrency", 2, 2.0, 1, 0.4, Quota())).message
    )
    # its headers say what this node can admit now: none (the mesh-wide count's 2 left read as a
    # contradiction of the 429); a full count's headers are the count's
    q = Quota(limit_requests=10, remaining_requests=2, reset_requests=5.0)
    lease = denial_error(Denial(("t", ""), "requests", 10, 8.0, 1, 0.4, q), now=0.0)
    assert lease.headers["x-ratelimit-remaining-requests"] == "0"
    assert lease.anthropic_headers["anthropic-ratelimit-requests-remaining"] == "0"
    q = Quota(limit_requests=10, remaining_requests=0, limit_tokens=1000, remaining_tokens=300)
    full = denial_error(Denial(("t", ""), "tokens", 1000, 700.0, 500, 3.0, q), now=0.0)
    assert full.headers["x-ratelimit-remaining-tokens"] == "300"
