"""The test-only fault switches (``shepherd.mesh.faults``) the chaos suite injects to prove it sees a break:
read from the environment, off unless set to ``1``, and each one breaking exactly what it names."""

from __future__ import annotations

import pytest

from shepherd.mesh import faults
from shepherd.mesh.swim_types import SwimConfig
from shepherd.proto.mesh_messages import Suspect
from tests.unit.test_mesh_swim import mk


def test_switches_are_off_unless_set_to_one() -> None:
    assert faults.active({}) == []
    env = {"SHEPHERD_FAULT_DISABLE_MESH": "1", "SHEPHERD_FAULT_DISABLE_REFUTATION": "yes"}
    assert faults.injected(faults.DISABLE_MESH, env)
    assert not faults.injected(faults.DISABLE_REFUTATION, env)  # only "1" switches a fault on
    assert faults.active(env) == [faults.DISABLE_MESH]
    assert faults.env_name(faults.DISABLE_INDEX_GOSSIP) == "SHEPHERD_FAULT_DISABLE_INDEX_GOSSIP"
    with pytest.raises(ValueError):
        faults.env_name("DISABLE_EVERYTHING")
    assert len(set(faults.KNOWN)) == len(faults.KNOWN)
    for f in ("DISABLE_MESH", "DISABLE_RATELIMIT", "DISABLE_RATELIMIT_GOSSIP", "DISABLE_INDEX_GOSSIP"):
        assert f in faults.KNOWN


def test_no_refutation_leaves_an_accused_node_suspected() -> None:
    healthy = mk(6)
    healthy.on_packet(1.0, ("x", 1), Suspect(1, "me", "p1"))
    assert healthy.incarnation == 2  # the normal node refutes
    broken = mk(6, cfg=SwimConfig(fault_no_refutation=True))
    broken.on_packet(1.0, ("x", 1), Suspect(1, "me", "p1"))
    assert broken.incarnation == 1  # the fault: it never outbids the accusation
    assert broken.stats.refutations == 0 < healthy.stats.refutations


def test_the_node_reads_the_refutation_switch_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    from shepherd.node.cluster.mesh_node import swim_config  # not at the top: after the env is set
    from shepherd.node.config import build_config  # not at the top: as above

    cfg = build_config({"mesh_port": 7946, "mesh_name": "a", "mesh_dev_pki": "/tmp/unused"}, {})
    assert swim_config(cfg).fault_no_refutation is False
    monkeypatch.setenv("SHEPHERD_FAULT_DISABLE_REFUTATION", "1")
    assert swim_config(cfg).fault_no_refutation is True


def test_ignoring_the_partition_rule_lets_a_side_count_only_whom_it_reaches() -> None:
    from shepherd.mesh.ratelimit import Limits, RateLimiter  # not at the top: only this test limits rates
    from shepherd.node.cluster.mesh_node import limiter_members  # not at the top: as above

    members = [("a", "alive"), ("b", "alive"), ("c", "dead"), ("d", "suspect"), ("e", "left")]
    rules = [(("t", ""), Limits(rpm=30))]
    seen = {}
    for broken in (False, True):
        rl = RateLimiter("a", 1)
        rl.update_members(limiter_members(members, broken), 1000.0)
        seen[broken] = (rl.reachable, rl.cluster_size, rl.quota(1000.0, rules).remaining_requests)
    # the partition rule: N keeps the unreachable members that did not leave; a side admits limit x R / N
    assert seen[False] == (2, 4, 15)
    # the fault: N is whom this side reaches, so it admits the whole limit
    assert seen[True] == (2, 2, 30)
    assert faults.IGNORE_PARTITION_RULE in faults.KNOWN
