"""The node's collector settings: frozen start-up heap, a raised generation-0 threshold, 0 = CPython's."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from shepherd.node import gc_tuning
from shepherd.node.cli import config_from_args
from shepherd.node.config import ConfigError, build_config


@pytest.fixture
def restore_gc() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*before)


def test_settle_freezes_and_raises_threshold(restore_gc: None) -> None:
    keep = [[i] for i in range(100)]  # start-up state that lives as long as the process
    gc_tuning.settle(12_345)
    assert gc.get_threshold()[0] == 12_345
    assert gc.get_freeze_count() >= len(keep)
    assert id(keep) not in {id(o) for o in gc.get_objects()}  # no collection walks it again


def test_zero_keeps_cpython_defaults(restore_gc: None) -> None:
    before = gc.get_threshold()
    gc_tuning.settle(0)
    assert gc.get_threshold() == before


def test_cycles_are_still_collected_without_asking(restore_gc: None) -> None:
    gc_tuning.settle(50)

    class Node:
        other: object = None

    a, b = Node(), Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    assert gone() is not None  # a cycle: reference counting alone never frees it
    junk = [[i] for i in range(500)]  # allocations past the threshold start a collection on their own
    assert gone() is None
    del junk


def test_flag_and_validation() -> None:
    cfg = config_from_args(["serve", "--gc-gen0-threshold", "0"])
    assert cfg.gc_gen0_threshold == 0
    assert config_from_args(["serve"]).gc_gen0_threshold == gc_tuning.GEN0_THRESHOLD
    with pytest.raises(ConfigError):
        build_config({"gc_gen0_threshold": -1}, {})
