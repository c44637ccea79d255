"""Kubernetes worker discovery as a pure state machine: pod events in, worker add/remove decisions out.

``PodTracker`` knows which workers each selected pod offers and turns a full listing (``resync``, after
every list) or one watch event (``event``: ``ADDED`` / ``MODIFIED`` / ``DELETED``) into the
``Decision``s that bring the node's workers in line. No I/O, no clock: ``shepherd.node.discovery.kube``
feeds it from the API server and applies what it decides.

What a pod offers (``PodTracker.targets``), mirroring SMG's discovery (lightseekorg/smg
``model_gateway/src/service_discovery.rs``: selectors, ``smg.ai/worker-ports``,
``sglang.ai/bootstrap-port``, ``namespace`` / ``label:KEY`` / ``annotation:KEY`` model id sources):

- its role: ``prefill`` or ``decode`` when it carries every label of that selector (PD mode), else
  ``regular`` when it carries every label of the regular selector; else nothing;
- nothing when it is outside the watched namespace (``DiscoverySettings.namespace``: defence in depth,
  the list and watch already ask for that namespace only);
- nothing unless it is *ready*: phase ``Running``, a ``Ready`` condition ``True``, an IP, and no
  deletion timestamp (a terminating pod stops getting requests at once);
- one worker per port: the ports annotation (comma-separated, order kept, duplicates dropped), else the
  configured port; URL ``<protocol>://<pod IP>:<port>``;
- a prefill worker's bootstrap port from the bootstrap annotation (one value for every port, or one per
  port), else None (SGLang's default);
- its model: from the model id source when configured (a pod without that label / annotation, or naming
  a model the node does not serve, offers nothing), else the node's single model.

Several pods may offer one URL (an IP reused by a new pod while the old one is still listed): a worker is
added when the first pod offers it and removed when the last one stops. A URL whose worker changes
(another model or role) is removed, then added anew.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

Role = Literal["regular", "prefill", "decode"]
Action = Literal["add", "remove"]

WORKER_PORTS_ANNOTATION = "smg.ai/worker-ports"  # SMG's default
BOOTSTRAP_PORT_ANNOTATION = "sglang.ai/bootstrap-port"  # SGLang router's and SMG's default


class DiscoveryConfigError(ValueError):
    """A discovery setting that cannot work (a selector or model id source that does not parse)."""


def parse_selector(entries: Iterable[str]) -> dict[str, str]:
    """``["app=sglang", "role=prefill,tier=a"]`` -> ``{"app": "sglang", "role": "prefill", "tier": "a"}``
    (SMG's ``KEY=VALUE`` pairs, several per flag or comma-separated; equality only)."""
    out: dict[str, str] = {}
    for entry in entries:
        for part in entry.split(","):
            part = part.strip()
            if not part:
                continue
            key, sep, value = part.partition("=")
            key, value = key.strip(), value.strip().removeprefix("=")  # "k==v" is "k=v" in Kubernetes
            if not sep or not key or "!" in key:
                raise DiscoveryConfigError(f"selector entry {part!r}: use KEY=VALUE")
            if out.get(key, value) != value:
                raise DiscoveryConfigError(f"selector: {key!r} given twice with different values")
            out[key] = value
    return out


def selector_string(selector: Mapping[str, str]) -> str:
    """The API server's ``labelSelector`` of a selector (sorted: stable in logs and requests)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items()))


@dataclass(frozen=True, slots=True)
class ModelIdSource:
    """Where a pod's model id comes from: ``namespace``, ``label:KEY`` or ``annotation:KEY``."""

    kind: Literal["namespace", "label", "annotation"]
    key: str = ""

    @classmethod
    def parse(cls, text: str) -> ModelIdSource:
        if text.lower() == "namespace":
            return cls("namespace")
        for kind in ("label", "annotation"):
            prefix = kind + ":"
            if text.startswith(prefix):
                key = text[len(prefix) :].strip()
                if not key:
                    raise DiscoveryConfigError(f"model id source {text!r}: {prefix} needs a key")
                return cls(kind, key)
        raise DiscoveryConfigError(
            f"model id source {text!r}: use 'namespace', 'label:KEY' or 'annotation:KEY'"
        )

    def extract(self, meta: Mapping[str, Any]) -> str | None:
        if self.kind == "namespace":
            value = meta.get("namespace")
        else:
            value = (meta.get("labels" if self.kind == "label" else "annotations") or {}).get(self.key)
        if not isinstance(value, str) or not value.strip():
            return None
        return value.strip()


@dataclass(frozen=True, slots=True)
class DiscoverySettings:
    """What ``PodTracker`` needs: the selectors (an empty one selects nothing), the port and protocol of
    the discovered workers, the annotation names and where the model id comes from."""

    selector: Mapping[str, str]
    prefill_selector: Mapping[str, str]
    decode_selector: Mapping[str, str]
    port: int = 8000
    protocol: str = "grpc"
    worker_ports_annotation: str = WORKER_PORTS_ANNOTATION
    bootstrap_port_annotation: str = BOOTSTRAP_PORT_ANNOTATION
    model_id_source: ModelIdSource | None = None
    default_model: str | None = None  # the node's model when it serves exactly one
    models: frozenset[str] = frozenset()  # the models the node serves (empty: any)
    # the namespace watched: a pod of another namespace offers nothing, whatever the API server sends
    # (None: any; ``PodDiscovery`` sets it to the namespace it lists and watches)
    namespace: str | None = None

    def list_selector(self) -> str:
        """One ``labelSelector`` covering every role: the labels all non-empty selectors share (empty:
        no server-side filter; ``PodTracker`` still matches each pod against each selector)."""
        selectors = [s for s in (self.selector, self.prefill_selector, self.decode_selector) if s]
        if not selectors:
            return ""
        first, rest = selectors[0], selectors[1:]
        shared = {k: v for k, v in first.items() if all(s.get(k) == v for s in rest)}
        return selector_string(shared)


@dataclass(frozen=True, slots=True)
class Target:
    """One worker a pod offers."""

    url: str
    model: str
    role: Role = "regular"
    bootstrap_port: int | None = None  # prefill workers (SGLang bootstrap); None: the engine's default


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    target: Target
    pod: str  # namespace/name of the pod that caused it (logs)


@dataclass(slots=True)
class TrackerStats:
    events: int = 0
    resyncs: int = 0
    skipped: int = 0  # pods selected but offering nothing they could (no model, bad annotation)


def _matches(labels: Mapping[str, Any], selector: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _port_list(raw: object) -> list[int] | None:
    if not isinstance(raw, str):
        return None
    ports: list[int] = []
    for part in raw.split(","):
        part = part.strip()
        if not part.isdigit() or not 0 < int(part) < 65536:
            return None
        if int(part) not in ports:
            ports.append(int(part))
    return ports or None


def pod_key(pod: Mapping[str, Any]) -> str | None:
    meta = pod.get("metadata") or {}
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        return None
    return f"{meta.get('namespace') or ''}/{name}"


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """Running, Ready, with an IP and not being deleted."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


class PodTracker:
    """The pods seen so far and the workers they offer; ``resync`` / ``event`` return the decisions.

    Invariant: after any call, the set of targets added and not removed by the decisions returned so
    far is exactly ``{t for ts in offers.values() for t in ts}`` keyed by URL (first offer wins when
    two pods offer one URL differently)."""

    def __init__(self, settings: DiscoverySettings) -> None:
        self.settings = settings
        self.offers: dict[str, tuple[Target, ...]] = {}  # pod key -> what it offers now
        self.active: dict[str, Target] = {}  # url -> the worker added for it
        self.stats = TrackerStats()
        self.notes: list[str] = []  # why selected pods offer nothing (the shell logs and clears them)

    def role(self, labels: Mapping[str, Any]) -> Role | None:
        s = self.settings
        if _matches(labels, s.prefill_selector):
            return "prefill"
        if _matches(labels, s.decode_selector):
            return "decode"
        if _matches(labels, s.selector):
            return "regular"
        return None

    def targets(self, pod: Mapping[str, Any]) -> tuple[Target, ...]:
        """The workers ``pod`` offers now (none when it is not selected or not ready)."""
        s = self.settings
        meta = pod.get("metadata") or {}
        role = self.role(meta.get("labels") or {})
        if role is None or not pod_ready(pod):
            return ()
        if s.namespace is not None and meta.get("namespace") != s.namespace:
            self._note(f"pod {pod_key(pod)}: not in namespace {s.namespace!r}: ignored")
            return ()
        name = pod_key(pod) or "?"
        annotations = meta.get("annotations") or {}
        model = s.model_id_source.extract(meta) if s.model_id_source is not None else s.default_model
        if model is None:
            self._note(f"pod {name}: no model id (model id source, or a node serving several models)")
            return ()
        if s.models and model not in s.models:
            self._note(f"pod {name}: model {model!r} is not served by this node")
            return ()
        ip = str((pod.get("status") or {}).get("podIP"))
        try:
            host = f"[{ip}]" if ipaddress.ip_address(ip).version == 6 else ip
        except ValueError:
            self._note(f"pod {name}: podIP {ip!r} is not an IP address")
            return ()
        ports = [s.port]
        if s.worker_ports_annotation in annotations:
            parsed = _port_list(annotations[s.worker_ports_annotation])
            if parsed is None:
                self._note(f"pod {name}: {s.worker_ports_annotation} is not a list of ports: port {s.port}")
            else:
                ports = parsed
        boots: list[int | None] = [None] * len(ports)
        if role == "prefill" and s.bootstrap_port_annotation in annotations:
            b = _port_list(annotations[s.bootstrap_port_annotation])
            if b is not None and len(b) == 1:
                boots = [b[0]] * len(ports)
            elif b is not None and len(b) == len(ports):
                boots = list(b)
            else:
                self._note(f"pod {name}: {s.bootstrap_port_annotation} does not match its ports: ignored")
        return tuple(
            Target(f"{s.protocol}://{host}:{p}", model, role, bp) for p, bp in zip(ports, boots, strict=True)
        )

    def _note(self, text: str) -> None:
        self.stats.skipped += 1
        self.notes.append(text)

    def event(self, kind: str, pod: Mapping[str, Any]) -> list[Decision]:
        """One watch event (``ADDED``, ``MODIFIED``, ``DELETED``; others, e.g. ``BOOKMARK``: nothing)."""
        key = pod_key(pod)
        if key is None or kind not in ("ADDED", "MODIFIED", "DELETED"):
            return []
        self.stats.events += 1
        offers = dict(self.offers)
        now = () if kind == "DELETED" else self.targets(pod)
        if now:
            offers[key] = now
        else:
            offers.pop(key, None)
        return self._move_to(offers, key)

    def resync(self, pods: Iterable[Mapping[str, Any]]) -> list[Decision]:
        """A full listing: pods not in it are gone."""
        self.stats.resyncs += 1
        offers: dict[str, tuple[Target, ...]] = {}
        for pod in pods:
            key = pod_key(pod)
            if key is not None:
                ts = self.targets(pod)
                if ts:
                    offers[key] = ts
        return self._move_to(offers, "(list)")

    def _move_to(self, offers: dict[str, tuple[Target, ...]], cause: str) -> list[Decision]:
        desired: dict[str, tuple[Target, str]] = {}
        for key in sorted(offers):
            for t in offers[key]:
                desired.setdefault(t.url, (t, key))
        out: list[Decision] = []
        for url, t in list(self.active.items()):
            want = desired.get(url)
            if want is None or want[0] != t:
                out.append(Decision("remove", t, want[1] if want else cause))
                del self.active[url]
        for url, (t, key) in desired.items():
            if url not in self.active:
                out.append(Decision("add", t, key))
                self.active[url] = t
        self.offers = offers
        return out
