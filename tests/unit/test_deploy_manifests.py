"""deploy/: the Kustomize base and its examples, rendered (tests/kustomize_lite.py) and validated offline.

Every object of every example is checked against the Kubernetes schemas of ``kubernetes-validate``
(strict: an unknown field fails); the ServiceMonitor (a Prometheus Operator CRD the package does not
carry) against the structure of ``monitoring.coreos.com/v1`` it uses (prometheus-operator's
``ServiceMonitor`` spec: selector, endpoints with port / path / scheme / interval / scrapeTimeout /
authorization). The node's command line is parsed by the node's own CLI and config builder
(``shepherd.node.cli.config_from_args``, the ConfigMap's node.yaml as ``--config``), so a flag or config
key that does not exist, or a combination the node refuses, fails here; the probes name routes the node
serves; Services, the PodDisruptionBudget and the ServiceMonitor select what they mean to."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from shepherd.node.api.admin import routes
from shepherd.node.cli import config_from_args
from shepherd.node.config import NodeConfig
from tests.kustomize_lite import build, containers

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
EXAMPLES = sorted(p.name for p in (DEPLOY / "examples").iterdir() if (p / "kustomization.yaml").exists())
K8S_VERSION = kubernetes_validate.latest_version()

SERVICE_MONITOR = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
            "additionalProperties": False,
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}
                    },
                },
                "namespaceSelector": {"type": "object"},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["port"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "authorization": {
                                "type": "object",
                                "additionalProperties": False,
                                "required": ["credentials"],
                                "properties": {
                                    "type": {"type": "string"},
                                    "credentials": {
                                        "type": "object",
                                        "required": ["name", "key"],
                                        "additionalProperties": False,
                                        "properties": {"name": {"type": "string"}, "key": {"type": "string"}},
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    (o,) = [o for o in by_kind(objs, kind) if name is None or o["metadata"]["name"] == name]
    return o


def render(example: str) -> list[dict[str, Any]]:
    return build(DEPLOY / "examples" / example)


@pytest.mark.parametrize("example", EXAMPLES)
def test_every_object_is_valid_against_the_schemas(example: str) -> None:
    objs = render(example)
    kinds = {o["kind"] for o in objs}
    assert {"StatefulSet", "Service", "PodDisruptionBudget", "ServiceMonitor", "ConfigMap"} <= kinds
    for o in objs:
        if o["apiVersion"].startswith("monitoring.coreos.com/"):
            jsonschema.validate(o, SERVICE_MONITOR)
        else:
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)
        assert o["metadata"]["namespace"] == "inference"
        assert o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "shepherd"


def test_the_examples_are_the_three_the_readme_names() -> None:
    assert EXAMPLES == ["discovery", "mesh-3", "postgres-history"]


def test_a_broken_object_fails_validation() -> None:
    """The validation is not vacuous: a wrong type and an unknown field are caught."""
    sts = one(render("mesh-3"), "StatefulSet")
    sts["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, K8S_VERSION, strict=True)
    sm = one(render("mesh-3"), "ServiceMonitor")
    sm["spec"]["endpoints"][0]["portt"] = "admin"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(sm, SERVICE_MONITOR)


def node_config(objs: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> NodeConfig:
    """The node's container command line as the node reads it: ``$(VAR)`` expanded as the kubelet does
    (from the container's env: the downward API's fields and secrets get stand-in values), mounted
    ConfigMap files written to tmp_path, then ``config_from_args``."""
    sts = one(objs, "StatefulSet")
    (c,) = containers(sts)
    assert c["command"] == ["smg-node"] and c["args"][0] == "serve"
    env: dict[str, str] = {}
    for e in c.get("env", []):
        src = e.get("valueFrom", {})
        if "fieldRef" in src:
            path = src["fieldRef"]["fieldPath"]
            env[e["name"]] = {"metadata.name": "shepherd-0", "status.podIP": "10.1.2.3"}[path]
        elif "secretKeyRef" in src:
            key = src["secretKeyRef"]["key"]
            env[e["name"]] = (
                "postgresql://shepherd:pw@pg.inference.svc:5432/shepherd" if key == "url" else "sk-x"
            )
        else:
            env[e["name"]] = e["value"]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    # files of mounted ConfigMaps: their mount path -> a copy under tmp_path
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    mounts: dict[str, Path] = {}
    for m in c["volumeMounts"]:
        vol = volumes[m["name"]]
        if "configMap" in vol:
            cm = one(objs, "ConfigMap", vol["configMap"]["name"])
            d = tmp_path / m["name"]
            d.mkdir()
            for key, text in cm["data"].items():
                (d / key).write_text(text)
            mounts[m["mountPath"]] = d

    def expand(arg: str) -> str:
        def var(match: re.Match[str]) -> str:
            assert match.group(1) in env, f"{arg}: $({match.group(1)}) is not in the container's env"
            return env[match.group(1)]

        arg = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", var, arg)
        for mount, local in mounts.items():
            arg = arg.replace(mount + "/", f"{local}/")
        return arg

    cfg: NodeConfig = config_from_args([expand(a) for a in c["args"]])
    return cfg


@pytest.mark.parametrize("example", EXAMPLES)
def test_the_node_accepts_its_command_line_and_config(
    example: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objs = render(example)
    cfg = node_config(objs, tmp_path, monkeypatch)
    assert (cfg.host, cfg.port, cfg.admin_port, cfg.mesh_port) == ("0.0.0.0", 30000, 30001, 39527)
    assert cfg.mesh_name == "shepherd-0" and cfg.mesh_advertise == "10.1.2.3:39527"
    assert cfg.auth.control_plane == "api_key"
    sts = one(objs, "StatefulSet")
    replicas = sts["spec"]["replicas"]
    # the seeds are the StatefulSet's pods under the headless service, on the mesh port
    svc = sts["spec"]["serviceName"]
    assert set(cfg.mesh_seeds) == {f"shepherd-{i}.{svc}:{cfg.mesh_port}" for i in range(replicas)}
    # the grace the pod gets covers the preStop sleep (endpoints drop the pod meanwhile) and the node's drain
    (c,) = containers(sts)
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop >= 5
    grace = sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= pre_stop + cfg.shutdown_grace_secs + 2 + 5 + 5  # (ending what is left, listeners)
    if example == "mesh-3":
        assert replicas == 3 and len(cfg.worker_urls) == 2
    if example == "postgres-history":
        assert cfg.history_backend == "postgres" and cfg.history_url is not None
        assert cfg.history_url.startswith("postgresql://")
    if example == "discovery":
        assert cfg.service_discovery and cfg.selector == ("app=sglang",)
        assert cfg.service_discovery_protocol == "grpc" and not cfg.worker_urls


def test_a_misspelt_flag_in_the_manifest_would_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    objs = render("mesh-3")
    (c,) = containers(one(objs, "StatefulSet"))
    c["args"].append("--mesh-seedz=x")
    with pytest.raises(SystemExit):
        node_config(objs, tmp_path, monkeypatch)


@pytest.mark.parametrize("example", EXAMPLES)
def test_probes_services_and_selectors_fit_together(example: str) -> None:
    objs = render(example)
    sts = one(objs, "StatefulSet")
    pod = sts["spec"]["template"]
    labels = pod["metadata"]["labels"]
    (c,) = containers(sts)
    ports = {p["name"]: p for p in c["ports"]}
    served = {r.path for r in routes() if r.method == "GET"}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] in served and get["port"] == "http"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # resources from the measured memory (README: 340 MB PSS for the node and its tokenizer workers)
    res = c["resources"]
    assert (
        res["requests"]["memory"] == "512Mi" and res["limits"]["memory"] == "1Gi" and "cpu" in res["requests"]
    )
    services = {s["metadata"]["name"]: s for s in by_kind(objs, "Service")}
    headless = services[sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert {(p["targetPort"], p["protocol"]) for p in headless["spec"]["ports"]} >= {
        ("mesh-udp", "UDP"),
        ("mesh-tcp", "TCP"),
    }
    client = services["shepherd"]
    assert client["spec"].get("clusterIP") != "None"
    for s in services.values():
        assert s["spec"]["selector"].items() <= labels.items()
        for p in s["spec"]["ports"]:
            assert p["targetPort"] in ports and ports[p["targetPort"]]["protocol"] == p["protocol"]
    assert [p["targetPort"] for p in client["spec"]["ports"]] == ["http"]
    pdb = one(objs, "PodDisruptionBudget")
    assert (
        pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
        and pdb["spec"]["maxUnavailable"] == 1
    )
    sm = one(objs, "ServiceMonitor")
    scraped = [
        s
        for s in services.values()
        if sm["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
    ]
    assert scraped == [headless]
    (ep,) = sm["spec"]["endpoints"]
    assert ep["path"] == "/metrics" and "/metrics" in served
    assert ep["port"] in {p["name"] for p in headless["spec"]["ports"]}
    assert (
        ports[next(p["targetPort"] for p in headless["spec"]["ports"] if p["name"] == ep["port"])][
            "containerPort"
        ]
        == 30001
    )
    admin_secret = next(e["valueFrom"]["secretKeyRef"] for e in c["env"] if e["name"] == "SHEPHERD_ADMIN_KEY")
    assert ep["authorization"]["credentials"] == {"name": admin_secret["name"], "key": admin_secret["key"]}
    # the mesh keyring and certificates come from Secrets, read-only
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    for name in ("mesh-keyring", "mesh-tls"):
        assert "secret" in volumes[name]
        assert any(m["name"] == name and m["readOnly"] for m in c["volumeMounts"])


def test_rbac_is_what_discovery_needs_and_only_there() -> None:
    for example in EXAMPLES:
        objs = render(example)
        sa = one(objs, "ServiceAccount")
        sts = one(objs, "StatefulSet")
        assert sts["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
        assert not by_kind(objs, "ClusterRole") and not by_kind(objs, "ClusterRoleBinding")
        if example != "discovery":
            assert not by_kind(objs, "Role") and sa["automountServiceAccountToken"] is False
            continue
        assert sa["automountServiceAccountToken"] is True
        role = one(objs, "Role")
        assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
        rb = one(objs, "RoleBinding")
        assert rb["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": role["metadata"]["name"],
        }
        assert rb["subjects"] == [
            {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "inference"}
        ]


def test_the_base_alone_renders_and_validates() -> None:
    objs = build(DEPLOY / "base")
    for o in objs:
        if not o["apiVersion"].startswith("monitoring.coreos.com/"):
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)
    assert yaml.safe_load(one(objs, "ConfigMap")["data"]["node.yaml"])["model_id"] == "qwen3"
