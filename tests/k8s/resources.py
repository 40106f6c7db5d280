"""What the emulator serves: built-in resource types, and the types a CRD declares."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


@dataclass(frozen=True)
class ScaleSpec:
    """JSONPaths of a ``scale`` subresource (as in a CRD's ``subresources.scale``)."""

    spec_replicas: str = ".spec.replicas"
    status_replicas: str = ".status.replicas"
    label_selector: str | None = None  # a path to a string selector, or None
    selector_from_spec: bool = False  # apps/v1: the structured .spec.selector


@dataclass(frozen=True)
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    singular: str = ""
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    status: bool = False  # has a status subresource
    scale: ScaleSpec | None = None
    log: bool = False  # pods/log
    schema: dict[str, Any] | None = field(default=None, compare=False, hash=False)
    printer_columns: tuple[dict[str, Any], ...] = field(default=(), compare=False, hash=False)
    custom: bool = False  # served because of a CRD

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def storage_key(self) -> str:
        """Identity of the stored objects, shared by all served versions of one resource."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def tracks_generation(self) -> bool:
        """Whether objects carry metadata.generation (custom resources and workload kinds do;
        e.g. ConfigMaps, Secrets, Events, Leases, RBAC objects and Namespaces do not)."""
        return (
            self.custom
            or self.group in ("apps", "batch", "policy", "apiextensions.k8s.io")
            or (self.storage_key in ("pods", "services"))
        )

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"

    @property
    def singular_name(self) -> str:
        return self.singular or self.kind.lower()

    def discovery(self) -> list[dict[str, Any]]:
        """APIResource entries for ``/api/v1`` or ``/apis/<group>/<version>``."""
        entries = [
            {
                "name": self.plural,
                "singularName": self.singular_name,
                "namespaced": self.namespaced,
                "kind": self.kind,
                "verbs": list(ALL_VERBS),
                **({"shortNames": list(self.short_names)} if self.short_names else {}),
                **({"categories": list(self.categories)} if self.categories else {}),
            }
        ]
        if self.status:
            entries.append(self._sub("status", self.kind, ("get", "patch", "update")))
        if self.scale is not None:
            entries.append(
                {
                    **self._sub("scale", "Scale", ("get", "patch", "update")),
                    "group": "autoscaling",
                    "version": "v1",
                }
            )
        if self.log:
            entries.append(self._sub("log", "Pod", ("get",)))
        return entries

    def _sub(self, name: str, kind: str, verbs: tuple[str, ...]) -> dict[str, Any]:
        return {
            "name": f"{self.plural}/{name}",
            "singularName": "",
            "namespaced": self.namespaced,
            "kind": kind,
            "verbs": list(verbs),
        }


def _core(plural: str, kind: str, namespaced: bool = True, **kw: Any) -> ResourceType:
    return ResourceType("", "v1", plural, kind, namespaced, **kw)


_DEPLOYMENT_SCALE = ScaleSpec(selector_from_spec=True)

BUILTIN_TYPES: tuple[ResourceType, ...] = (
    _core("namespaces", "Namespace", False, short_names=("ns",), status=True),
    _core("nodes", "Node", False, short_names=("no",), status=True),
    _core("pods", "Pod", short_names=("po",), categories=("all",), status=True, log=True),
    _core("services", "Service", short_names=("svc",), categories=("all",), status=True),
    _core("endpoints", "Endpoints", short_names=("ep",)),
    _core("events", "Event", short_names=("ev",)),
    _core("configmaps", "ConfigMap", short_names=("cm",)),
    _core("secrets", "Secret"),
    _core("serviceaccounts", "ServiceAccount", short_names=("sa",)),
    _core("persistentvolumeclaims", "PersistentVolumeClaim", short_names=("pvc",), status=True),
    ResourceType("events.k8s.io", "v1", "events", "Event", True, short_names=("ev",)),
    ResourceType("coordination.k8s.io", "v1", "leases", "Lease", True),
    ResourceType(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        False,
        short_names=("crd", "crds"),
        categories=("api-extensions",),
        status=True,
    ),
    ResourceType(
        "apps",
        "v1",
        "deployments",
        "Deployment",
        True,
        short_names=("deploy",),
        categories=("all",),
        status=True,
        scale=_DEPLOYMENT_SCALE,
    ),
    ResourceType(
        "apps",
        "v1",
        "statefulsets",
        "StatefulSet",
        True,
        short_names=("sts",),
        categories=("all",),
        status=True,
        scale=_DEPLOYMENT_SCALE,
    ),
    ResourceType("batch", "v1", "jobs", "Job", True, categories=("all",), status=True),
    ResourceType(
        "policy",
        "v1",
        "poddisruptionbudgets",
        "PodDisruptionBudget",
        True,
        short_names=("pdb",),
        status=True,
    ),
    ResourceType("rbac.authorization.k8s.io", "v1", "roles", "Role", True),
    ResourceType("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding", True),
    ResourceType("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", False),
    ResourceType(
        "rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", False
    ),
)


def types_from_crd(crd: dict[str, Any]) -> list[ResourceType]:
    """One ResourceType per served version of an apiextensions.k8s.io/v1 CRD."""
    spec = crd["spec"]
    names = spec["names"]
    result = []
    for version in spec["versions"]:
        if not version.get("served", True):
            continue
        subresources = version.get("subresources") or {}
        scale = subresources.get("scale")
        result.append(
            ResourceType(
                group=spec["group"],
                version=version["name"],
                plural=names["plural"],
                kind=names["kind"],
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                singular=names.get("singular") or names["kind"].lower(),
                short_names=tuple(names.get("shortNames") or ()),
                categories=tuple(names.get("categories") or ()),
                status="status" in subresources,
                scale=None
                if scale is None
                else ScaleSpec(
                    spec_replicas=scale["specReplicasPath"],
                    status_replicas=scale["statusReplicasPath"],
                    label_selector=scale.get("labelSelectorPath"),
                ),
                schema=(version.get("schema") or {}).get("openAPIV3Schema"),
                printer_columns=tuple(version.get("additionalPrinterColumns") or ()),
                custom=True,
            )
        )
    return result


def version_priority(version: str) -> tuple[int, int, int]:
    """Kubernetes' version ordering: GA > beta > alpha, then by number (higher first)."""
    match = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", version)
    if not match:
        return (0, 0, 0)
    major, stage, minor = match.groups()
    rank = {"alpha": 1, "beta": 2, None: 3}[stage]
    return (rank, int(major), int(minor or 0))
