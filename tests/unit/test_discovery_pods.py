"""Kubernetes discovery's state machine (shepherd.node.discovery.pods): pod events in, decisions out.

Annotation names, selectors and model id sources as SMG's discovery has them (lightseekorg/smg
``model_gateway/src/service_discovery.rs``: ``smg.ai/worker-ports``, ``sglang.ai/bootstrap-port``,
``namespace`` / ``label:KEY`` / ``annotation:KEY``)."""

from __future__ import annotations

from typing import Any

import pytest

from shepherd.node.discovery.pods import (
    Decision,
    DiscoveryConfigError,
    DiscoverySettings,
    ModelIdSource,
    PodTracker,
    Target,
    parse_selector,
)
from tests.kube_standin import make_pod

REGULAR = DiscoverySettings({"app": "sglang"}, {}, {}, port=8000, default_model="m")
PD = DiscoverySettings(
    {},
    {"app": "sglang", "role": "prefill"},
    {"app": "sglang", "role": "decode"},
    port=50051,
    default_model="m",
)


def pod(name: str, ip: str | None = "10.0.0.1", **kw: Any) -> dict[str, Any]:
    kw.setdefault("labels", {"app": "sglang"})
    return make_pod(name, ip=ip, **kw)


def adds(ds: list[Decision]) -> list[str]:
    return [d.target.url for d in ds if d.action == "add"]


def removes(ds: list[Decision]) -> list[str]:
    return [d.target.url for d in ds if d.action == "remove"]


def test_selectors_parse_as_smg_takes_them() -> None:
    assert parse_selector(["app=sglang", "env=prod,tier=a"]) == {"app": "sglang", "env": "prod", "tier": "a"}
    assert parse_selector(["app==x"]) == {"app": "x"}
    for bad in (["app"], ["=x"], ["app!=x"], ["a=1", "a=2"]):
        with pytest.raises(DiscoveryConfigError):
            parse_selector(bad)
    assert (
        DiscoverySettings({}, {"app": "s", "role": "p"}, {"app": "s", "role": "d"}).list_selector() == "app=s"
    )
    assert REGULAR.list_selector() == "app=sglang"


def test_a_ready_pod_is_added_and_removed_when_deleted() -> None:
    t = PodTracker(REGULAR)
    p = pod("w0")
    assert t.event("ADDED", p) == [Decision("add", Target("grpc://10.0.0.1:8000", "m"), "default/w0")]
    assert t.event("MODIFIED", p) == []  # nothing changed
    assert removes(t.event("DELETED", p)) == ["grpc://10.0.0.1:8000"]
    assert t.active == {}


def test_readiness_is_honoured_both_ways() -> None:
    t = PodTracker(REGULAR)
    assert t.event("ADDED", pod("w0", ready=False)) == []
    assert adds(t.event("MODIFIED", pod("w0"))) == ["grpc://10.0.0.1:8000"]
    assert removes(t.event("MODIFIED", pod("w0", ready=False))) == ["grpc://10.0.0.1:8000"]
    assert t.event("ADDED", pod("w1", ip=None)) == []  # no IP yet
    assert t.event("MODIFIED", pod("w2", phase="Pending")) == []
    terminating = pod("w3")
    terminating["metadata"]["deletionTimestamp"] = "2026-11-29T00:00:00Z"
    assert adds(t.event("ADDED", pod("w3", ip="10.0.0.3"))) == ["grpc://10.0.0.3:8000"]
    terminating["status"]["podIP"] = "10.0.0.3"
    assert removes(t.event("MODIFIED", terminating)) == ["grpc://10.0.0.3:8000"]


def test_pods_the_selector_does_not_match_are_ignored() -> None:
    t = PodTracker(REGULAR)
    assert t.event("ADDED", pod("x", labels={"app": "vllm"})) == []
    assert t.event("ADDED", pod("y", labels={})) == []
    # a label change that takes a pod out of the selector removes its worker
    assert adds(t.event("ADDED", pod("w"))) == ["grpc://10.0.0.1:8000"]
    assert removes(t.event("MODIFIED", pod("w", labels={"app": "other"}))) == ["grpc://10.0.0.1:8000"]


