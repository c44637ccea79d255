"""The prefix index layouts the tests run on (the native one only where the C module is built)."""

from __future__ import annotations

import pytest

from shepherd.policies.native_index import NATIVE_INDEX, NativePrefixIndex
from shepherd.policies.prefix_index import PrefixIndex
from shepherd.policies.prefix_replica import ReplicatedPrefixIndex
from shepherd.policies.run_index import RunPrefixIndex

NEEDS_CORE = pytest.mark.skipif(not NATIVE_INDEX, reason="_prefixcore not built")
NATIVE = pytest.param(NativePrefixIndex, id="native", marks=NEEDS_CORE)
LAYOUTS = [
    pytest.param(PrefixIndex, id="flat"),
    pytest.param(RunPrefixIndex, id="runs"),
    pytest.param(ReplicatedPrefixIndex, id="mesh"),
    NATIVE,
]
