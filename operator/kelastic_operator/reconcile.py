"""Reconcile an ElasticJob as a pure function: (job, observed Pods, rendezvous view, now) -> plan.

Nothing here talks to Kubernetes or etcd; :mod:`kelastic_operator.handlers` observes, calls
:func:`reconcile` and applies the :class:`Plan`. Rules, in order:

1. A job in a terminal phase (Succeeded, Failed) gets no new Pods; its remaining Pods are
   deleted per ``cleanupPolicy`` (``Running``: Pending/Running ones; ``All``; ``None``).
2. **Failed** when a Pod's trainer says the *job* failed (its termination message starts
   with :data:`JOB_FAILED_PREFIX`, written by the sidecar when the restart budget is spent
   or the rendezvous closed) or a sidecar's etcd report says so, or when a Pod fails and
   the Pod replacement budget (``podReplacement.maxReplacements``) is spent. The root cause
   (the termination message) goes into ``status.lastFailure`` and the Failed condition.
3. **Succeeded** when some Pod succeeded and none is still running.
4. The operator keeps ``target`` Pods named ``<job>-<index>``; ``target`` is ``replicas``
   or fewer while shrunk (below). Missing ones are created at the lowest free indices (a
   deleted Pod is replaced at once, without spending the replacement budget, once it is
   gone); Pods beyond ``target`` are deleted — Pods stuck Pending first, then the highest
   index first — and their nodes removed from rendezvous at once.
   A Pod built from an older spec (its :data:`ANNOTATION_SPEC_HASH` differs from the
   job's :func:`~kelastic_operator.pods.pod_spec_hash`: the template or another field
   that shapes Pods changed, not ``replicas``) is deleted, all such Pods at once, with
   a departure notice (no restart spent), and re-created from the new spec once gone.
5. A failed Pod is deleted (and re-created by rule 4 on a later pass) after an exponential
   backoff: ``min(maxBackoffSeconds, backoffSeconds * 2**replacements)`` seconds after it
   failed; each deletion spends one replacement. Its node leaves rendezvous at once.
6. Pods stuck Pending shrink ``target`` towards ``minReplicas`` (one step per stuck Pod;
   the stuck Pods go). Stuck means unschedulable (the scheduler's ``PodScheduled=False``,
   reason ``Unschedulable``; or not scheduled at all) for ``pendingTimeoutSeconds``, or
   scheduled but still starting (image pull, ``ContainerCreating``) for the longer
   ``startTimeoutSeconds``. One timeout after the
   last resize, ``target`` grows back to ``replicas``. A spec change (new generation)
   resets ``target`` to ``replicas``.
7. Phase otherwise: Restarting while failed Pods wait to be replaced, or while fewer than
   ``minReplicas`` Pods run after the job once ran; Running with at least ``minReplicas``
   running Pods; else Pending. Conditions say independent things (``metav1.Condition``:
   reason, message, ``observedGeneration``; ``lastTransitionTime`` moves only when the
   status does): ``RendezvousReady`` (Running with a complete round's world size),
   ``Complete`` and ``Failed`` (added when the job succeeds / fails). An Event marks each
   phase transition, each failed Pod, each replacement, resize and worker-group restart.
8. Nodes leave rendezvous (their alive keys are deleted) the moment their Pod is seen
   failed (and on every pass until it is gone: deleting a key is idempotent), being
   deleted, gone, or deleted on scale-down.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from kelastic import contract

from .labels import ANNOTATION_SPEC_HASH, pod_index, selector
from .model import (
    TERMINAL_PHASES,
    Condition,
    ElasticJobSpec,
    ElasticJobStatus,
    LastFailure,
)
from .pods import pod_spec_hash

#: The sidecar's termination message for a failed *job* (budget spent, rendezvous closed)
#: starts with this; any other failure is the Pod's own and the Pod is replaced.
JOB_FAILED_PREFIX = contract.JOB_FAILED_PREFIX
#: :class:`DeletePod` reason of a failed Pod deleted to be replaced (counted as a replacement).
REPLACE_REASON = "replacing a failed pod"
#: :class:`DeletePod` reason of a Pod built from an older spec (rule 4d).
UPDATE_REASON = "pod spec changed"
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


@dataclass(frozen=True)
class RendezvousView:
    """What the job's etcd keys say (all optional: etcd may be unreachable).

    Attributes:
        round: the current rendezvous round; world_size: workers in it.
        restarts_spent: the global restart counter.
        failed_reports: node -> summary of sidecars that reported the job failed.
        succeeded_nodes: nodes whose sidecars reported success.
    """

    round: int | None = None
    world_size: int | None = None
    restarts_spent: int | None = None
    failed_reports: Mapping[str, str] = field(default_factory=dict)
    succeeded_nodes: frozenset[str] = frozenset()


@dataclass(frozen=True)
class JobView:
    """The ElasticJob as reconcile sees it.

    Attributes:
        name, namespace, uid: identity; generation: ``metadata.generation``.
        spec: the validated spec; status: the current status (empty for a new job).
    """

    name: str
    namespace: str
    uid: str
    generation: int
    spec: ElasticJobSpec
    status: ElasticJobStatus


# ---------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class CreatePod:
    """Create Pod ``name`` (replica ``index``) from the job's template."""

    name: str
    index: int


