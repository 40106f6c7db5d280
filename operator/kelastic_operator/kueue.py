"""Kueue admission of an ElasticJob as a gang (pure functions; the API calls are
:mod:`~kelastic_operator.workload_client`'s).

A job labelled :data:`QUEUE_LABEL` (``kueue.x-k8s.io/queue-name: <LocalQueue>``) is
admitted by Kueue: the operator writes and owns its Workload (Kueue knows the ElasticJob as
an *external framework*, ``integrations.externalFrameworks: [ElasticJob.v1alpha1.kelastic.dev]``,
and leaves the Workload to the job's own controller, as it does for AppWrapper): one pod set
of ``count: maxReplicas`` Pods, ``minCount: minReplicas`` (partial admission), the Pod the
operator would create as its template (so the quota counts the trainer *and* the sidecar).
Until Kueue admits it the job runs no Pod: the suspension path of
:mod:`~kelastic_operator.suspend` with reason :attr:`QueueReason.QUEUED`. Admitted, it runs
``min(replicas, admitted count)`` Pods with the admission's flavors' node labels and
tolerations (:func:`place_pod`). Evicted (preemption, a quota change, deactivation: the
Workload's ``Evicted`` condition), its Pods stop as a suspended job's do (departure
notices: nothing charged; the sidecars persist first), and once none is left the operator
clears the Workload's quota reservation (:func:`cleared_reservation`, as Kueue's
jobframework does for a stopped job) so that Kueue queues it again; re-admitted, it
resumes from the newest persisted step.

A job without the label has no Workload and behaves as before (:func:`queue_gate` is
None for it). Growing an admitted job (``kubectl scale`` above the admitted count) waits:
Kueue 0.17 grows a running workload only through *workload slices* (the alpha feature gate
``ElasticJobsViaWorkloadSlices``, off by default, built into its own job integrations),
so the job stays at the admitted count; the Workload already asks for ``maxReplicas``, so
Kueue admits the most the quota allows at the start.

Scaled down below its admission (``kubectl scale`` to fewer Pods), the job gives the quota
of the Pods it no longer runs back once they are gone: the Workload's
``status.reclaimablePods`` (:func:`reclaim`; Kueue's ``ReclaimablePods``, beta and on in
0.17), so a queue's waiting jobs get those GPUs at once. Kueue never lets that count fall
while the quota is held, so the job cannot grow back into it before it is admitted again.
A waiting Workload whose Pod template asks for other resources or placement than the job's
Pods would now (:func:`quota_hash`, kept in :data:`QUOTA_HASH_ANNOTATION`) is made again,
as one of other sizes is.

Over ~400 lines because it is one cohesive thing: the operator's half of Kueue's Workload
protocol (what it writes, what it reads, the status patches it makes, where the admission
puts the Pods), each piece small and read against the others.
"""

from __future__ import annotations

import copy
import enum
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .model import API_GROUP, API_VERSION, KIND, ElasticJobSpec

__all__ = [
    "FLAVORS",
    "GROUP",
    "JOB_UID_LABEL",
    "POD_SET",
    "PRIORITY_CLASSES",
    "PRIORITY_LABEL",
    "QUEUE_LABEL",
    "QUOTA_HASH_ANNOTATION",
    "RESOURCE_IN_USE",
    "VERSION",
    "WORKLOADS",
    "Placement",
    "QueueGate",
    "QueueReason",
    "WorkloadView",
    "build_workload",
    "cleared_reservation",
    "finished",
    "is_finished",
    "needs_clearing",
    "outdated",
    "place_pod",
    "place_pods",
    "placement",
    "queue_gate",
    "queue_name",
    "quota_hash",
    "reclaim",
    "reclaim_patch",
    "workload_name",
    "workload_view",
]

