"""The mesh rate limiter in the deterministic simulation: over- and under-admission per window, in
simulated time (3 nodes unless said, load at 2x the limit, gossip every 0.2 s, 60 s windows; the first
window, a cold start, is left out of the figures)."""

from __future__ import annotations

from shepherd.mesh.ratelimit import LimiterConfig, Limits
from shepherd.mesh.ratelimit_sim import (
    Load,
    NetModel,
    Partition,
    Rule,
    Scenario,
    SimResult,
    even,
    simulate,
    summarize,
    uneven,
)

RPM = 600
TPM = 300_000
RATE_2X = 2 * RPM / 60  # requests per second at twice the limit
REQ = (Rule("a", Limits(rpm=RPM)),)
TOK = (Rule("a", Limits(tpm=TPM)),)
TOK_RATE_2X = 2 * TPM / 60 / 670  # ~670 real tokens per request in the default load


def figures(r: SimResult, metric: str, limit: float, tenant: str = "a") -> tuple[float, float, float]:
    return summarize(r.ratios(tenant, metric, limit))


def assert_bounds(r: SimResult, metric: str, limit: float, worst: float = 1.10) -> None:
    mean, hi, lo = figures(r, metric, limit)
    assert mean <= 1.05 and hi <= worst, (mean, hi)
    assert lo >= 0.95, lo


def test_steady_state_even_load() -> None:
    r = simulate(Scenario(3, 300, REQ, (Load("a", even(RATE_2X, 3)),)))
    assert_bounds(r, "requests", RPM)


def test_steady_state_uneven_load() -> None:
    for weights in ([7, 2, 1], [1, 0, 0]):
        r = simulate(Scenario(3, 300, REQ, (Load("a", uneven(RATE_2X, weights)),)))
        assert_bounds(r, "requests", RPM)


def test_load_moving_between_nodes() -> None:
    loads = (Load("a", (RATE_2X, 0, 0), end=150), Load("a", (0, 0, RATE_2X), start=150))
    assert_bounds(simulate(Scenario(3, 300, REQ, loads)), "requests", RPM)


def test_one_node_partitioned_away() -> None:
    cut = (Partition(75, 230, ((0, 1), (2,))),)  # both the cut and the heal inside measured windows
    r = simulate(Scenario(3, 300, REQ, (Load("a", even(RATE_2X, 3)),), partitions=cut))
    mean, hi, _ = figures(r, "requests", RPM)
    assert mean <= 1.05 and hi <= 1.10, (mean, hi)
    # slow failure detection: the sides keep counting each other as live for 10 s
    slow = NetModel(detect=10.0)
    r = simulate(Scenario(3, 300, REQ, (Load("a", even(RATE_2X, 3)),), net=slow, partitions=cut))
    assert figures(r, "requests", RPM)[1] <= 1.10


def test_lossy_network() -> None:
    r = simulate(Scenario(3, 240, REQ, (Load("a", even(RATE_2X, 3)),), net=NetModel(loss=0.3)))
    assert_bounds(r, "requests", RPM)


def test_tokens_per_minute() -> None:
    for rates in (even(TOK_RATE_2X, 3), uneven(TOK_RATE_2X, [6, 3, 1])):
        r = simulate(Scenario(3, 240, TOK, (Load("a", rates),)))
        assert_bounds(r, "tokens", TPM)


def test_a_burst_on_every_node_at_once() -> None:
    burst = (Load("a", (1000.0, 1000.0, 1000.0), poisson=False, end=0.5),)  # 2.5x the limit in 0.5 s
    lease = simulate(Scenario(3, 60, REQ, burst))
    naive = simulate(Scenario(3, 60, REQ, burst, limiter=LimiterConfig(lease=False)))
    assert lease.ratios("a", "requests", RPM, skip=0)[0] <= 1.0
    assert naive.ratios("a", "requests", RPM, skip=0)[0] > 1.2  # what the lease prevents


def test_a_flooding_tenant_does_not_touch_another() -> None:
    rules = (Rule("a", Limits(rpm=120)), Rule("b", Limits(rpm=RPM)))
    loads = (Load("a", even(10 * 120 / 60, 3)), Load("b", even(0.5 * RPM / 60, 3)))
    r = simulate(Scenario(3, 240, rules, loads))
    b = r.stats["b"]
    assert sum(w.admitted for w in b) == sum(w.offered for w in b)  # b is never refused
    mean, hi, lo = figures(r, "requests", 120)
    assert hi <= 1.10 and lo >= 0.95, (mean, hi, lo)


def test_concurrency() -> None:
    rule = (Rule("a", Limits(max_concurrent=30)),)
    r = simulate(Scenario(3, 240, rule, (Load("a", even(34.0, 3)),)))  # ~2x: 34/s x 1.75 s
    assert figures(r, "excess_concurrent", 30)[1] <= 0.02  # time-averaged in-flight over the limit
    assert figures(r, "peak_concurrent", 30)[1] <= 1.15  # 34 at any instant, at most
    assert figures(r, "mean_concurrent", 30)[2] >= 0.92


def test_deterministic() -> None:
    sc = Scenario(3, 120, REQ, (Load("a", even(RATE_2X, 3)),), net=NetModel(loss=0.1), seed=7)
    a, b = simulate(sc), simulate(sc)
    assert [w.admitted for w in a.stats["a"]] == [w.admitted for w in b.stats["a"]]
    assert a.messages == b.messages
