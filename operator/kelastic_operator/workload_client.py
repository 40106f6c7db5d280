"""The operator's Kueue calls: a labelled job's Workload (read, create, give its quota
back, finish, release on the job's deletion), the admission's ResourceFlavors and the
job's WorkloadPriorityClass. Blocking calls of the official client; the decisions are
:mod:`~kelastic_operator.kueue`'s pure functions.

RBAC (``deploy/rbac.yaml``): ``workloads`` get/list/watch/create/patch/delete,
``workloads/status`` patch, ``resourceflavors`` and ``workloadpriorityclasses`` get.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, cast

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from .api_errors import api_message
from .kueue import (
    FLAVORS,
    GROUP,
    PRIORITY_CLASSES,
    PRIORITY_LABEL,
    RESOURCE_IN_USE,
    VERSION,
    WORKLOADS,
    Placement,
    QueueGate,
    WorkloadView,
    build_workload,
    cleared_reservation,
    finished,
    is_finished,
    needs_clearing,
    outdated,
    placement,
    quota_hash,
    reclaim,
    reclaim_patch,
    workload_name,
    workload_view,
)
from .model import TERMINAL_PHASES, ElasticJobSpec
from .pods import PodBuildError, PodSettings, build_pod
from .reconcile_views import Event, JobView, Plan, format_time

__all__ = [
    "PriorityClassMissing",
    "create_workload",
    "ensure_workload",
    "finish_workload",
    "flavor_placement",
    "kueue_served",
    "patch_workload_status",
    "pod_placement",
    "read_workload",
    "release_workload",
    "settle_workload",
]
log = logging.getLogger("kelastic_operator")


def kueue_served(api: client.ApiClient) -> bool:
    """Whether the API server serves Kueue's Workloads (``kueue.x-k8s.io/v1beta2``).

    Returns:
        False when the group/version is not served or cannot be read (any API error).
    """
    try:
        found = client.CustomObjectsApi(api).get_api_resources(GROUP, VERSION)
    except ApiException:
        return False
    return any(r.name == WORKLOADS for r in getattr(found, "resources", None) or [])


def read_workload(custom: client.CustomObjectsApi, namespace: str, job: str, uid: str
                  ) -> WorkloadView | None:  # fmt: skip
    """The job's Workload (:func:`~kelastic_operator.kueue.workload_name`); None when
    there is none, or when it belongs to an earlier job of that name.

    Raises:
        ApiException: the read failed other than with 404.
    """
    try:
        obj = custom.get_namespaced_custom_object(
            GROUP, VERSION, namespace, WORKLOADS, workload_name(job, uid)
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return workload_view(cast("dict[str, Any]", obj))


class PriorityClassMissing(LookupError):
    """The WorkloadPriorityClass a job's label names does not exist (the job waits, as
    Kueue's jobframework leaves such a job without a Workload)."""


def _priority(custom: client.CustomObjectsApi, labels: Mapping[str, str]) -> int | None:
    """The value of the WorkloadPriorityClass the job's label names (None: no label).

    Raises:
        PriorityClassMissing: no such class, or it has no integer ``value``.
        ApiException: the read failed other than with 404.
    """
    name = labels.get(PRIORITY_LABEL)
    if not name:
        return None
    try:
        found = cast("dict[str, Any]", custom.get_cluster_custom_object(
            GROUP, VERSION, PRIORITY_CLASSES, name))  # fmt: skip
    except ApiException as exc:
        if exc.status == 404:
            raise PriorityClassMissing(f"WorkloadPriorityClass {name} not found") from exc
        raise
    value = found.get("value")
    if not isinstance(value, int):
        raise PriorityClassMissing(f"WorkloadPriorityClass {name} has no integer value")
    return value


def create_workload(
    custom: client.CustomObjectsApi,
    job: str,
    namespace: str,
    uid: str,
    spec: ElasticJobSpec,
    labels: Mapping[str, str],
    pod: Mapping[str, Any],
) -> WorkloadView | None:
    """Create the job's Workload (:func:`~kelastic_operator.kueue.build_workload`).

    Returns:
        The created Workload; None when one of its name exists already (an earlier pass
        made it: the next pass reads it).

    Raises:
        PriorityClassMissing: the job's priority-class label names no WorkloadPriorityClass.
        ApiException: the create (or the priority class's read) failed other than with
            409; a 4xx carries Kueue's webhook's refusal.
    """
    body = build_workload(job, namespace, uid, spec, labels, pod, _priority(custom, labels))
    try:
        created = custom.create_namespaced_custom_object(GROUP, VERSION, namespace, WORKLOADS,
                                                         body)  # fmt: skip
    except ApiException as exc:
        if exc.status == 409:
            return None
        raise
    log.info("%s/%s: created Workload %s (queue %s)", namespace, job,
             body["metadata"]["name"], body["spec"]["queueName"])  # fmt: skip
    return workload_view(cast("dict[str, Any]", created))