@dataclass(frozen=True)
class DeletePod:
    """Delete Pod ``name``; ``reason`` says why (for logs)."""

    name: str
    reason: str


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
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None


# ------------------------------------------------------------------------ observation


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


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
    for c in status.get("conditions") or []:
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
    )


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


def backoff_seconds(spec: ElasticJobSpec, replacements: int) -> float:
    """Seconds to wait before replacement number ``replacements + 1``."""
    policy = spec.pod_replacement
    return float(min(policy.max_backoff_seconds, policy.backoff_seconds * 2.0**replacements))


# -------------------------------------------------------------------------- reconcile


def _is_newer(failure: LastFailure, old: LastFailure | None) -> bool:
    if old is None:
        return True
    return (failure.time or "", failure.pod) > (old.time or "", old.pod) and (
        failure.time != old.time or failure.pod != old.pod
    )


def _failure_key(pod: PodView, now: datetime) -> str:
    """Names one failure of one Pod: ``<pod>@<failure time>``."""
    return f"{pod.name}@{failure_of(pod, now).time}"


def _stuck_at(spec: ElasticJobSpec, pod: PodView, last_resize: datetime | None) -> datetime | None:
    """When a Pending Pod counts as stuck (rule 6), None when it cannot tell yet.

    Unschedulable (or not yet seen by a scheduler): ``pendingTimeoutSeconds`` after the
    later of that and the last resize. Scheduled but still starting (image pull,
    ``ContainerCreating``): ``startTimeoutSeconds`` after its creation, a longer timeout
    since capacity is not what it lacks.
    """
    if pod.scheduled and pod.unschedulable_since is None:
        if pod.created is None:
            return None
        return pod.created + timedelta(seconds=spec.start_timeout_seconds)
    since = pod.unschedulable_since or pod.created
    if since is None:
        return None
    since = max(since, last_resize) if last_resize else since
    return since + timedelta(seconds=spec.pending_timeout_seconds)


def _cleanup(spec: ElasticJobSpec, pods: Sequence[PodView], plan: Plan, why: str) -> None:
    for pod in sorted(pods, key=lambda p: -p.index):
        if pod.deleting:
            continue
        if spec.cleanup_policy == "All" or (
            spec.cleanup_policy == "Running" and pod.phase in ACTIVE_PHASES
        ):
            plan.delete.append(DeletePod(pod.name, why))


def _set_conditions(
    status: ElasticJobStatus, phase: str, reason: str, message: str, generation: int, now: str
) -> None:
    """The conditions of ``metav1.Condition`` (non-empty reason and message, times that move
    only on a change of status, ``observedGeneration``), each saying one thing:

    - ``RendezvousReady``: True while Running with a world size from a complete round
      (reason ``RoundComplete``); False otherwise, with the phase's reason and message;
    - ``Complete`` / ``Failed``: added, True, when the job succeeds / fails (terminal).
    """
    old = {c.type: c for c in status.conditions}

    def condition(kind: str, value: bool, why: str, text: str) -> Condition:
        prev = old.get(kind)
        flag = "True" if value else "False"
        changed = prev is None or prev.status != flag
        return Condition(
            type=kind,
            status=flag,  # type: ignore[arg-type]
            reason=why,
            message=text,
            lastTransitionTime=now if changed or prev is None else prev.last_transition_time,
            observedGeneration=generation,
        )

    ready = phase == "Running" and bool(status.world_size)
    if ready:
        why, text = "RoundComplete", f"round {status.round}: world size {status.world_size}"
    elif phase == "Running":
        why, text = "WaitingForRendezvous", message
    elif phase in TERMINAL_PHASES:
        why, text = "JobFinished", f"the job {phase.lower()}: {message}"
    else:
        why, text = reason, message
    out = [condition("RendezvousReady", ready, why, text or phase)]
    if phase == "Succeeded":
        out.append(condition("Complete", True, reason, message or "the job succeeded"))
    if phase == "Failed":
        out.append(condition("Failed", True, reason, message or "the job failed"))
    status.conditions = out


