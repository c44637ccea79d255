"""Injectable faults: error rate, stall, slow-down, crash, hang before the first token, late model info."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from dataclasses import dataclass

ERROR_CODES = ("UNAVAILABLE", "INTERNAL", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED")


@dataclass(frozen=True, slots=True)
class Faults:
    """Current fault settings. ``crash_after_requests``: the process exits (os._exit) when a request
    arrives after that many more requests were received since the setting was made."""

    error_rate: float = 0.0
    error_code: str = "UNAVAILABLE"
    stall_after_tokens: int | None = None
    stall_seconds: float = 0.0
    slow_factor: float = 1.0
    crash_after_requests: int | None = None
    hang_before_first_token: bool = False
    # GetModelInfo and GetServerInfo each answer this late (an engine loading, or under heavy load)
    info_delay_seconds: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError("error_rate must be in [0, 1]")
        if self.error_code not in ERROR_CODES:
            raise ValueError(f"error_code must be one of {', '.join(ERROR_CODES)}")
        if self.stall_after_tokens is not None and self.stall_after_tokens < 0:
            raise ValueError("stall_after_tokens must be >= 0")
        if self.stall_seconds < 0:
            raise ValueError("stall_seconds must be >= 0")
        if self.slow_factor <= 0:
            raise ValueError("slow_factor must be > 0")
        if self.crash_after_requests is not None and self.crash_after_requests < 0:
            raise ValueError("crash_after_requests must be >= 0")
        if self.info_delay_seconds < 0:
            raise ValueError("info_delay_seconds must be >= 0")

    def updated(self, changes: Mapping[str, object]) -> Faults:
        """A copy with ``changes`` applied (JSON values; ``null`` clears an optional field).

        Raises ValueError on an unknown field or a value of the wrong type.
        """
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key, value in changes.items():
            if key not in values:
                raise ValueError(f"unknown fault {key!r}; known: {', '.join(values)}")
            values[key] = _coerce(key, value)
        return Faults(**values)

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)


_FLOATS = {"error_rate", "stall_seconds", "slow_factor", "info_delay_seconds"}
_OPTIONAL_INTS = {"stall_after_tokens", "crash_after_requests"}


def _coerce(key: str, value: object) -> object:
    if key in _FLOATS and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if key in _OPTIONAL_INTS and (value is None or (isinstance(value, int) and not isinstance(value, bool))):
        return value
    if key == "error_code" and isinstance(value, str):
        return value.upper()
    if key == "hang_before_first_token" and isinstance(value, bool):
        return value
    raise ValueError(f"fault {key!r}: bad value {value!r}")


class FaultInjector:
    """Holds the current faults and draws the error decisions (seeded, so runs repeat)."""

    def __init__(self, faults: Faults, seed: int = 0) -> None:
        self._rng = random.Random(seed ^ 0x5EED)
        self.faults = faults
        self._received = 0
        self._crash_at: int | None = None
        self.set(faults)

    def set(self, faults: Faults) -> None:
        self.faults = faults
        n = faults.crash_after_requests
        self._crash_at = None if n is None else self._received + n

    def on_request(self) -> str | None:
        """Count an arriving request. Returns "crash", an error code name, or None."""
        self._received += 1
        if self._crash_at is not None and self._received > self._crash_at:
            return "crash"
        rate = self.faults.error_rate
        if rate > 0.0 and self._rng.random() < rate:
            return self.faults.error_code
        return None
