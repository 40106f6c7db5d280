"""What the API server checks in a CustomResourceDefinition, and the status it reports."""

from __future__ import annotations

import copy
from typing import Any

from . import jsonpath, schema
from .errors import FieldError
from .resources import BUILTIN_TYPES

Obj = dict[str, Any]


def check(crd: Obj) -> list[FieldError]:
    """Problems with a CRD: names, scope, one storage version, schemas (and their CEL rules
    compiling), scale paths and printer-column JSONPaths."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    name = crd["metadata"].get("name", "")
    problems: list[FieldError] = []
    for path in ("group", "names.plural", "names.kind"):
        if not jsonpath.get(spec, "." + path):
            problems.append(FieldError(f"spec.{path}", "FieldValueRequired", ""))
    if not problems and name != f"{names['plural']}.{spec['group']}":
        detail = 'must be spec.names.plural+"."+spec.group'
        problems.append(FieldError("metadata.name", "FieldValueInvalid", detail, name))
    if spec.get("scope") not in ("Namespaced", "Cluster"):
        detail = 'supported values: "Cluster", "Namespaced"'
        problems.append(
            FieldError("spec.scope", "FieldValueNotSupported", detail, spec.get("scope"))
        )
    versions = spec.get("versions") or []
    if sum(1 for v in versions if v.get("storage")) != 1:
        detail = "must have exactly one version marked as storage version"
        problems.append(FieldError("spec.versions", "FieldValueInvalid", detail, versions))
    for n, version in enumerate(versions):
        problems.extend(_check_version(f"spec.versions[{n}]", version))
    builtin = {t.storage_key for t in BUILTIN_TYPES}
    if names.get("plural") and f"{names['plural']}.{spec.get('group')}" in builtin:
        group = spec.get("group")
        problems.append(FieldError("spec.group", "FieldValueInvalid", "is a built-in group", group))
    return problems


def _check_version(where: str, version: Obj) -> list[FieldError]:
    problems: list[FieldError] = []
    version_schema = (version.get("schema") or {}).get("openAPIV3Schema")
    schema_path = f"{where}.schema.openAPIV3Schema"
    if not isinstance(version_schema, dict):
        problems.append(FieldError(schema_path, "FieldValueRequired", "schemas are required"))
    else:
        problems.extend(schema.check_schema(version_schema, schema_path))
    scale = (version.get("subresources") or {}).get("scale") or {}
    for key, prefix in (("specReplicasPath", ".spec."), ("statusReplicasPath", ".status.")):
        if scale and not str(scale.get(key, "")).startswith(prefix):
            detail = f"should be a json path under {prefix.rstrip('.')}"
            field = f"{where}.subresources.scale.{key}"
            problems.append(FieldError(field, "FieldValueInvalid", detail, scale.get(key)))
    for m, column in enumerate(version.get("additionalPrinterColumns") or []):
        message = jsonpath.validate(column.get("jsonPath", ""))
        if message:
            field = f"{where}.additionalPrinterColumns[{m}].jsonPath"
            problems.append(FieldError(field, "FieldValueInvalid", message, column.get("jsonPath")))
    return problems


def status(crd: Obj, timestamp: str) -> Obj:
    """The status the real server settles on at once for a CRD without name conflicts."""
    spec = crd.get("spec") or {}

    def condition(kind: str, reason: str, message: str) -> Obj:
        return {
            "type": kind,
            "status": "True",
            "reason": reason,
            "message": message,
            "lastTransitionTime": timestamp,
        }

    return {
        "acceptedNames": copy.deepcopy(spec.get("names") or {}),
        "conditions": [
            condition("NamesAccepted", "NoConflicts", "no conflicts found"),
            condition(
                "Established", "InitialNamesAccepted", "the initial names have been accepted"
            ),
        ],
        "storedVersions": [v["name"] for v in spec.get("versions") or [] if v.get("storage")],
    }