def reconcile(
    job: JobView,
    pods: Sequence[PodView],
    now: datetime,
    rendezvous: RendezvousView | None = None,
) -> Plan:
    """Decide what to do for ``job`` given its Pods and the rendezvous state at ``now``.

    Args:
        job: the job (spec and current status).
        pods: the job's Pods as observed (any order; Pods not named ``<job>-<index>``
            must be left out by the caller).
        now: the current time (timezone-aware).
        rendezvous: what etcd says, if it could be read.

    Returns:
        The :class:`Plan`; its ``status`` is the complete new status, ``status_changed``
        says whether it differs from ``job.status``.
    """
    plan = _decide(job, pods, now, rendezvous or RendezvousView())
    gone = {d.name for d in plan.delete}
    staying = [p for p in pods if not p.deleting and p.name not in gone]
    plan.status.replicas = len(staying) + len(plan.create)
    plan.status.ready_replicas = sum(1 for p in staying if p.phase == "Running" and p.ready)
    plan.status_changed = plan.status.as_patch() != job.status.as_patch()
    return plan


def reconcile_invalid(status: ElasticJobStatus, generation: int, error: str, now: datetime) -> Plan:
    """The plan for a job whose spec the model rejects (the CRD schema let it through):
    Failed, reason ``InvalidSpec``, the validation error as the message; no Pods.

    Args:
        status: the current status; generation: ``metadata.generation``.
        error: the validation error text; now: the current time.
    """
    st = status.model_copy(deep=True)
    st.observed_generation = generation
    plan = Plan(status=st)
    if status.phase == "Failed" and status.observed_generation == generation:
        return plan
    _finish(generation, status, st, plan, "Failed", "InvalidSpec", error, format_time(now), now, [])
    plan.status_changed = plan.status.as_patch() != status.as_patch()
    return plan


