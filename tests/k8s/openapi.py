"""OpenAPI v3 documents (``/openapi/v3`` and ``/openapi/v3/<api path>``), as kubectl reads them.

kubectl asks each group-version's document whether PATCH accepts ``fieldValidation``; when
it does, it leaves validation to the server (it sends ``fieldValidation=Strict``), so no
client-side OpenAPI v2 (a protobuf document) is needed. Custom resources carry their CRD's
schema, so ``kubectl explain`` works for them; built-in kinds carry no schema, so kubectl
falls back to its compiled-in types for strategic merge patches.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .resources import ResourceType
from .store import Store

Obj = dict[str, Any]


def api_path(group: str, version: str) -> str:
    return f"api/{version}" if not group else f"apis/{group}/{version}"


def index(store: Store) -> Obj:
    paths: Obj = {}
    gvs = {("", "v1")} | {(g, v) for g, vs in store.groups().items() for v in vs}
    for group, version in sorted(gvs):
        path = api_path(group, version)
        digest = hashlib.sha256(
            json.dumps(document(store, group, version), sort_keys=True).encode()
        ).hexdigest()[:32]
        paths[path] = {"serverRelativeURL": f"/openapi/v3/{path}?hash={digest.upper()}"}
    return {"paths": paths}


def schema_name(rt: ResourceType) -> str:
    if rt.custom:
        reversed_group = ".".join(reversed(rt.group.split(".")))
        return f"{reversed_group}.{rt.version}.{rt.kind}"
    group = rt.group.split(".")[0] if rt.group else "core"
    return f"io.k8s.api.{group}.{rt.version}.{rt.kind}"


def _param(name: str, where: str = "query", kind: str = "string") -> Obj:
    param: Obj = {"name": name, "in": where, "schema": {"type": kind, "uniqueItems": True}}
    if where == "path":
        param["required"] = True
    return param


def _operation(rt: ResourceType, action: str, params: list[Obj], body: Obj | None) -> Obj:
    op: Obj = {
        "operationId": f"{action}{rt.kind}",
        "parameters": params,
        "responses": {
            "200": {
                "description": "OK",
                "content": {"application/json": {"schema": body or {"type": "object"}}},
            }
        },
        "x-kubernetes-action": action,
        "x-kubernetes-group-version-kind": {
            "group": rt.group,
            "version": rt.version,
            "kind": rt.kind,
        },
    }
    if action in ("post", "put", "patch"):
        media = (
            ["application/json"]
            if action != "patch"
            else [
                "application/json-patch+json",
                "application/merge-patch+json",
                "application/apply-patch+yaml",
                *([] if rt.custom else ["application/strategic-merge-patch+json"]),
            ]
        )
        op["requestBody"] = {"content": {m: {"schema": body or {"type": "object"}} for m in media}}
    return op


def _write_params() -> list[Obj]:
    return [_param("dryRun"), _param("fieldManager"), _param("fieldValidation")]


def document(store: Store, group: str, version: str) -> Obj:
    prefix = "/" + api_path(group, version)
    paths: Obj = {}
    schemas: Obj = {}
    for rt in store.types_in(group, version):
        ref: Obj | None = None
        if rt.custom and rt.schema is not None:
            name = schema_name(rt)
            schemas[name] = _cr_schema(rt)
            ref = {"$ref": f"#/components/schemas/{name}"}
        base = (
            f"{prefix}/namespaces/{{namespace}}/{rt.plural}"
            if rt.namespaced
            else f"{prefix}/{rt.plural}"
        )
        scope = [_param("namespace", "path")] if rt.namespaced else []
        paths[base] = {
            "parameters": scope,
            "get": _operation(
                rt,
                "list",
                [_param("labelSelector"), _param("fieldSelector"), _param("watch", kind="boolean")],
                None,
            ),
            "post": _operation(rt, "post", _write_params(), ref),
            "delete": _operation(rt, "deletecollection", [], None),
        }
        item_params = [*scope, _param("name", "path")]
        paths[f"{base}/{{name}}"] = {
            "parameters": item_params,
            "get": _operation(rt, "get", [], ref),
            "put": _operation(rt, "put", _write_params(), ref),
            "patch": _operation(
                rt, "patch", [*_write_params(), _param("force", kind="boolean")], ref
            ),
            "delete": _operation(
                rt, "delete", [_param("dryRun"), _param("propagationPolicy")], None
            ),
        }
        for sub in ("status", "scale") if rt.custom else ():
            if (sub == "status" and rt.status) or (sub == "scale" and rt.scale is not None):
                paths[f"{base}/{{name}}/{sub}"] = {
                    "parameters": item_params,
                    "get": {
                        "operationId": f"read{rt.kind}{sub.title()}",
                        "responses": {"200": {"description": "OK"}},
                    },
                }
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes (kelastic test emulator)", "version": "v1.36.0"},
        "paths": paths,
        "components": {"schemas": schemas},
    }


def _cr_schema(rt: ResourceType) -> Obj:
    assert rt.schema is not None
    schema: Obj = json.loads(json.dumps(rt.schema))
    props = schema.setdefault("properties", {})
    props.setdefault("apiVersion", {"type": "string", "description": "APIVersion of the object."})
    props.setdefault("kind", {"type": "string", "description": "Kind of the object."})
    props["metadata"] = {"type": "object", "description": "Standard object's metadata."}
    schema["x-kubernetes-group-version-kind"] = [
        {"group": rt.group, "version": rt.version, "kind": rt.kind}
    ]
    return schema
