"""``Table`` responses (``Accept: application/json;as=Table;g=meta.k8s.io;v=v1``), which is
what ``kubectl get`` prints: a CRD's additionalPrinterColumns, or a few built-in columns."""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from typing import Any

from . import jsonpath
from .resources import ResourceType

Obj = dict[str, Any]


def _col(name: str, kind: str = "string", description: str = "", fmt: str = "") -> Obj:
    """A TableColumnDefinition."""
    return {"name": name, "type": kind, "format": fmt, "description": description, "priority": 0}


_NAME = _col("Name", description="Name must be unique within a namespace.", fmt="name")
_AGE = _col("Age", "date", "CreationTimestamp is the server time when this object was created.")


def human_duration(seconds: float) -> str:
    """Kubernetes' short duration format (``45s``, ``5m10s``, ``3h``, ``2d``)."""
    s = int(max(seconds, 0))
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m{s % 60}s" if s % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = minutes // 60
    if hours < 48:
        return f"{hours}h"
    return f"{hours // 24}d"


def age(timestamp: Any) -> str:
    if not isinstance(timestamp, str):
        return "<unknown>"
    then = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(
        tzinfo=datetime.timezone.utc
    )
    return human_duration((datetime.datetime.now(datetime.timezone.utc) - then).total_seconds())


def _pod_ready(pod: Obj) -> str:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    total = len((pod.get("spec") or {}).get("containers") or [])
    return f"{sum(1 for s in statuses if s.get('ready'))}/{total}"


def _pod_restarts(pod: Obj) -> int:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return sum(int(s.get("restartCount", 0)) for s in statuses)


Column = tuple[Obj, Callable[[Obj], Any]]


def _phase(obj: Obj) -> str:
    return str((obj.get("status") or {}).get("phase", ""))


_BUILTIN_COLUMNS: dict[str, list[Column]] = {
    "pods": [
        (_col("Ready"), _pod_ready),
        (_col("Status"), _phase),
        (_col("Restarts", "integer"), _pod_restarts),
    ],
    "namespaces": [(_col("Status"), _phase)],
}


def _columns(rt: ResourceType) -> list[Column]:
    def cell(column: Obj) -> Callable[[Obj], Any]:
        path = column["jsonPath"]
        if column.get("type") == "date":
            return lambda obj: age(jsonpath.get(obj, path))
        return lambda obj: _plain(jsonpath.get(obj, path))

    columns: list[Column] = [(_NAME, lambda o: o["metadata"]["name"])]
    if rt.printer_columns:
        for column in rt.printer_columns:
            definition = _col(
                column["name"],
                column.get("type", "string"),
                column.get("description", ""),
                column.get("format", ""),
            )
            definition["priority"] = column.get("priority", 0)
            columns.append((definition, cell(column)))
        return columns
    columns.extend(_BUILTIN_COLUMNS.get(rt.storage_key, []))
    columns.append((_AGE, lambda o: age(o["metadata"].get("creationTimestamp"))))
    return columns


def _plain(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return value


def _row_object(obj: Obj, include: str) -> Obj | None:
    if include == "None":
        return None
    if include == "Object":
        return obj
    return {
        "kind": "PartialObjectMetadata",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": obj["metadata"],
    }


def table(
    rt: ResourceType,
    objs: list[Obj],
    resource_version: str,
    include_object: str = "Metadata",
    with_columns: bool = True,
) -> Obj:
    columns = _columns(rt)
    result: Obj = {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "rows": [
            {
                "cells": [fn(obj) for _, fn in columns],
                "object": _row_object(obj, include_object),
            }
            for obj in objs
        ],
    }
    if with_columns:
        result["columnDefinitions"] = [definition for definition, _ in columns]
    return result