def patch_workload_status(
    custom: client.CustomObjectsApi, namespace: str, name: str, patch: dict[str, Any]
) -> bool:
    """Merge-patch the Workload's status (``patch`` carries its resourceVersion: a
    Workload changed since it was read is left for the next pass).

    Returns:
        True when written; False on 404 or 409.

    Raises:
        ApiException: the patch failed otherwise.
    """
    try:
        custom.patch_namespaced_custom_object_status(  # merge patch (the default)
            GROUP, VERSION, namespace, WORKLOADS, name, patch
        )
    except ApiException as exc:
        if exc.status in (404, 409):
            return False
        raise
    return True


def finish_workload(
    custom: client.CustomObjectsApi, namespace: str, workload: WorkloadView, patch: dict[str, Any]
) -> bool:
    """Mark the finished job's Workload ``Finished`` (``patch``:
    :func:`~kelastic_operator.kueue.finished`), so Kueue gives its quota back.

    Returns:
        True when written (False: gone or changed since read).

    Raises:
        ApiException: the patch failed other than with 404/409.
    """
    return patch_workload_status(custom, namespace, workload.name, patch)


def pod_placement(
    custom: client.CustomObjectsApi,
    workload: WorkloadView | None,
    gate: QueueGate | None,
    plan: Plan,
) -> Placement | None:
    """Where the Pods a pass creates go under Kueue's admission (the flavors' node labels
    and tolerations, :func:`flavor_placement`); None when the pass creates none or the
    job is not admitted by Kueue (no API call then).

    Raises:
        ApiException: a flavor's read failed other than with 404.
    """
    if not plan.create or workload is None or gate is None or not gate.admitted:
        return None
    return flavor_placement(custom, workload.flavors)


def flavor_placement(custom: client.CustomObjectsApi, flavors: Sequence[str]) -> Placement:
    """The node labels and tolerations of the ResourceFlavors ``flavors``
    (:func:`~kelastic_operator.kueue.placement`); a flavor not found adds nothing.

    Raises:
        ApiException: a read failed other than with 404.
    """
    found = []
    for name in flavors:
        try:
            found.append(
                cast(
                    "dict[str, Any]",
                    custom.get_cluster_custom_object(GROUP, VERSION, FLAVORS, name),
                )
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
    return placement(found)


def release_workload(custom: client.CustomObjectsApi, namespace: str, job: str, uid: str
                     ) -> None:  # fmt: skip
    """On the job's deletion, once its Pods are gone: delete its Workload and lift Kueue's
    finalizer from it (Kueue lifts it only from Workloads no job owns).

    Raises:
        ApiException: a call failed other than with 404 (gone) or 409 (changed: the
            handler retries).
    """
    name = workload_name(job, uid)
    try:
        custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, WORKLOADS, name)
    except ApiException as exc:
        if exc.status != 404:
            raise
        return
    for attempt in range(3):  # Kueue writes the Workload too: a conflict is read again
        current = read_workload(custom, namespace, job, uid)
        if current is None or RESOURCE_IN_USE not in current.finalizers:
            return
        kept = [f for f in current.finalizers if f != RESOURCE_IN_USE]
        body = {"metadata": {"finalizers": kept or None,
                             "resourceVersion": current.resource_version}}  # fmt: skip
        try:
            custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, WORKLOADS, name,
                                                  body)  # fmt: skip
        except ApiException as exc:
            if exc.status == 404:
                return
            if exc.status != 409 or attempt == 2:
                raise
            continue
        log.info("%s/%s: released Workload %s", namespace, job, name)
        return