#: Kueue's API group and the Workload API version written (v1beta2: storage in 0.17).
GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
WORKLOADS = "workloads"
FLAVORS = "resourceflavors"
PRIORITY_CLASSES = "workloadpriorityclasses"
#: The job's label naming its LocalQueue (Kueue's own, as on a batch/v1 Job).
QUEUE_LABEL = f"{GROUP}/queue-name"
#: The job's label naming its WorkloadPriorityClass.
PRIORITY_LABEL = f"{GROUP}/priority-class"
#: The Workload's label holding its job's uid (Kueue's jobframework writes it too).
JOB_UID_LABEL = f"{GROUP}/job-uid"
#: Kueue's finalizer: an owned Workload keeps it until its job's Pods are gone, and the
#: operator, not Kueue, lifts it.
RESOURCE_IN_USE = f"{GROUP}/resource-in-use"
#: The one pod set's name.
POD_SET = "workers"
#: The Workload's annotation holding :func:`quota_hash` of the template it was made with.
QUOTA_HASH_ANNOTATION = f"{API_GROUP}/pod-set-quota-hash"
#: The Pod spec's fields Kueue's quota and placement read (:func:`quota_hash`).
_QUOTA_FIELDS = (
    "nodeSelector",
    "affinity",
    "tolerations",
    "topologySpreadConstraints",
    "priorityClassName",
    "overhead",
    "resourceClaims",
    "runtimeClassName",
)


class QueueReason(enum.StrEnum):
    """Reason of the job's ``Suspended`` condition while Kueue holds it."""

    #: No quota reserved yet (the Workload is new, pending or inadmissible).
    QUEUED = "Queued"
    #: The Workload was evicted (preemption, a quota change, deactivation).
    EVICTED = "Evicted"


@dataclass(frozen=True)
class WorkloadView:
    """What the operator reads from its Workload.

    Attributes:
        name: ``metadata.name``; resource_version: ``metadata.resourceVersion``.
        deleting: it has a ``deletionTimestamp``.
        finalizers: ``metadata.finalizers``.
        quota_reserved: the ``QuotaReserved`` condition is True; admitted: ``Admitted`` is.
        evicted: the ``Evicted`` condition is True; evicted_reason/evicted_message: its.
        pending_message: the ``QuotaReserved`` condition's message while False ("" else).
        count: the admission's Pod count of the pod set (None: no admission).
        flavors: the admission's ResourceFlavor names of the pod set, sorted.
        cluster_queue: the admission's ClusterQueue ("" without one).
        conditions: the status's conditions as read (for :func:`cleared_reservation`).
        pod_set_count, pod_set_min_count: what the Workload asks (spec.podSets[0]).
        quota_hash: its :data:`QUOTA_HASH_ANNOTATION` ("" without one).
        reclaimable: ``status.reclaimablePods``' count of the pod set (0 without one).
    """

    name: str
    resource_version: str = ""
    deleting: bool = False
    finalizers: tuple[str, ...] = ()
    quota_reserved: bool = False
    admitted: bool = False
    evicted: bool = False
    evicted_reason: str = ""
    evicted_message: str = ""
    pending_message: str = ""
    count: int | None = None
    flavors: tuple[str, ...] = ()
    cluster_queue: str = ""
    conditions: tuple[Mapping[str, Any], ...] = ()
    pod_set_count: int = 0
    pod_set_min_count: int | None = None
    quota_hash: str = ""
    reclaimable: int = 0


@dataclass(frozen=True)
class QueueGate:
    """What Kueue allows a labelled job now (:func:`queue_gate`).

    Attributes:
        queue: the LocalQueue.
        admitted: Pods the admission allows; None while not admitted (no Pod runs).
        reason: why it is held (meaningless when admitted).
        message: the ``Suspended`` condition's message while held; a note otherwise.
    """

    queue: str
    admitted: int | None
    reason: QueueReason = QueueReason.QUEUED
    message: str = ""


@dataclass(frozen=True)
class Placement:
    """Where the admission's flavors put the Pods: their ``nodeLabels`` and
    ``tolerations`` (as Kueue's jobframework merges them into a started job's template)."""

    node_selector: Mapping[str, str]
    tolerations: tuple[Mapping[str, Any], ...] = ()


def queue_name(labels: Mapping[str, str] | None) -> str | None:
    """The LocalQueue a job's ``metadata.labels`` name (None: not queued by Kueue)."""
    value = (labels or {}).get(QUEUE_LABEL)
    return str(value) if value else None


