"""The ElasticJob CustomResourceDefinition, generated from :mod:`kelastic_operator.model`.

The pydantic models are the single source of truth: :func:`crd` turns their JSON Schema
into a Kubernetes *structural* OpenAPI v3 schema (references inlined, ``Optional``
unwrapped, ``exclusiveMinimum`` in the OpenAPI 3.0 form, free-form objects marked
``x-kubernetes-preserve-unknown-fields``) and adds names, subresources and printer
columns. ``deploy/crds/elasticjobs.kelastic.dev.yaml`` is this function's output:

    python -m kelastic_operator.crd > deploy/crds/elasticjobs.kelastic.dev.yaml

and a test fails when the file and the models drift apart.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml
from pydantic import BaseModel

from . import model

PLURAL = "elasticjobs"
SINGULAR = "elasticjob"
SHORT_NAMES = ["ej"]
CRD_NAME = f"{PLURAL}.{model.API_GROUP}"
#: Path of the generated file, relative to the repository root.
CRD_FILE = f"deploy/crds/{CRD_NAME}.yaml"

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "World Size", "type": "integer", "jsonPath": ".status.worldSize"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restartsSpent"},
    {
        "name": "In-Process",
        "type": "integer",
        "priority": 1,
        "description": "in-process restarts spent (kubectl get -o wide)",
        "jsonPath": ".status.inProcessRestarts",
    },
    {
        "name": "Reason",
        "type": "string",
        "description": "why the job failed (the Failed condition's reason)",
        "jsonPath": '.status.conditions[?(@.type=="Failed")].reason',
    },
    {
        "name": "Message",
        "type": "string",
        "priority": 1,
        "description": "the root cause of the failure (kubectl get -o wide)",
        "jsonPath": '.status.conditions[?(@.type=="Failed")].message',
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

# JSON Schema keywords a structural schema may keep (others, like ``title``, are dropped).
_KEEP = {
    "type",
    "format",
    "description",
    "default",
    "enum",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "required",
    "nullable",
}


def structural(schema: dict[str, Any], defs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Convert one pydantic JSON Schema node into a Kubernetes structural schema node.

    Args:
        schema: a node of ``Model.model_json_schema(by_alias=True)``.
        defs: the document's ``$defs`` (references are inlined from it).

    Returns:
        A new dict; ``schema`` is not modified.

    Raises:
        ValueError: a construct a structural schema cannot express (a union of two
            non-null types, an unknown reference).
    """
    defs = defs if defs is not None else schema.get("$defs", {})
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        if name not in defs:
            raise ValueError(f"unknown schema reference {schema['$ref']!r}")
        merged = {**defs[name], **{k: v for k, v in schema.items() if k != "$ref"}}
        return structural(merged, defs)
    if "anyOf" in schema:
        options = [o for o in schema["anyOf"] if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"cannot express a union in a structural schema: {schema}")
        rest = {k: v for k, v in schema.items() if k != "anyOf"}
        if rest.get("default", 0) is None:
            del rest["default"]
        return structural({**options[0], **rest}, defs)
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _KEEP or key.startswith("x-kubernetes-"):
            out[key] = value
    if "description" in out:
        out["description"] = " ".join(str(out["description"]).split())
    if isinstance(out.get("exclusiveMinimum"), (int, float)) and not isinstance(
        out["exclusiveMinimum"], bool
    ):
        out["minimum"], out["exclusiveMinimum"] = out["exclusiveMinimum"], True
    if isinstance(out.get("exclusiveMaximum"), (int, float)) and not isinstance(
        out["exclusiveMaximum"], bool
    ):
        out["maximum"], out["exclusiveMaximum"] = out["exclusiveMaximum"], True
    if "const" in schema:
        out["enum"] = [schema["const"]]
    if "properties" in schema:
        out["type"] = "object"
        out["properties"] = {k: structural(v, defs) for k, v in schema["properties"].items()}
    if "items" in schema:
        out["items"] = structural(schema["items"], defs)
    free_form = schema.get("additionalProperties") is True or (
        out.get("type") == "object" and "properties" not in schema
    )
    if free_form:
        out["type"] = "object"
        out["x-kubernetes-preserve-unknown-fields"] = True
    elif isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = structural(schema["additionalProperties"], defs)
    return out


def model_schema(cls: type[BaseModel]) -> dict[str, Any]:
    """The structural schema of a pydantic model (by alias), see :func:`structural`."""
    return structural(cls.model_json_schema(by_alias=True))


def openapi_schema() -> dict[str, Any]:
    """The ``openAPIV3Schema`` of ElasticJob: apiVersion, kind, metadata, spec, status."""
    return {
        "type": "object",
        "description": "An elastic, fault-tolerant PyTorch training job (kelastic).",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {
                "type": "object",
                "properties": {
                    "name": {
                        "type": "string",
                        "maxLength": model.MAX_NAME_LENGTH,
                        "pattern": model.NAME_PATTERN,
                    }
                },
            },
            "spec": model_schema(model.ElasticJobSpec),
            "status": model_schema(model.ElasticJobStatus),
        },
    }


def crd() -> dict[str, Any]:
    """The ``elasticjobs.kelastic.dev`` CustomResourceDefinition (apiextensions.k8s.io/v1).

    Version ``v1alpha1``, kind ``ElasticJob``, short name ``ej``, category ``all``;
    ``status`` and ``scale`` subresources (``kubectl scale ej/x --replicas=N``, HPA);
    printer columns :data:`PRINTER_COLUMNS`.
    """
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": model.API_GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": model.KIND,
                "listKind": f"{model.KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["all", "kelastic"],
            },
            "versions": [
                {
                    "name": model.API_VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": [dict(c) for c in PRINTER_COLUMNS],
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }


HEADER = (
    "# GENERATED from kelastic_operator.model by `python -m kelastic_operator.crd`.\n"
    "# Do not edit by hand: change the model and regenerate (a test checks they agree).\n"
)


def render() -> str:
    """The CRD as the YAML text of :data:`CRD_FILE` (header comment included)."""
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=100)


def main() -> int:
    """Print the CRD YAML to stdout; returns the exit status (0)."""
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