def test_ports_annotation_gives_one_worker_per_port_and_protocol_sets_the_scheme() -> None:
    s = DiscoverySettings({"app": "sglang"}, {}, {}, port=8000, protocol="http", default_model="m")
    t = PodTracker(s)
    ds = t.event("ADDED", pod("w", annotations={"smg.ai/worker-ports": "9001, 9002,9001"}))
    assert adds(ds) == ["http://10.0.0.1:9001", "http://10.0.0.1:9002"]
    # a bad annotation falls back to the configured port, with a note the shell logs
    t2 = PodTracker(s)
    assert adds(t2.event("ADDED", pod("w", annotations={"smg.ai/worker-ports": "90x"}))) == [
        "http://10.0.0.1:8000"
    ]
    assert t2.notes and "smg.ai/worker-ports" in t2.notes[0]
    # IPv6 pods get brackets
    assert adds(PodTracker(s).event("ADDED", pod("v6", ip="fd00::5"))) == ["http://[fd00::5]:8000"]


def test_pd_roles_and_bootstrap_ports() -> None:
    t = PodTracker(PD)
    pre = pod(
        "p",
        ip="10.0.0.2",
        labels={"app": "sglang", "role": "prefill"},
        annotations={"sglang.ai/bootstrap-port": "8999"},
    )
    dec = pod("d", ip="10.0.0.3", labels={"app": "sglang", "role": "decode"})
    (a,) = t.event("ADDED", pre)
    assert a.target == Target("grpc://10.0.0.2:50051", "m", "prefill", 8999)
    (b,) = t.event("ADDED", dec)
    assert b.target == Target("grpc://10.0.0.3:50051", "m", "decode", None)
    # a pod with labels of neither role (the regular selector is empty in PD mode): nothing
    assert t.event("ADDED", pod("r", ip="10.0.0.4")) == []
    # several ports: one bootstrap port per port, or one for all
    multi = dict(pre)
    multi["metadata"] = {
        **pre["metadata"],
        "annotations": {"smg.ai/worker-ports": "1,2", "sglang.ai/bootstrap-port": "7001,7002"},
    }
    ts = PodTracker(PD).targets(multi)
    assert [(x.url, x.bootstrap_port) for x in ts] == [
        ("grpc://10.0.0.2:1", 7001),
        ("grpc://10.0.0.2:2", 7002),
    ]
    # a role change is a remove then an add of the same URL
    flipped = pod("p", ip="10.0.0.2", labels={"app": "sglang", "role": "decode"})
    ds = t.event("MODIFIED", flipped)
    assert [(d.action, d.target.role) for d in ds] == [("remove", "prefill"), ("add", "decode")]


def test_model_id_sources() -> None:
    assert ModelIdSource.parse("namespace") == ModelIdSource("namespace")
    assert ModelIdSource.parse("label:model") == ModelIdSource("label", "model")
    assert ModelIdSource.parse("annotation:smg.ai/model") == ModelIdSource("annotation", "smg.ai/model")
    for bad in ("label:", "pod-name", "annotation: "):
        with pytest.raises(DiscoveryConfigError):
            ModelIdSource.parse(bad)
    by_label = DiscoverySettings({"app": "sglang"}, {}, {}, model_id_source=ModelIdSource("label", "model"))
    t = PodTracker(by_label)
    (a,) = t.event("ADDED", pod("w", labels={"app": "sglang", "model": "llama"}))
    assert a.target.model == "llama"
    assert t.event("ADDED", pod("w2", ip="10.0.0.9")) == []  # no such label: nothing, and a note
    assert t.notes
    by_ns = DiscoverySettings({"app": "sglang"}, {}, {}, model_id_source=ModelIdSource("namespace"))
    (b,) = PodTracker(by_ns).event("ADDED", pod("w", namespace="qwen3"))
    assert b.target.model == "qwen3"
    by_ann = DiscoverySettings({"app": "sglang"}, {}, {}, model_id_source=ModelIdSource("annotation", "m/id"))
    (c,) = PodTracker(by_ann).event("ADDED", pod("w", annotations={"m/id": "x"}))
    assert c.target.model == "x"
    # a model the node does not serve: nothing, and a note
    served = DiscoverySettings(
        {"app": "sglang"}, {}, {}, model_id_source=ModelIdSource("label", "model"), models=frozenset({"qwen"})
    )
    t2 = PodTracker(served)
    assert t2.event("ADDED", pod("w", labels={"app": "sglang", "model": "llama"})) == []
    assert "not served" in t2.notes[0]
    assert adds(t2.event("ADDED", pod("q", ip="10.0.0.8", labels={"app": "sglang", "model": "qwen"})))
    # a model change of a pod moves its worker
    ds = t.event("MODIFIED", pod("w", labels={"app": "sglang", "model": "qwen"}))
    assert [(d.action, d.target.model) for d in ds] == [("remove", "llama"), ("add", "qwen")]


