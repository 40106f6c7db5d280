"""What :func:`kelastic_operator.reconcile.reconcile` reads and what it returns.

The inputs are views of the observed world: the job (:class:`JobView`), its Pods
(:class:`PodView`, read from a Pod object by :func:`pod_view`, with how the trainer ended,
:class:`Termination`, and what a failed Pod says about its failure, :func:`failure_of`),
and what the job's etcd keys say (:class:`RendezvousView`). The output is a :class:`Plan`
(:class:`CreatePod`, :class:`DeletePod`, :class:`Event`, the new status). Pure data and
pure readers, as :mod:`~kelastic_operator.reconcile` is: nothing here talks to Kubernetes or
etcd. Over ~400 lines because it is one vocabulary, the contract of reconcile's rules:
every type they read or return, each small; split, the contract would be in many files.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from kelastic import contract
from kelastic._safejson import is_int
from kelastic.etcd_values.checkpoints import Restore
from kelastic.etcd_values.loads import LoadDoc
from kelastic.hang_where import HangWhere

from .inprocess_record import InProcessRecord
from .kueue import QueueGate
from .labels import ANNOTATION_SPEC_HASH, pod_index
from .model import ElasticJobSpec, ElasticJobStatus, LastFailure, LastRestart

__all__ = [
    "ACTIVE_PHASES",
    "JOB_FAILED_PREFIX",
    "ChargeView",
    "CreatePod",
    "DeletePod",
    "Event",
    "JobView",
    "Plan",
    "PodView",
    "RendezvousView",
    "StragglerView",
    "Termination",
    "failure_of",
    "format_time",
    "is_job_failure",
    "parse_time",
    "pod_view",
]

#: The sidecar's termination message for a failed *job* (budget spent, rendezvous closed)
#: starts with this; any other failure is the Pod's own and the Pod is replaced.
JOB_FAILED_PREFIX = contract.JOB_FAILED_PREFIX
#: Pod phases in which a Pod still runs or may run.
ACTIVE_PHASES = frozenset({"Pending", "Running", "Unknown"})

_RANK = re.compile(r"\brank (\d+)\b")


# ------------------------------------------------------------------------------- time


def format_time(t: datetime) -> str:
    """RFC 3339 in UTC with second precision, as Kubernetes writes times."""
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> datetime | None:
    """Parse an RFC 3339 time (``Z`` or an offset); None for None or garbage."""
    if not text:
        return None
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


# --------------------------------------------------------------------------- observed


@dataclass(frozen=True)
class Termination:
    """How the trainer container of a Pod ended.

    Attributes:
        exit_code: the container's exit code.
        signal: the signal that ended it, if known.
        reason: Kubernetes' reason (``Error``, ``OOMKilled``, ``Completed``...).
        message: the termination message (the launcher's root-cause summary).
        finished_at: when it ended.
    """

    exit_code: int | None = None
    signal: int | None = None
    reason: str = ""
    message: str = ""
    finished_at: datetime | None = None


@dataclass(frozen=True)
class PodView:
    """What reconcile needs to know about one of the job's Pods.

    Attributes:
        name: ``<job>-<index>``; index: its replica index.
        phase: the Pod phase (Pending, Running, Succeeded, Failed, Unknown).
        ready: the Ready condition is True.
        created: creationTimestamp; deleting: it has a deletionTimestamp.
        trainer: how the trainer container ended, when it did.
        reason, message: the Pod's own ``status.reason``/``status.message`` (``Evicted``...).
        spec_hash: the digest of the spec it was built from (None: built by an operator
            that did not record it).
        scheduled: the scheduler bound it to a Node (``PodScheduled=True``); a Pending Pod
            that is scheduled is starting (image pull, ``ContainerCreating``).
        unschedulable_since: when the scheduler reported it ``Unschedulable``
            (``PodScheduled=False``), None otherwise.
        node_name: the Node it was bound to (``spec.nodeName``); "" before.
        uid: the Pod's ``metadata.uid`` ("" when unknown).
        node_not_ready_since: since when its Node has not been Ready (its Ready condition
            not ``True``, or the Node deleted), None while it is Ready or unknown; not in
            the Pod object: the caller adds it from the Nodes it watches
            (:mod:`~kelastic_operator.node_health`).
        disruption: the reason of its ``DisruptionTarget`` condition when it is ``True``
            (``EvictionByEvictionAPI``, ``PreemptionByScheduler``,
            ``DeletionByTaintManager``, ...: a disruption is taking it), else ``""``.
    """

    name: str
    index: int
    phase: str = "Pending"
    ready: bool = False
    created: datetime | None = None
    deleting: bool = False
    trainer: Termination | None = None
    reason: str = ""
    message: str = ""
    spec_hash: str | None = None
    scheduled: bool = False
    unschedulable_since: datetime | None = None
    node_name: str = ""
    node_not_ready_since: datetime | None = None
    uid: str = ""
    disruption: str = ""


@dataclass(frozen=True)
class ChargeView:
    """One charge of the job's restart record (it keeps the last 100).

    Attributes:
        round: the round whose failure was charged; cause: its cause.
        pod: the Pod (rendezvous node) whose sidecar charged it.
        host: the Kubernetes Node that sidecar ran on (``""``: not known).
        text: what the failure said: its summary, message and stderr tail, bounded.
    """

    round: int
    cause: str
    pod: str
    host: str
    text: str


@dataclass(frozen=True)
class StragglerView:
    """A straggler as its node's sidecar judged it (:mod:`kelastic.etcd_values.stragglers`).

    Attributes:
        node: the Pod; local_rank, scope: the slow rank and the timer scope of its steps.
        median_s, others_median_s: its median step and its node's other ranks', seconds.
        ratio: their ratio; since: when the sidecar judged it (its clock).
        pod_uid: the uid of the Pod whose sidecar judged it (``""``: unknown).
    """

    node: str
    local_rank: int
    scope: str
    median_s: float
    others_median_s: float
    ratio: float
    since: datetime
    pod_uid: str = ""

    def describe(self) -> str:
        """``local rank 1 on j-0: median step 0.310 s (scope 'step'), 3.10x its node's other
        ranks' 0.100 s``."""
        return (f"local rank {self.local_rank} on {self.node}: median step {self.median_s:.3f} s "
                f"(scope {self.scope!r}), {self.ratio:.2f}x its node's other ranks' "
                f"{self.others_median_s:.3f} s")  # fmt: skip


@dataclass(frozen=True)
class RendezvousView:
    """What the job's etcd keys say (all optional: etcd may be unreachable).

    Attributes:
        round: the current rendezvous round; world_size: workers in it.
        restarts_spent: the global restart counter.
        failed_reports: node -> summary of sidecars that reported the job failed.
        succeeded_nodes: nodes whose sidecars reported success.
        inprocess: the in-process restart record (None: none, or unreadable).
        departing: nodes that have a departure notice (the operator's, posted before it
            removed them on purpose).
        hangs: each node's hang evidence (where its workers were as a round hung), any
            round (:func:`kelastic.hang_where.summarize` takes the newest).
        last_restart: the newest restart charged (the restart record's last charge),
            None when there is none.
        stragglers: every node's stragglers now, as its sidecar last reported them.
        charges: the restart record's charges, oldest first.
        restore: what the current round's workers restored from the checkpoint slots
            (its participants' records, as every sidecar agreed on it); None when no
            participant recorded any (the job uses none) or no round is complete.
        loads: what each node's workers loaded as their round began and how long the
            slowest took (``checkpoint-loads/<node>``, any round; node -> record).
    """

    round: int | None = None
    world_size: int | None = None
    restarts_spent: int | None = None
    failed_reports: Mapping[str, str] = field(default_factory=dict)
    succeeded_nodes: frozenset[str] = frozenset()
    inprocess: InProcessRecord | None = None
    departing: frozenset[str] = frozenset()
    hangs: tuple[HangWhere, ...] = ()
    last_restart: LastRestart | None = None
    stragglers: tuple[StragglerView, ...] = ()
    charges: tuple[ChargeView, ...] = ()
    restore: Restore | None = None
    loads: Mapping[str, LoadDoc] = field(default_factory=dict)


@dataclass(frozen=True)
class JobView:
    """The ElasticJob as reconcile sees it.

    Attributes:
        name, namespace, uid: identity; generation: ``metadata.generation``.
        spec: the validated spec; status: the current status (empty for a new job).
        queue: what Kueue allows a job labelled ``kueue.x-k8s.io/queue-name``
            (:func:`~kelastic_operator.kueue.queue_gate`); None for a job without it.
    """

    name: str
    namespace: str
    uid: str
    generation: int
    spec: ElasticJobSpec
    status: ElasticJobStatus
    queue: QueueGate | None = None


# ---------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class CreatePod:
    """Create Pod ``name`` (replica ``index``) from the job's template."""

    name: str
    index: int


@dataclass(frozen=True)
class DeletePod:
    """Delete Pod ``name``; ``reason`` says why (for logs). ``force``: with grace period 0,
    removing the object without waiting for its kubelet (a lost Node's Pod: nothing would
    ever confirm its end)."""

    name: str
    reason: str
    force: bool = False


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event on the job: ``type`` Normal or Warning, CamelCase ``reason``."""

    type: str
    reason: str
    message: str


@dataclass
class Plan:
    """What to do, in this order: remove nodes from rendezvous, delete Pods, create Pods,
    patch the status (when ``status_changed``), post events; then reconcile again after
    ``requeue_after`` seconds (None: only on the next change)."""

    status: ElasticJobStatus
    status_changed: bool = False
    create: list[CreatePod] = field(default_factory=list)
    delete: list[DeletePod] = field(default_factory=list)
    remove_nodes: list[str] = field(default_factory=list)
    #: Nodes removed on purpose (scale-down): their departure notice is posted first, so
    #: their peers re-rendezvous without spending the restart budget.
    depart_nodes: list[str] = field(default_factory=list)
    #: Nodes whose Pods a disruption takes (an eviction, a preemption): their notice
    #: (:data:`kelastic.contract.DEPARTURE_DISRUPTION`) is posted before they are removed.
    disrupted_nodes: list[str] = field(default_factory=list)
    #: Departure notices to delete before the Pods of these names are created again: a
    #: notice left from the earlier Pod of the name would make the new Pod's loss look
    #: planned (no restart charged).
    clear_departures: list[str] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None
    #: Pod incarnations declared lost, ``(pod uid, reason)``: fenced in etcd
    #: (:meth:`kelastic.contract.Keys.fenced`) before anything else, so that the lost
    #: Pod's sidecar, should its Node come back, never joins beside its replacement.
    fence: list[tuple[str, str]] = field(default_factory=list)
    #: Nodes quarantined by this pass (new in ``status.quarantinedNodes``): the operator
    #: taints them when it is told to (``--taint-quarantined-nodes``).
    taint_nodes: list[str] = field(default_factory=list)
    #: Delete the job itself (``ttlSecondsAfterFinished`` passed, :mod:`~kelastic_operator.ttl`):
    #: its finalizer then stops its Pods and deletes its etcd keys, as a ``kubectl delete``.
    delete_job: bool = False

    def depart(self, name: str, reason: str) -> None:
        """Delete Pod ``name`` on purpose: its departure notice first (its peers re-form
        charging nothing), its rendezvous key removed, the deletion (``reason``)."""
        self.delete.append(DeletePod(name, reason))
        for todo in (self.depart_nodes, self.remove_nodes):
            if name not in todo:
                todo.append(name)


# ------------------------------------------------------------------------ observation


def _int(value: Any) -> int | None:
    return value if is_int(value) else None


def pod_view(job: str, pod: Mapping[str, Any], trainer: str = "trainer") -> PodView | None:
    """Read a Pod object (a dict as the API returns it) into a :class:`PodView`.

    Args:
        job: the job name (the Pod must be named ``<job>-<index>``).
        pod: the Pod object.
        trainer: the trainer container's name.

    Returns:
        The view, or None when the Pod's name is not ``<job>-<index>``.
    """
    meta = pod.get("metadata") or {}
    name = str(meta.get("name", ""))
    index = pod_index(job, name)
    if index is None:
        return None
    status = pod.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
        if isinstance(c, dict)
    )
    scheduled, unschedulable_since = bool((pod.get("spec") or {}).get("nodeName")), None
    disruption = ""
    for c in status.get("conditions") or []:
        if isinstance(c, dict) and c.get("type") == "DisruptionTarget":
            disruption = str(c.get("reason") or "Disruption") if c.get("status") == "True" else ""
        if isinstance(c, dict) and c.get("type") == "PodScheduled":
            scheduled = scheduled or c.get("status") == "True"
            if c.get("status") == "False" and c.get("reason") == "Unschedulable":
                unschedulable_since = parse_time(c.get("lastTransitionTime")) or parse_time(
                    meta.get("creationTimestamp")
                )
    term: Termination | None = None
    for cs in status.get("containerStatuses") or []:
        if not isinstance(cs, dict) or cs.get("name") != trainer:
            continue
        state = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get(
            "terminated"
        )
        if isinstance(state, dict):
            term = Termination(
                exit_code=_int(state.get("exitCode")),
                signal=_int(state.get("signal")),
                reason=str(state.get("reason") or ""),
                message=str(state.get("message") or "").strip(),
                finished_at=parse_time(state.get("finishedAt")),
            )
    return PodView(
        name=name,
        index=index,
        phase=str(status.get("phase") or "Pending"),
        ready=ready,
        created=parse_time(meta.get("creationTimestamp")),
        deleting=bool(meta.get("deletionTimestamp")),
        trainer=term,
        reason=str(status.get("reason") or ""),
        message=str(status.get("message") or ""),
        spec_hash=(meta.get("annotations") or {}).get(ANNOTATION_SPEC_HASH),
        scheduled=scheduled,
        unschedulable_since=unschedulable_since,
        node_name=str((pod.get("spec") or {}).get("nodeName") or ""),
        uid=str(meta.get("uid") or ""),
        disruption=disruption[:MAX_REASON_LEN],
    )


#: Longest condition reason kept (the API server bounds a reason to 1024 characters).
MAX_REASON_LEN = 128


def failure_of(pod: PodView, now: datetime) -> LastFailure:
    """The :class:`LastFailure` record of a failed Pod (rank parsed from its message)."""
    term = pod.trainer or Termination()
    pod_says = ": ".join(x for x in (pod.reason, pod.message) if x)
    message = term.message or pod_says or term.reason or f"pod {pod.name} failed"
    rank_match = _RANK.search(term.message)
    sig = term.signal
    if sig is None and term.exit_code is not None and 128 < term.exit_code < 160:
        sig = term.exit_code - 128
    return LastFailure(
        pod=pod.name,
        rank=int(rank_match.group(1)) if rank_match else None,
        exitCode=term.exit_code,
        signal=sig,
        message=message,
        time=format_time(term.finished_at or pod.created or now),
    )


def is_job_failure(pod: PodView) -> bool:
    """The Pod's trainer ended because the whole job failed (not a Pod-level failure)."""
    return bool(pod.trainer and pod.trainer.message.startswith(JOB_FAILED_PREFIX))
