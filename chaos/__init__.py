"""Shepherd's chaos suite: a fleet of nodes, mock engines and a load balancer, one network namespace each,
on one machine; faults injected with iptables, signals, a delay proxy, libfaketime and the mock engine's
``/mock/faults``. Run ``python -m chaos.run list`` for the scenarios (docs/DESIGN.md §7).
"""
