"""Turning reconcile's results into API bodies: the status merge patch and Events."""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Any

from .model import API_GROUP, API_VERSION, KIND, ElasticJobStatus
from .reconcile import Event, format_time

#: ``source.component`` / ``reportingComponent`` of the operator's Events.
COMPONENT = "kelastic-operator"


def status_patch(old: ElasticJobStatus, new: ElasticJobStatus) -> dict[str, Any]:
    """A JSON merge patch (``{"status": {...}}``) taking ``old`` to ``new``.

    Fields ``new`` no longer has are set to null (merge patch deletes them), in nested
    objects too (a merge patch merges an object key by key: ``lastCheckpoint`` without a
    ``step`` would otherwise keep the old one); lists (the conditions) are sent whole.
    ``kopf``'s own field is never touched.
    """
    return {"status": _merge_diff(old.as_patch(), new.as_patch())}


def _merge_diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The RFC 7386 merge patch taking object ``before`` to ``after``."""
    body: dict[str, Any] = {}
    for key, value in after.items():
        was = before.get(key)
        if was == value:
            continue
        both = isinstance(was, dict) and isinstance(value, dict)
        body[key] = _merge_diff(was, value) if both else value  # type: ignore[arg-type]
    for key in before:
        if key not in after:
            body[key] = None
    return body


def event_name(event: Event, name: str, uid: str) -> str:
    """``<job>.<16 hex>``: one name per job incarnation, event type and reason."""
    digest = hashlib.sha256(f"{uid}/{event.type}/{event.reason}".encode()).hexdigest()[:16]
    return f"{name}.{digest}"


def event_body(
    event: Event, name: str, namespace: str, uid: str, now: datetime, instance: str = ""
) -> dict[str, Any]:
    """A core/v1 Event about the ElasticJob ``namespace/name``, named after the job's UID,
    the event's type and reason: a repeat (a restart storm) is the same object, whose
    ``count`` and ``lastTimestamp`` the operator updates (Kubernetes' event aggregation)
    instead of a new Event each time.

    Args:
        event: what happened (type, reason, message).
        name, namespace, uid: the job.
        now: the event time.
        instance: ``reportingInstance`` (the operator Pod's name), optional.
    """
    stamp = format_time(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": event_name(event, name, uid), "namespace": namespace},
        "involvedObject": {
            "apiVersion": f"{API_GROUP}/{API_VERSION}",
            "kind": KIND,
            "name": name,
            "namespace": namespace,
            "uid": uid,
        },
        "type": event.type,
        "reason": event.reason,
        "message": event.message[:1024],
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": instance or COMPONENT,
    }