def ensure_workload(
    custom: client.CustomObjectsApi,
    settings: PodSettings,
    job: Mapping[str, Any],
    spec: ElasticJobSpec,
    finished_job: bool,
    queue: str | None,
) -> tuple[WorkloadView | None, list[Event]]:
    """A queued job's Workload: read, or created when there is none (not for a finished
    job), its template the Pod the job would run (replica 0); one that holds no quota and
    asks for other sizes than the spec (:func:`~kelastic_operator.kueue.outdated`) is
    deleted to be made again; nothing for a job without a LocalQueue (``queue`` None: no
    API call).

    Args:
        custom: the API; settings: the operator's Pod settings.
        job: the ElasticJob as read; spec: its validated spec.
        finished_job: the job is Succeeded or Failed (no Workload is made for it).
        queue: the job's LocalQueue (:func:`~kelastic_operator.kueue.queue_name`).

    Returns:
        The Workload (None: not there yet, or no queue), and the Warning Events to post:
        its read or creation refused (a 4xx: Kueue's webhook, Kueue not installed, a
        missing RBAC rule), its priority class missing, or no Pod can be built for its
        template.

    Raises:
        ApiException: a read or create failed with a 5xx or no status (an outage).
    """
    if queue is None:
        return None, []
    meta = job["metadata"]
    name, namespace, uid = str(meta["name"]), str(meta.get("namespace") or "default"), str(
        meta["uid"])  # fmt: skip
    try:
        found = read_workload(custom, namespace, name, uid)
        if found is not None and found.deleting and not finished_job:
            # a replacement whose finalizer was not lifted yet (a write of Kueue's came
            # between): lift it again, else it stays Terminating and the job waits forever
            release_workload(custom, namespace, name, uid)
            return None, []
        if found is not None and (finished_job or found.quota_reserved or found.deleting):
            return found, []  # (outdated() keeps these: no Pod to build)
        if finished_job:
            return None, []
        pod = build_pod(name, namespace, uid, spec, 0, settings)
        if found is not None and outdated(found, spec, quota_hash(pod["spec"])):
            release_workload(custom, namespace, name, uid)  # made again once it is gone
            return None, [Event("Normal", "WorkloadReplaced", f"Workload {found.name} asked "
                                f"for other sizes or Pods than the job now does: "
                                f"replaced")]  # fmt: skip
        if found is not None:
            return found, []
        made = create_workload(custom, name, namespace, uid, spec, meta.get("labels") or {}, pod)
    except (PodBuildError, PriorityClassMissing) as exc:
        return None, [Event("Warning", "FailedCreateWorkload", str(exc))]
    except ApiException as exc:
        if exc.status is None or not 400 <= exc.status < 500:
            raise
        return None, [Event("Warning", "FailedCreateWorkload", api_message(exc))]
    return made, []


def settle_workload(
    custom: client.CustomObjectsApi,
    view: JobView,
    workload: WorkloadView | None,
    pods_seen: int,
    plan: Plan,
    now: datetime,
) -> None:
    """After a queued job's pass: an evicted Workload none of whose Pods is left gets its
    quota reservation cleared (Kueue queues it again); a job scaled down below its
    admission gives the quota of the Pods gone back (:func:`~kelastic_operator.kueue.reclaim`);
    a finished job's Workload is marked Finished (its quota goes back).

    Args:
        view: the job the pass read (its namespace, name and spec's ``replicas``).
        pods_seen: the job's Pods the pass observed (any state, being deleted included).
        plan: the pass's applied plan; now: the pass's time.

    Raises:
        ApiException: a status patch failed other than with 404/409.
    """
    if workload is None:  # not queued, or its Workload is not there yet
        return
    namespace, job, spec = view.namespace, view.name, view.spec
    stamp = format_time(now)
    clear = needs_clearing(workload, pods_seen) and not plan.create
    if clear and patch_workload_status(custom, namespace, workload.name,
                                       cleared_reservation(workload, stamp)):  # fmt: skip
        log.info("%s/%s: evicted, pods gone: cleared Workload %s's reservation",
                 namespace, job, workload.name)  # fmt: skip
    back = reclaim(workload, spec, pods_seen) if not clear else None
    if back is not None and patch_workload_status(custom, namespace, workload.name,
                                                  reclaim_patch(workload, back)):  # fmt: skip
        log.info("%s/%s: scaled down to %d pods: gave the rest of Workload %s's quota back "
                 "(reclaimablePods %d)", namespace, job, workload.pod_set_count - back,
                 workload.name, back)  # fmt: skip
    phase = plan.status.phase
    if phase in TERMINAL_PHASES and not is_finished(workload):
        message = next((c.message for c in plan.status.conditions if c.type == phase), "")
        patch = finished(workload, phase == "Succeeded", message, stamp)
        finish_workload(custom, namespace, workload, patch)
