"""``smg-bench``: the load generator, /proc CPU accounting and reports. Imports tokens and proto (and
the mesh for its benchmark's defaults, the policies for the routing simulator); runs the node only as a
process, never its modules.

Callers use: ``cli.main``, ``benchmarks`` (gateway, routing, routing_sim, mesh with its processes in
``mesh_cluster``, ratelimit), ``client`` (the asyncio load generator), ``procstat`` (CPU and memory from
/proc), ``report``.
"""

__all__ = [
    "benchmarks",
    "cli",
    "client",
    "http1",
    "procs",
    "procstat",
    "prompts",
    "report",
    "sse",
    "stats",
    "targets",
    "trace",
]
