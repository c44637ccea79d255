"""The scenario registry, filled by importing the scenario modules (their order is the run order)."""

from __future__ import annotations

from chaos.scenarios import (
    engine_faults,
    mesh,
    mesh_large,
    network_faults,
    node_faults,
    primitives,
    wire_upgrade,
)
from chaos.scenarios.base import REGISTRY, Scenario

__all__ = [
    "REGISTRY",
    "Scenario",
    "engine_faults",
    "mesh",
    "mesh_large",
    "network_faults",
    "node_faults",
    "primitives",
    "wire_upgrade",
]

ORDER = (
    "partition_primitives",
    "node_crash",
    "rolling_restart",
    "node_pause_0.5s",
    "node_pause_1.5s",
    "node_pause_10s",
    "engine_crash",
    "engine_slow",
    "loss_10pct",
    "loss_30pct",
    "clock_skew",
    "node_join",
    "slow_link",
)


def ordered() -> list[Scenario]:
    """Every scenario: the implemented ones in ORDER, then the rest (placeholders) as registered."""
    first = [REGISTRY[name] for name in ORDER if name in REGISTRY]
    return first + [s for name, s in REGISTRY.items() if name not in ORDER]


def short() -> list[Scenario]:
    return [s for s in ordered() if s.short]