def _decide(job: JobView, pods: Sequence[PodView], now: datetime, rdzv: RendezvousView) -> Plan:
    spec, old = job.spec, job.status
    st = old.model_copy(deep=True)
    plan = Plan(status=st)
    stamp = format_time(now)
    wakeups: list[datetime] = []
    st.selector = selector(job.name)
    if rdzv.round is not None:
        st.round = rdzv.round
    if rdzv.world_size is not None:
        st.world_size = rdzv.world_size
    if rdzv.restarts_spent is not None:
        st.restarts_spent = rdzv.restarts_spent
    st.restarts_spent = st.restarts_spent or 0
    st.replacements = st.replacements or 0
    new_generation = old.observed_generation != job.generation
    st.observed_generation = job.generation

    live = [p for p in pods if not p.deleting]
    by_phase: dict[str, list[PodView]] = {}
    for pod in live:
        by_phase.setdefault(pod.phase, []).append(pod)
    running = by_phase.get("Running", [])
    succeeded = by_phase.get("Succeeded", [])
    failed = sorted(by_phase.get("Failed", []), key=lambda p: p.index)
    phase: str = old.phase or "Pending"
    reason, message = "", ""

    # 1. terminal: only clean up
    if phase in TERMINAL_PHASES:
        _cleanup(spec, live, plan, f"job {phase.lower()}")
        return _finish(job.generation, old, st, plan, phase, None, None, stamp, now, wakeups)

    # failed Pods' nodes leave rendezvous (idempotent: every pass until the Pod is gone);
    # new failures (newest last) are recorded and announced once
    for pod in sorted(failed, key=lambda p: (failure_of(p, now).time or "", p.index)):
        failure = failure_of(pod, now)
        plan.remove_nodes.append(pod.name)
        if _is_newer(failure, st.last_failure):
            st.last_failure = failure
            plan.events.append(
                Event("Warning", "PodFailed", f"pod {pod.name} failed: {failure.message}")
            )

    # Pods being deleted leave rendezvous at once (their sidecars may not get to say so)
    for pod in pods:
        if pod.deleting and pod.phase in ACTIVE_PHASES and pod.name not in plan.remove_nodes:
            plan.remove_nodes.append(pod.name)

    # worker-group restarts the sidecars spent (scale events spend none)
    spent_before = old.restarts_spent or 0
    if rdzv.restarts_spent is not None and rdzv.restarts_spent > spent_before:
        plan.events.append(
            Event(
                "Warning",
                "WorkersRestarted",
                f"worker group restarted: {rdzv.restarts_spent}/{spec.max_restarts} restarts "
                f"spent (round {rdzv.round if rdzv.round is not None else '?'})",
            )
        )

    # 2. the job failed
    fatal = [p for p in failed if is_job_failure(p)]
    if fatal or rdzv.failed_reports:
        if fatal:
            cause = failure_of(fatal[0], now)
            st.last_failure = cause
            message = cause.message
        else:
            node, summary = sorted(rdzv.failed_reports.items())[0]
            message = summary
            st.last_failure = LastFailure(pod=node, message=summary, time=stamp)
        phase, reason = "Failed", "JobFailed"
        _cleanup(spec, live, plan, "job failed")
        return _finish(job.generation, old, st, plan, phase, reason, message, stamp, now, wakeups)

    # 3. the job succeeded
    if (succeeded or rdzv.succeeded_nodes) and not running:
        phase, reason = "Succeeded", "AllPodsSucceeded"
        message = f"{len(succeeded)} pod(s) succeeded"
        _cleanup(spec, live, plan, "job succeeded")
        return _finish(job.generation, old, st, plan, phase, reason, message, stamp, now, wakeups)
    finishing = bool(succeeded or rdzv.succeeded_nodes)

    # 4a. the target number of Pods (elastic shrink and grow back)
    target = st.target_replicas if st.target_replicas and not new_generation else spec.replicas
    target = max(spec.min_nodes, min(target, spec.replicas))
    timeout = timedelta(seconds=spec.pending_timeout_seconds)
    last_resize = parse_time(st.last_resize_time)
    if target < spec.replicas and last_resize is not None and not finishing:
        grow_at = last_resize + timeout
        if now >= grow_at:
            plan.events.append(
                Event("Normal", "GrowingBack", f"trying {spec.replicas} pods again (was {target})")
            )
            target, st.last_resize_time = spec.replicas, stamp
            last_resize = now
        else:
            wakeups.append(grow_at)
    stuck, pending_deadlines = [], []
    for pod in by_phase.get("Pending", []):
        deadline = _stuck_at(spec, pod, last_resize)
        if deadline is None:
            continue
        if now >= deadline:
            stuck.append(pod)
        else:
            pending_deadlines.append((pod.name, deadline))
    if stuck and target > spec.min_nodes and not finishing:
        new_target = max(spec.min_nodes, target - len(stuck))
        plan.events.append(
            Event(
                "Warning",
                "Shrinking",
                f"{len(stuck)} pod(s) pending for over {spec.pending_timeout_seconds:g}s "
                f"({', '.join(p.name for p in stuck)}): shrinking from {target} to "
                f"{new_target} pods (minReplicas {spec.min_nodes})",
            )
        )
        target, st.last_resize_time = new_target, stamp
        wakeups.append(now + timeout)
    st.target_replicas = target
    if target == spec.replicas and new_generation:
        st.last_resize_time = None

    # 4b. scale down: delete Pods beyond the target: stuck Pending ones first, then the
    # highest indices
    stuck_names = {p.name for p in stuck}
    candidates = sorted(
        (p for p in live if p.phase != "Succeeded"),
        key=lambda p: (p.name not in stuck_names, -p.index),
    )
    beyond = candidates[: max(0, len(live) - target)]
    for pod in beyond:
        plan.delete.append(DeletePod(pod.name, f"scale down to {target} pods"))
        plan.depart_nodes.append(pod.name)
        if pod.name not in plan.remove_nodes:
            plan.remove_nodes.append(pod.name)
    gone = {p.name for p in beyond}
    wakeups.extend(at for name, at in pending_deadlines if name not in gone)
    if beyond:
        plan.events.append(
            Event(
                "Normal",
                "ScalingDown",
                f"deleting {', '.join(p.name for p in beyond)} (target {target} pods)",
            )
        )

    # 5. replace failed Pods within the budget, with backoff. A failure counted by an
    # earlier pass whose Pod is still there (its deletion failed or is pending) is deleted
    # again without counting it twice.
    waiting = [p for p in failed if p.name not in gone]
    budget = spec.pod_replacement.max_replacements
    next_at: datetime | None = None
    failure_keys = {_failure_key(p, now) for p in failed}
    counted = [k for k in old.counted_failures or [] if k in failure_keys]
    if waiting and not finishing:
        for pod in waiting:
            if _failure_key(pod, now) in counted:
                plan.delete.append(DeletePod(pod.name, REPLACE_REASON))
                continue
            if st.replacements >= budget:
                cause = st.last_failure or failure_of(pod, now)
                phase, reason = "Failed", "ReplacementBudgetSpent"
                message = (
                    f"pod replacement budget spent ({st.replacements}/{budget} replaced); "
                    f"last failure: {cause.pod}: {cause.message}"
                )
                _cleanup(spec, live, plan, "job failed")
                st.next_replacement_time = None
                return _finish(
                    job.generation, old, st, plan, phase, reason, message, stamp, now, wakeups
                )
            failed_at = (pod.trainer.finished_at if pod.trainer else None) or now
            ready_at = failed_at + timedelta(seconds=backoff_seconds(spec, st.replacements))
            if now >= ready_at:
                st.replacements += 1
                counted.append(_failure_key(pod, now))
                plan.delete.append(DeletePod(pod.name, REPLACE_REASON))
                plan.events.append(
                    Event(
                        "Normal",
                        "ReplacingPod",
                        f"replacing failed pod {pod.name} ({st.replacements}/{budget})",
                    )
                )
            else:
                next_at = ready_at if next_at is None else min(next_at, ready_at)
                wakeups.append(ready_at)
    st.next_replacement_time = format_time(next_at) if next_at else None
    st.counted_failures = counted or None

    # 4d. a spec change: replace every Pod built from an older spec, all at once (any
    # Pod change restarts the whole worker group anyway; one at a time would restart it
    # once per Pod). They leave on purpose: no restart is spent.
    current = pod_spec_hash(spec)
    outdated = [
        p
        for p in live
        if p.phase in ACTIVE_PHASES
        and p.spec_hash is not None
        and p.spec_hash != current
        and p.name not in gone
    ]
    if outdated and not finishing:
        for pod in outdated:
            plan.delete.append(DeletePod(pod.name, UPDATE_REASON))
            plan.depart_nodes.append(pod.name)
            if pod.name not in plan.remove_nodes:
                plan.remove_nodes.append(pod.name)
        plan.events.append(
            Event(
                "Normal",
                "UpdatingPods",
                f"spec changed: replacing {', '.join(p.name for p in outdated)}",
            )
        )

    # 4c. create missing Pods at the lowest free indices (a Pod being deleted, or failed
    # and being replaced, keeps its slot until it is gone)
    present = {p.index for p in pods}
    free = (i for i in range(target + len(present)) if i not in present)
    count = 0 if finishing else max(0, target - len(pods))
    missing = [next(free) for _ in range(count)]
    for index in missing:
        name = f"{job.name}-{index}"
        plan.create.append(CreatePod(name, index))
        if st.start_time is not None and name not in plan.remove_nodes:
            plan.remove_nodes.append(name)  # a stale node of a deleted Pod
    if missing:
        names = ", ".join(f"{job.name}-{i}" for i in missing)
        plan.events.append(Event("Normal", "CreatingPods", f"creating {names}"))

    # 7. phase
    replacing = bool(waiting) or (st.start_time is not None and len(running) < spec.min_nodes)
    if finishing:
        phase, reason = "Running", "Finishing"
        message = f"{len(succeeded)} pod(s) succeeded, {len(running)} still running"
    elif replacing and st.start_time is not None:
        phase, reason = "Restarting", "ReplacingPods"
        failing = ", ".join(p.name for p in waiting) or "pods missing"
        message = f"{len(running)}/{spec.min_nodes} required pods running; replacing {failing}"
    elif len(running) >= spec.min_nodes:
        phase, reason = "Running", "PodsRunning"
        message = f"{len(running)} pod(s) running (minReplicas {spec.min_nodes})"
        st.start_time = st.start_time or stamp
    else:
        phase, reason = "Pending", "WaitingForPods"
        message = f"{len(running)}/{spec.min_nodes} required pods running"
    return _finish(job.generation, old, st, plan, phase, reason, message, stamp, now, wakeups)


def _finish(
    generation: int,
    old: ElasticJobStatus,
    st: ElasticJobStatus,
    plan: Plan,
    phase: str,
    reason: str | None,
    message: str | None,
    stamp: str,
    now: datetime,
    wakeups: list[datetime],
) -> Plan:
    st.phase = phase  # type: ignore[assignment]
    if reason is not None:
        _set_conditions(st, phase, reason, message or "", generation, stamp)
    if phase in TERMINAL_PHASES and st.completion_time is None:
        st.completion_time = stamp
    if phase != old.phase:
        kind = "Warning" if phase in ("Failed", "Restarting") else "Normal"
        text = f"{old.phase or 'new'} -> {phase}" + (f": {message}" if message else "")
        plan.events.append(Event(kind, phase, text))
    plan.status = st
    plan.requeue_after = max(0.0, (min(wakeups) - now).total_seconds()) if wakeups else None
    return plan