def workload_name(job: str, uid: str) -> str:
    """The Workload's name, as Kueue's jobframework names a job's
    (``GetWorkloadNameForOwnerWithGVK``): ``elasticjob-<job>-<5 hex of a sha1 over kind,
    group, name and uid>`` (a job name is at most 52 characters: no truncation needed)."""
    digest = hashlib.sha1("\n".join((KIND, API_GROUP, job, uid)).encode()).hexdigest()
    return f"{KIND.lower()}-{job}-{digest[:5]}"


def build_workload(
    job: str,
    namespace: str,
    uid: str,
    spec: ElasticJobSpec,
    labels: Mapping[str, str],
    pod: Mapping[str, Any],
    priority: int | None = None,
) -> dict[str, Any]:
    """The Workload of a labelled job (``kueue.x-k8s.io/v1beta2``).

    Args:
        job, namespace, uid: the job's identity (the controller ownerReference, the name,
            the ``job-uid`` label).
        spec: the validated spec (``maxReplicas`` -> ``count``, ``minReplicas`` ->
            ``minCount`` when smaller).
        labels: the job's labels (:data:`QUEUE_LABEL` -> ``spec.queueName``,
            :data:`PRIORITY_LABEL` -> ``spec.priorityClassRef``).
        pod: a Pod as the operator builds it (:func:`~kelastic_operator.pods.build_pod`):
            its ``spec`` is the pod set's template, so the quota counts what the Pods ask.
        priority: the value of the WorkloadPriorityClass the label names (``spec.priority``;
            the class is referenced only with its value).

    Returns:
        The Workload manifest, with Kueue's finalizer (it holds the quota until the Pods
        are gone).

    Raises:
        ValueError: ``labels`` names no LocalQueue.
    """
    queue = queue_name(labels)
    if queue is None:
        raise ValueError(f"the job carries no {QUEUE_LABEL} label")
    pod_set: dict[str, Any] = {
        "name": POD_SET,
        "count": spec.max_nodes,
        "template": {"spec": copy.deepcopy(dict(pod.get("spec") or {}))},
    }
    if spec.min_nodes < spec.max_nodes:
        pod_set["minCount"] = spec.min_nodes
    wl_spec: dict[str, Any] = {"queueName": queue, "podSets": [pod_set]}
    template_hash = quota_hash(pod_set["template"]["spec"])
    priority_class = labels.get(PRIORITY_LABEL)
    if priority_class and priority is not None:  # Kueue's CRD: a class needs its priority
        wl_spec["priorityClassRef"] = {
            "group": GROUP, "kind": "WorkloadPriorityClass", "name": priority_class,
        }  # fmt: skip
        wl_spec["priority"] = priority
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Workload",
        "metadata": {
            "name": workload_name(job, uid),
            "namespace": namespace,
            "labels": {JOB_UID_LABEL: uid},
            "annotations": {QUOTA_HASH_ANNOTATION: template_hash},
            "finalizers": [RESOURCE_IN_USE],
            "ownerReferences": [
                {
                    "apiVersion": f"{API_GROUP}/{API_VERSION}",
                    "kind": KIND,
                    "name": job,
                    "uid": uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": wl_spec,
    }


def quota_hash(pod_spec: Mapping[str, Any]) -> str:
    """A digest (16 hex characters) of what Kueue's quota and placement read in a pod set's
    template: each container's and init container's name and ``resources`` (an init
    container's ``restartPolicy`` too: a native sidecar's requests add up), and the
    spec's scheduling fields (:data:`_QUOTA_FIELDS`). An image or a command is not in it,
    so an operator upgrade that changes only the sidecar's image replaces no waiting
    Workload (a replacement puts it behind the jobs queued since)."""

    def containers(key: str, keep: tuple[str, ...]) -> list[dict[str, Any]]:
        return [{k: c.get(k) for k in keep} for c in pod_spec.get(key) or []]

    view = {
        "containers": containers("containers", ("name", "resources")),
        "initContainers": containers("initContainers", ("name", "resources", "restartPolicy")),
        **{k: pod_spec.get(k) for k in _QUOTA_FIELDS},
    }
    text = json.dumps(view, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _condition(conditions: Sequence[Mapping[str, Any]], kind: str) -> Mapping[str, Any]:
    for cond in conditions:
        if cond.get("type") == kind:
            return cond
    return {}


def workload_view(obj: Mapping[str, Any]) -> WorkloadView:
    """Read a Workload (a dict as the API returns it) into a :class:`WorkloadView`."""
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    conditions = tuple(c for c in status.get("conditions") or [] if isinstance(c, Mapping))
    reserved = _condition(conditions, "QuotaReserved")
    evicted = _condition(conditions, "Evicted")
    admission = status.get("admission") or {}
    assignments = admission.get("podSetAssignments") or []
    first = next((a for a in assignments if a.get("name") == POD_SET), None)
    count = first.get("count") if first else None
    pod_sets = (obj.get("spec") or {}).get("podSets") or [{}]
    reclaimable = next((r.get("count") for r in status.get("reclaimablePods") or []
                        if isinstance(r, Mapping) and r.get("name") == POD_SET), 0)  # fmt: skip
    return WorkloadView(
        name=str(meta.get("name") or ""),
        resource_version=str(meta.get("resourceVersion") or ""),
        deleting=bool(meta.get("deletionTimestamp")),
        finalizers=tuple(meta.get("finalizers") or ()),
        quota_reserved=reserved.get("status") == "True",
        admitted=_condition(conditions, "Admitted").get("status") == "True",
        evicted=evicted.get("status") == "True",
        evicted_reason=str(evicted.get("reason") or ""),
        evicted_message=str(evicted.get("message") or ""),
        pending_message=str(reserved.get("message") or "") if reserved.get("status") == "False"
        else "",
        count=int(count) if isinstance(count, int) else None,
        flavors=tuple(sorted(set((first or {}).get("flavors", {}).values()))),
        cluster_queue=str(admission.get("clusterQueue") or ""),
        conditions=conditions,
        pod_set_count=int(pod_sets[0].get("count") or 0),
        pod_set_min_count=pod_sets[0].get("minCount"),
        quota_hash=str((meta.get("annotations") or {}).get(QUOTA_HASH_ANNOTATION) or ""),
        reclaimable=reclaimable if isinstance(reclaimable, int) and reclaimable > 0 else 0,
    )  # fmt: skip


def queue_gate(
    queue: str | None, workload: WorkloadView | None, spec: ElasticJobSpec
) -> QueueGate | None:
    """What Kueue allows the job now.

    Args:
        queue: the job's LocalQueue (:func:`queue_name`); None: not queued.
        workload: its Workload as read (None: not created yet).
        spec: the job's spec (the admitted count is capped at ``maxReplicas``).

    Returns:
        None for a job without the label (no gate: today's behaviour); else a gate that
        is open (``admitted`` Pods) only while the Workload is admitted and not evicted.
    """
    if queue is None:
        return None
    if workload is None or workload.deleting:
        return QueueGate(queue, None, QueueReason.QUEUED,
                         f"waiting for Kueue to admit it (LocalQueue {queue})")  # fmt: skip
    if workload.evicted:
        why = workload.evicted_reason or "Evicted"
        return QueueGate(queue, None, QueueReason.EVICTED,
                         f"evicted by Kueue ({why}): {workload.evicted_message}")  # fmt: skip
    if not (workload.admitted and workload.quota_reserved):
        detail = f": {workload.pending_message}" if workload.pending_message else ""
        return QueueGate(queue, None, QueueReason.QUEUED,
                         f"waiting for Kueue to admit it (LocalQueue {queue}){detail}")  # fmt: skip
    count = _admitted(workload)
    admitted = max(0, min(_held(workload), spec.max_nodes))  # quota given back stays given
    back = f", {count - admitted} given back" if workload.reclaimable and admitted < count else ""
    return QueueGate(queue, admitted, QueueReason.QUEUED,
                     f"admitted by Kueue (LocalQueue {queue}, ClusterQueue "
                     f"{workload.cluster_queue}): {admitted} of {spec.max_nodes} pods"
                     f"{back}")  # fmt: skip


def _admitted(workload: WorkloadView) -> int:
    """The admission's Pod count (the pod set's count when the admission names none)."""
    return workload.count if workload.count is not None else workload.pod_set_count


def _held(workload: WorkloadView) -> int:
    """The Pods whose quota the Workload holds: Kueue's ``min(admitted, count -
    reclaimable)`` (``podSetsCountsAfterReclaim``)."""
    return min(_admitted(workload), workload.pod_set_count - workload.reclaimable)


def placement(flavors: Sequence[Mapping[str, Any]]) -> Placement:
    """The node labels and tolerations of the admission's ResourceFlavors (each a dict as
    the API returns it), merged in order as Kueue's jobframework merges them."""
    selector: dict[str, str] = {}
    tolerations: list[Mapping[str, Any]] = []
    for flavor in flavors:
        fspec = flavor.get("spec") or {}
        selector.update({str(k): str(v) for k, v in (fspec.get("nodeLabels") or {}).items()})
        for toleration in fspec.get("tolerations") or []:
            if toleration not in tolerations:
                tolerations.append(copy.deepcopy(toleration))
    return Placement(selector, tuple(tolerations))


def place_pod(pod: dict[str, Any], where: Placement) -> None:
    """Add ``where``'s node labels to the Pod's ``nodeSelector`` and its tolerations to
    the Pod's (``pod`` is changed in place; not part of the spec's digest)."""
    pspec = pod.setdefault("spec", {})
    if where.node_selector:
        pspec["nodeSelector"] = {**(pspec.get("nodeSelector") or {}), **where.node_selector}
    if where.tolerations:
        have = list(pspec.get("tolerations") or [])
        have.extend(copy.deepcopy(dict(t)) for t in where.tolerations if t not in have)
        pspec["tolerations"] = have


def outdated(workload: WorkloadView, spec: ElasticJobSpec, template_hash: str) -> bool:
    """Whether a Workload that holds no quota asks for other sizes than the spec now does
    (``maxReplicas``/``minReplicas`` edited while the job waits), or for another Pod:
    its :attr:`~WorkloadView.quota_hash` is not ``template_hash`` (:func:`quota_hash` of
    the Pod the job would run now: its requests or placement edited, or the operator's
    sidecar resources changed). It is replaced, as Kueue's jobframework replaces a job's
    Workload that no longer matches it. One that holds quota (admitted, or evicted and
    not yet given back) is kept: the job runs at its admission until it ends or is
    evicted (Kueue refuses a change of an admitted Workload's pod sets)."""
    if workload.quota_reserved or workload.deleting:
        return False
    min_count = spec.min_nodes if spec.min_nodes < spec.max_nodes else None
    sizes = (workload.pod_set_count, workload.pod_set_min_count)
    return sizes != (spec.max_nodes, min_count) or workload.quota_hash != template_hash


def place_pods(pods: Sequence[dict[str, Any]], where: Placement | None) -> None:
    """:func:`place_pod` each of ``pods`` (in place); nothing when ``where`` is None."""
    for pod in pods if where is not None else ():
        place_pod(pod, where)  # type: ignore[arg-type]


def needs_clearing(workload: WorkloadView | None, pods_left: int) -> bool:
    """Whether the operator clears the Workload's quota reservation now: it is evicted,
    still reserved, and none of the job's Pods is left (jobframework's rule for a stopped
    job: only then may the quota go to another)."""
    return bool(workload and workload.evicted and workload.quota_reserved and not pods_left)


def cleared_reservation(workload: WorkloadView, now: str) -> dict[str, Any]:
    """The status merge patch that gives an evicted Workload's quota back, as Kueue's
    jobframework does for a stopped job (``UnsetQuotaReservationWithCondition`` and
    ``SetRequeuedCondition``): ``admission`` removed, ``QuotaReserved`` False (reason
    ``Pending``), ``Admitted`` False (``NoReservation``), ``Requeued`` True after a
    preemption or a node failure (False otherwise, e.g. a deactivation).

    Args:
        workload: the Workload as read (its conditions and resourceVersion are kept /
            made a precondition).
        now: RFC 3339 time of the transitions.

    Returns:
        A JSON merge patch of ``workloads/status``.
    """
    message = workload.evicted_message or "evicted"
    requeued = workload.evicted_reason in ("Preempted", "NodeFailures")
    patch = _conditions_patch(workload, now, {
        "QuotaReserved": ("False", "Pending", message),
        "Admitted": ("False", "NoReservation", "The workload has no reservation"),
        "Requeued": ("True" if requeued else "False", workload.evicted_reason or "Evicted",
                     message),
    })  # fmt: skip
    patch["status"]["admission"] = None
    patch["status"]["reclaimablePods"] = None  # given back with the rest: admitted anew
    return patch


def reclaim(workload: WorkloadView | None, spec: ElasticJobSpec, pods_seen: int) -> int | None:
    """The Workload's new ``reclaimablePods`` count when the job was scaled down below its
    admission and the Pods beyond ``replicas`` are gone; None when nothing is to be
    written (not admitted, evicted, or as much given back already).

    Kueue counts an admitted pod set's quota as ``min(admitted, count - reclaimable)``
    (``podSetsCountsAfterReclaim``), so giving back all but ``n`` Pods is
    ``count - n``; its webhook refuses a count that falls while the quota is held.

    Args:
        workload: the Workload as read; spec: the job's spec (``replicas``).
        pods_seen: the job's Pods the pass observed, being deleted included: quota is
            given back only for Pods that are gone, never for one still stopping.
    """
    if workload is None or workload.evicted or not (workload.admitted and workload.quota_reserved):
        return None
    keep = max(spec.replicas, pods_seen)
    if keep >= _held(workload):
        return None
    return workload.pod_set_count - keep


def reclaim_patch(workload: WorkloadView, count: int) -> dict[str, Any]:
    """The status merge patch that gives ``count`` of the pod set's Pods back
    (``status.reclaimablePods``, the list replaced whole: it has one pod set),
    conditional on the Workload's resourceVersion."""
    return {"metadata": {"resourceVersion": workload.resource_version},
            "status": {"reclaimablePods": [{"name": POD_SET, "count": count}]}}  # fmt: skip


def finished(workload: WorkloadView, succeeded: bool, message: str, now: str) -> dict[str, Any]:
    """The status merge patch that marks a finished job's Workload ``Finished`` (reason
    ``Succeeded``/``Failed``, as jobframework's ``workload.Finish``): Kueue then gives its
    quota back. Nothing else changes (the admission stays, as Kueue keeps it).

    Args:
        workload: the Workload as read; succeeded: how the job ended.
        message: the condition's message; now: RFC 3339 time of the transition.

    Returns:
        A JSON merge patch of ``workloads/status``.
    """
    reason = "Succeeded" if succeeded else "Failed"
    return _conditions_patch(workload, now, {"Finished": ("True", reason, message or reason)})


def is_finished(workload: WorkloadView | None) -> bool:
    """Whether the Workload's ``Finished`` condition is True already."""
    return bool(workload) and any(
        c.get("type") == "Finished" and c.get("status") == "True"
        for c in workload.conditions  # type: ignore[union-attr]
    )


def _conditions_patch(
    workload: WorkloadView, now: str, new: dict[str, tuple[str, str, str]]
) -> dict[str, Any]:
    """A status merge patch of the Workload's conditions with ``new`` (type -> status,
    reason, message) set (the list is replaced whole; the others are kept as read; a
    transition time moves only with the status), conditional on its resourceVersion."""
    todo = dict(new)
    out: list[dict[str, Any]] = []
    for cond in workload.conditions:
        kind = str(cond.get("type"))
        if kind not in todo:
            out.append(dict(cond))
            continue
        status, reason, text = todo.pop(kind)
        moved = cond.get("status") != status
        out.append(
            {
                **cond,
                "status": status,
                "reason": reason,
                "message": text[:32768],
                "lastTransitionTime": now if moved else cond.get("lastTransitionTime", now),
            }
        )
    for kind, (status, reason, text) in todo.items():
        out.append({"type": kind, "status": status, "reason": reason, "message": text[:32768],
                    "lastTransitionTime": now})  # fmt: skip
    return {"metadata": {"resourceVersion": workload.resource_version},
            "status": {"conditions": out}}  # fmt: skip
