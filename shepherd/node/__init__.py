"""One gateway node: the composition root (``app``, ``cli`` with ``smg_flags``, SMG's flags on its command
line, ``devrun``, ``config``, ``metrics``) and
its rooms, on the request path in this order:

``http`` (HTTP/1.1 server) -> ``api`` (routes, admission, generation driving) -> ``openai`` (the
OpenAI schema: parsing, chunks; ``anthropic`` the Anthropic Messages schema over it) -> ``tokens``
(render, encode) -> ``dispatch`` (gateway, workers,
policies, PD) -> ``engines`` (one engine connection each) -> ``output`` (detokenize, stop, parsers)
-> ``openai`` chunks -> client; ``cluster`` is this node's part in the mesh; ``discovery`` finds workers
among Kubernetes pods; ``observe`` (traces, JSON logs, GenAI metrics export) is a root leaf every room
reads.

Callers use: ``app.serve`` / ``app.build_app``, ``cli.main`` (``smg-node``), ``config.NodeConfig`` /
``build_config``.
"""

__all__ = [
    "anthropic",
    "api",
    "app",
    "cli",
    "cluster",
    "config",
    "devrun",
    "discovery",
    "dispatch",
    "engines",
    "gc_tuning",
    "http",
    "metrics",
    "observe",
    "openai",
    "output",
    "procs",
    "smg_flags",
]