def test_resync_replaces_everything_known() -> None:
    t = PodTracker(REGULAR)
    t.event("ADDED", pod("a", ip="10.0.0.1"))
    t.event("ADDED", pod("b", ip="10.0.0.2"))
    # the relist (after 410 Gone) has b (now not ready) and a new c; a was deleted meanwhile
    ds = t.resync([pod("b", ip="10.0.0.2", ready=False), pod("c", ip="10.0.0.3")])
    assert sorted(removes(ds)) == ["grpc://10.0.0.1:8000", "grpc://10.0.0.2:8000"]
    assert adds(ds) == ["grpc://10.0.0.3:8000"]
    assert set(t.active) == {"grpc://10.0.0.3:8000"}
    assert t.resync([pod("c", ip="10.0.0.3")]) == []


def test_an_ip_reused_by_two_pods_is_kept_until_both_stop_offering_it() -> None:
    t = PodTracker(REGULAR)
    assert adds(t.event("ADDED", pod("old", ip="10.0.0.7"))) == ["grpc://10.0.0.7:8000"]
    assert t.event("ADDED", pod("new", ip="10.0.0.7")) == []  # same URL: already there
    assert t.event("DELETED", pod("old", ip="10.0.0.7")) == []  # still offered by "new"
    assert removes(t.event("DELETED", pod("new", ip="10.0.0.7"))) == ["grpc://10.0.0.7:8000"]


def test_other_event_types_and_nameless_pods_change_nothing() -> None:
    t = PodTracker(REGULAR)
    assert t.event("BOOKMARK", pod("w")) == []
    assert t.event("ADDED", {"metadata": {}}) == []
    assert t.active == {}


def test_edge_cases_of_the_event_stream() -> None:
    """An IP change, a port annotation change, a duplicate ADDED, a pod deleted while not ready and a
    DELETED of a pod never seen: each leaves exactly the workers the pods offer."""
    t = PodTracker(REGULAR)
    assert adds(t.event("ADDED", pod("w", ip="10.0.0.1"))) == ["grpc://10.0.0.1:8000"]
    assert t.event("ADDED", pod("w", ip="10.0.0.1")) == []  # duplicate ADDED (a re-opened watch)
    ds = t.event("MODIFIED", pod("w", ip="10.0.0.2"))  # the pod's IP changed: the old URL goes
    assert (removes(ds), adds(ds)) == (["grpc://10.0.0.1:8000"], ["grpc://10.0.0.2:8000"])
    ds = t.event("MODIFIED", pod("w", ip="10.0.0.2", annotations={"smg.ai/worker-ports": "9000,8000"}))
    assert (removes(ds), adds(ds)) == ([], ["grpc://10.0.0.2:9000"])  # 8000 stays, 9000 comes
    ds = t.event("MODIFIED", pod("w", ip="10.0.0.2", annotations={"smg.ai/worker-ports": "9001"}))
    assert (sorted(removes(ds)), adds(ds)) == (
        ["grpc://10.0.0.2:8000", "grpc://10.0.0.2:9000"],
        ["grpc://10.0.0.2:9001"],
    )
    assert set(t.active) == {"grpc://10.0.0.2:9001"}
    assert t.event("ADDED", pod("slow", ip="10.0.0.5", ready=False)) == []
    assert t.event("DELETED", pod("slow", ip="10.0.0.5", ready=False)) == []  # never added: nothing
    assert t.event("DELETED", pod("ghost", ip="10.0.0.2")) == []  # unknown pod, even on a known URL
    assert set(t.active) == {"grpc://10.0.0.2:9001"}
    assert removes(t.event("DELETED", pod("w", ip="10.0.0.2"))) == ["grpc://10.0.0.2:9001"]
    assert t.active == {} and t.offers == {}


def test_a_pod_outside_the_watched_namespace_offers_nothing() -> None:
    """Whatever the API server (or something posing as it) sends: a selected, ready pod of another
    namespace adds no worker."""
    s = DiscoverySettings({"app": "sglang"}, {}, {}, default_model="m", namespace="inference")
    t = PodTracker(s)
    assert t.event("ADDED", pod("evil", ip="10.0.0.66", namespace="other")) == []
    assert t.resync([pod("evil", ip="10.0.0.66", namespace="other")]) == []
    assert t.notes and "not in namespace 'inference'" in t.notes[0]
    assert adds(t.event("ADDED", pod("w", ip="10.0.0.1", namespace="inference"))) == ["grpc://10.0.0.1:8000"]
