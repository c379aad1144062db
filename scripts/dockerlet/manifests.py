"""The rendered objects, indexed by kind and name, and the file under k8s/ that defines each one."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from pathlib import Path

import yaml

# What the runner does with each kind; anything else in the rendered set is refused in one line.
KINDS = {
    "Namespace": "nothing to start",
    "ServiceAccount": "nothing to start (no API server: pods must not mount its token)",
    "ConfigMap": "files and environment of the pods that use it",
    "Secret": "files and environment of the pods that use it",
    "Service": "its name resolves to the pods it selects",
    "PersistentVolume": "nothing to start (the claim is a Docker volume)",
    "PersistentVolumeClaim": "one Docker volume shared by every pod that mounts it",
    "Deployment": "spec.replicas pods from spec.template",
    "NetworkPolicy": "not enforced (the pods' network has no route out)",
    "RayCluster": "its groups' pods, as the KubeRay operator builds them (kuberay.py)",
}


class ManifestError(Exception):
    """A manifest the runner cannot run as written: one line naming the file, the object and the field."""


def ref(obj: dict) -> str:
    return f"{obj.get('kind', '?')}/{obj.get('metadata', {}).get('name', '?')}"


@dataclass
class Objects:
    """The rendered set: `kubectl kustomize` output, plus the Secrets a user creates by hand."""

    items: list[dict]
    sources: dict[tuple[str, str], str] = field(default_factory=dict)
    """(kind, name) -> where it is defined, e.g. "k8s/deployment.ray-head.yaml"."""

    @classmethod
    def load(cls, text: str, k8s_dir: Path | None = None) -> Objects:
        items = [d for d in yaml.safe_load_all(text) if d]
        objects = cls(items)
        if k8s_dir is not None:
            objects.sources = sources(k8s_dir)
        for obj in items:
            if obj.get("kind") not in KINDS:
                raise ManifestError(
                    f"{objects.source(obj)} {ref(obj)}: kind {obj.get('kind')!r} is not "
                    f"one the runner starts or serves ({', '.join(KINDS)})"
                )
        return objects

    def add(self, obj: dict) -> None:
        self.items.append(obj)

    def of_kind(self, kind: str, namespace: str | None = None) -> list[dict]:
        return [
            o
            for o in self.items
            if o.get("kind") == kind and (namespace is None or namespace_of(o) == namespace)
        ]

    def get(self, kind: str, name: str, namespace: str) -> dict | None:
        return next((o for o in self.of_kind(kind, namespace) if o["metadata"].get("name") == name), None)

    def source(self, obj: dict) -> str:
        return self.sources.get((obj.get("kind", ""), obj.get("metadata", {}).get("name", "")), "(rendered)")

    def data(self, kind: str, name: str, namespace: str) -> dict[str, bytes] | None:
        """A ConfigMap's or Secret's keys as bytes (Secret data base64-decoded), None if there is none."""
        obj = self.get(kind, name, namespace)
        if obj is None:
            return None
        out: dict[str, bytes] = {}
        if kind == "Secret":
            out |= {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
            out |= {k: str(v).encode() for k, v in (obj.get("stringData") or {}).items()}
        else:
            out |= {k: str(v).encode() for k, v in (obj.get("data") or {}).items()}
            out |= {k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()}
        return out


def namespace_of(obj: dict) -> str:
    return obj.get("metadata", {}).get("namespace") or "default"


def sources(k8s_dir: Path) -> dict[tuple[str, str], str]:
    """Where each object is written: every YAML file under k8s/, and the names an overlay's patches give
    (the kind overlay renames ray-gpu-workers to ray-cpu-workers)."""
    found: dict[tuple[str, str], str] = {}
    root = k8s_dir.parent
    for path in sorted(k8s_dir.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        try:
            docs = [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
        except yaml.YAMLError:
            continue
        for d in docs:
            name = d.get("metadata", {}).get("name")
            if d.get("kind") and name:
                found.setdefault((d["kind"], name), str(path.relative_to(root)))
    for path in sorted(k8s_dir.rglob("kustomization.yaml")):
        for patch in (yaml.safe_load(path.read_text()) or {}).get("patches") or []:
            target = patch.get("target") or {}
            try:
                ops = yaml.safe_load(patch.get("patch") or "") or []
            except yaml.YAMLError:
                continue
            for op in ops if isinstance(ops, list) else []:
                key = (target.get("kind"), target.get("name"))
                if op.get("path") == "/metadata/name" and key in found:
                    found[(target["kind"], op["value"])] = (
                        f"{found[key]}, renamed {op['value']} by {path.parent.relative_to(root)}"
                    )
    return found
