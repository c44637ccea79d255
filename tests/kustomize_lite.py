"""Render a Kustomize directory offline, for the manifest tests (tests/unit/test_deploy_manifests.py).

The subset of Kustomize that deploy/ uses, and nothing else (a field outside it is an error here, so a
manifest change that needs real Kustomize is noticed, not rendered wrong): ``resources`` (files and
directories with a kustomization.yaml), ``labels`` (``pairs`` added to every object's
``metadata.labels``; selectors and templates untouched, Kustomize's defaults), ``images`` (``newName`` /
``newTag`` of containers whose image is ``name``), ``patches`` with a ``target`` (kind, name) and an
inline JSON 6902 patch (add / replace / remove; ``-`` appends), and ``namespace`` (set on every object,
and on the ServiceAccount subjects of RoleBindings, as Kustomize's namespace transformer does). A patch
whose target matches nothing is an error (Kustomize would pass it silently).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED = {"apiVersion", "kind", "namespace", "resources", "patches", "images", "labels"}
POD_OWNERS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


class RenderError(ValueError):
    pass


def build(directory: Path) -> list[dict[str, Any]]:
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    if k.get("kind") != "Kustomization":
        raise RenderError(f"{directory}: not a Kustomization")
    unknown = set(k) - SUPPORTED
    if unknown:
        raise RenderError(f"{directory}: fields this renderer does not know: {sorted(unknown)}")
    objs: list[dict[str, Any]] = []
    for res in k.get("resources", []):
        path = (directory / res).resolve()
        if path.is_dir():
            objs += build(path)
        else:
            objs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in k.get("patches", []):
        _patch(objs, patch, directory)
    if "namespace" in k:
        ns = k["namespace"]
        for o in objs:
            o.setdefault("metadata", {})["namespace"] = ns
            if o["kind"] in ("RoleBinding", "ClusterRoleBinding"):
                for s in o.get("subjects", []):
                    if s.get("kind") == "ServiceAccount":
                        s["namespace"] = ns
    for label in k.get("labels", []):
        if set(label) - {"pairs"}:
            raise RenderError(f"{directory}: labels entries take 'pairs' only here")
        for o in objs:
            o.setdefault("metadata", {}).setdefault("labels", {}).update(label["pairs"])
    for image in k.get("images", []):
        for o in objs:
            for c in containers(o):
                name = c.get("image", "").split("@")[0].rsplit(":", 1)[0]
                if name == image["name"]:
                    c["image"] = f"{image.get('newName', name)}:{image.get('newTag', 'latest')}"
    return objs


def containers(o: dict[str, Any]) -> list[dict[str, Any]]:
    if o.get("kind") not in POD_OWNERS:
        return []
    spec = o["spec"]["template"]["spec"]
    return [*spec.get("containers", []), *spec.get("initContainers", [])]


def _patch(objs: list[dict[str, Any]], patch: dict[str, Any], where: Path) -> None:
    target = patch.get("target") or {}
    if set(target) - {"kind", "name"} or set(patch) - {"target", "patch"}:
        raise RenderError(f"{where}: patches need a target (kind, name) and an inline patch here")
    ops = yaml.safe_load(patch["patch"])
    if not isinstance(ops, list):
        raise RenderError(f"{where}: only JSON 6902 patches (a list of operations) here")
    hits = [
        o
        for o in objs
        if o.get("kind") == target.get("kind") and o.get("metadata", {}).get("name") == target.get("name")
    ]
    if not hits:
        raise RenderError(f"{where}: patch target {target} matches nothing")
    for o in hits:
        for op in ops:
            apply_op(o, op)


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise RenderError(f"JSON pointer {path!r} must start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def apply_op(doc: dict[str, Any], op: dict[str, Any]) -> None:
    """One JSON 6902 operation (add, replace, remove), in place."""
    parts = _pointer(op["path"])
    parent: Any = doc
    for p in parts[:-1]:
        parent = parent[int(p)] if isinstance(parent, list) else parent[p]
    last = parts[-1]
    kind = op["op"]
    value = copy.deepcopy(op.get("value"))
    if isinstance(parent, list):
        if kind == "add":
            if last == "-":
                parent.append(value)
            else:
                parent.insert(int(last), value)
        elif kind == "replace":
            parent[int(last)] = value
        elif kind == "remove":
            del parent[int(last)]
        else:
            raise RenderError(f"JSON patch op {kind!r} is not supported here")
        return
    if kind == "add":
        parent[last] = value
    elif kind == "replace":
        if last not in parent:
            raise RenderError(f"replace {op['path']}: nothing there")
        parent[last] = value
    elif kind == "remove":
        del parent[last]
    else:
        raise RenderError(f"JSON patch op {kind!r} is not supported here")
