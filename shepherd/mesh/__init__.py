"""The mesh: SWIM membership, replicated state and mesh-wide rate limits. Imports proto and auth.

Callers use: ``runtime.MeshRuntime`` (the I/O shell: UDP gossip, TCP push-pull over mTLS) and
``runtime_config`` (its config, and parsing and resolving addresses), ``dns_seeds`` (``dns:NAME``
seeds: every A/AAAA record, re-resolved until joined),
``swim.Swim`` and ``swim_types`` (the pure membership state machine and its config), ``state.MeshState``
(workers, health, prefix indexes through a merge interface, the control-plane document, extras) with
``state_types`` (its config, counters and component protocols) and ``state_wire`` (its payload envelope),
``index_scope`` (which members route a model: its index deltas go to them only),
``ratelimit.RateLimiter`` (G-counter shards per window), ``keyring`` (sealed datagrams), ``replay``
(replay windows of sealed datagrams), ``senders`` (datagram senders bound to certificates), ``sim``
(a deterministic simulation for tests and benchmarks), ``faults`` (test-only fault switches the chaos
suite injects).
"""

__all__ = [
    "dns_seeds",
    "faults",
    "hlc",
    "index_scope",
    "keyring",
    "ratelimit",
    "ratelimit_keys",
    "ratelimit_shards",
    "ratelimit_sim",
    "replay",
    "runtime",
    "runtime_config",
    "senders",
    "sim",
    "state",
    "state_config",
    "state_health",
    "state_registry",
    "state_types",
    "state_wire",
    "swim",
    "swim_broadcast",
    "swim_members",
    "swim_probe",
    "swim_suspicion",
    "swim_types",
    "transport",
]
