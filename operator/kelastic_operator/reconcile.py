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
   **Suspended** otherwise while ``spec.suspend`` is true: every Pod that has not
   succeeded is deleted with a departure notice (no restart spent) and none is created;
   the rules below wait until the job is resumed (:mod:`~kelastic_operator.suspend`).
   Likewise while Kueue holds a job labelled ``kueue.x-k8s.io/queue-name`` (not admitted
   yet, or evicted: :attr:`JobView.queue`, :mod:`~kelastic_operator.kueue`); admitted, the
   job keeps ``min(replicas, admitted count)`` Pods (``target`` below never exceeds it).
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
   ``Complete`` and ``Failed`` (added when the job succeeds / fails), ``Suspended``
   (added when the job is suspended; False once resumed). An Event marks each
   phase transition, each failed Pod, each replacement, resize and worker-group restart
   (with the restart record's root cause of the newest, also ``status.lastRestart``, which
   follows the record when a later node amends the charge to name a stopped worker);
   ``status.inProcessRestarts`` and an ``InProcessRestart`` Event mirror the sidecars'
   in-process restart record (:mod:`~kelastic_operator.inprocess_status`);
   ``status.lastHang`` and a ``HangEvidence`` Event say where every node's workers were
   as the newest hung round ended (the sidecars' ``hangs/<node>``, put together by
   :func:`kelastic.hang_where.summarize`: the culprit, where the others waited), again
   each time another node's evidence of that round arrives.
8. Nodes leave rendezvous (their alive keys are deleted) the moment their Pod is seen
   failed (and on every pass until it is gone: deleting a key is idempotent), being
   deleted, gone, or deleted on scale-down. A Pod being deleted that a disruption takes
   (its ``DisruptionTarget`` condition: ``kubectl drain``'s eviction, a preemption, the
   taint manager) has its departure notice posted first (``disruption``: no restart is
   charged, as a Job's ``podFailurePolicy`` ignores them; a ``PodDisrupted`` Event says
   so once); a plain ``kubectl delete pod`` is a fault its peers charge. A Pod created
   under the name of one that departed on purpose (scale-down, spec change, suspend, a
   disruption) has that notice deleted first.
9. A finished job is deleted ``ttlSecondsAfterFinished`` after its ``completionTime``
   (``Plan.delete_job``; :mod:`~kelastic_operator.ttl`), and woken up then.
10. **Lost nodes.** A Pod whose Node has not been Ready for ``nodeLostSeconds``
   (:attr:`PodView.node_not_ready_since`) is lost: its node leaves the rendezvous, it is
   force-deleted (its kubelet would never confirm a graceful deletion, so it would stay
   Terminating and hold its name), its incarnation fenced in etcd first (its sidecar,
   should the Node come back, never joins beside the new Pod of its name), and rule 4
   creates it again elsewhere, spending no
   replacement (its peers' sidecars charge one ``node_lost`` restart, whether its lease ran
   out first or its key went now). Before that nothing is done: a Node the control plane
   cannot hear may still train (it reaches etcd and its peers), and a dead one's rendezvous
   lease runs out on its own, long before. Pods already being deleted on such a Node
   (a replaced failed Pod, a scale-down, a finished job's cleanup) are force-deleted too;
   a Succeeded one is left alone.
11. **Stragglers** (:mod:`~kelastic_operator.stragglers`): ``status.stragglers`` from the
   sidecars' verdicts (those of running Pods, each of the Pod it names), a
   ``StragglerDetected`` Event for each new one and the ``Stragglers`` condition; with
   ``spec.stragglers.action: Replace`` the straggler's Pod is deleted with a departure
   notice (nothing charged) and created again by rule 4, its Node quarantined.
12. **Quarantine** (:mod:`~kelastic_operator.quarantine`): a Node where a Pod failed its
   preflight check, or where two restarts were charged for hardware-looking failures
   (the job's Pods there are then replaced with departure notices), goes to
   ``status.quarantinedNodes``, which the Pods created afterwards avoid.

What it reads and returns (the views of the job, its Pods and the rendezvous; the plan) is
:mod:`kelastic_operator.reconcile_views`, re-exported here.

Over ~400 lines because it is one cohesive thing: the rules above, one function each over
one pass (``_Pass``), applied in order, each reading what the earlier ones decided (the
target a resize set, the Pods already deleted); split, the order they depend on would be
spread over modules. ``tests/operator/test_reconcile.py`` tables them the same way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from kelastic.failure_policy import FailureCause
from kelastic.hang_where import summarize

from .inprocess_status import apply_inprocess
from .kueue import QueueGate
from .labels import selector
from .model import (
    TERMINAL_PHASES,
    Condition,
    ElasticJobSpec,
    ElasticJobStatus,
    LastCheckpoint,
    LastFailure,
    LastHang,
)
from .pods import pod_spec_hash
from .quarantine import after_hardware_failures, after_preflight
from .reconcile_views import (
    ACTIVE_PHASES,
    JOB_FAILED_PREFIX,
    CreatePod,
    DeletePod,
    Event,
    JobView,
    Plan,
    PodView,
    RendezvousView,
    Termination,
    failure_of,
    format_time,
    is_job_failure,
    parse_time,
    pod_view,
)
from .stragglers import apply_stragglers, stragglers_condition
from .suspend import SUSPENDED_PHASE, SUSPENDED_REASON, stop_pods, suspended_condition
from .ttl import apply_ttl

__all__ = [
    "ACTIVE_PHASES",
    "JOB_FAILED_PREFIX",
    "LOST_REASON",
    "REPLACE_REASON",
    "UPDATE_REASON",
    "CreatePod",
    "DeletePod",
    "Event",
    "JobView",
    "Plan",
    "PodView",
    "RendezvousView",
    "Termination",
    "backoff_seconds",
    "failure_of",
    "format_time",
    "is_job_failure",
    "parse_time",
    "pod_view",
    "reconcile",
    "reconcile_invalid",
]

#: :class:`DeletePod` reason of a failed Pod deleted to be replaced (counted as a replacement).
REPLACE_REASON = "replacing a failed pod"
#: :class:`DeletePod` reason of a Pod built from an older spec (rule 4d).
UPDATE_REASON = "pod spec changed"


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
    status: ElasticJobStatus,
    phase: str,
    reason: str,
    message: str,
    generation: int,
    now: str,
    resumed: str | None = None,
) -> None:
    """The conditions of ``metav1.Condition`` (non-empty reason and message, times that move
    only on a change of status, ``observedGeneration``), each saying one thing:

    - ``RendezvousReady``: True while Running with a world size from a complete round
      (reason ``RoundComplete``); False otherwise, with the phase's reason and message;
    - ``Complete`` / ``Failed``: added, True, when the job succeeds / fails (terminal);
    - ``Suspended``: True while suspended (``reason``: ``spec.suspend``'s or Kueue's
      :class:`~kelastic_operator.kueue.QueueReason`), False once resumed (``resumed``: the
      message then, Kueue's admission for a queued job).
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
    held = phase == SUSPENDED_PHASE
    suspended = suspended_condition(old, held, message, generation, now,
                                    reason if held else SUSPENDED_REASON, resumed)  # fmt: skip
    if suspended is not None:
        out.append(suspended)
    slow = stragglers_condition(old, status, generation, now)
    if slow is not None:
        out.append(slow)
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
    plan = apply_ttl(job.spec, _decide(job, pods, now, rendezvous or RendezvousView()), now)
    gone = {d.name for d in plan.delete}
    staying = [p for p in pods if not p.deleting and p.name not in gone]
    plan.status.replicas = len(staying) + len(plan.create)
    plan.status.ready_replicas = sum(1 for p in staying if p.phase == "Running" and p.ready)
    plan.status_changed = plan.status.as_patch() != job.status.as_patch()
    known = set(job.status.quarantined_nodes)
    plan.taint_nodes = [n for n in plan.status.quarantined_nodes if n not in known]
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


@dataclass
class _Pass:
    """One pass of :func:`reconcile`: the inputs, what they say, and the plan being made.

    The rules of the module docstring are functions over it, applied in order by
    :func:`_decide`; each reads what the earlier ones decided (``target``, ``gone``...).
    """

    job: JobView
    now: datetime
    rdzv: RendezvousView
    pods: Sequence[PodView]
    st: ElasticJobStatus
    plan: Plan
    live: list[PodView]
    by_phase: dict[str, list[PodView]]
    wakeups: list[datetime] = field(default_factory=list)
    finishing: bool = False
    target: int = 0
    stuck: list[PodView] = field(default_factory=list)
    gone: set[str] = field(default_factory=set)
    waiting: list[PodView] = field(default_factory=list)
    pending_deadlines: list[tuple[str, datetime]] = field(default_factory=list)

    @property
    def spec(self) -> ElasticJobSpec:
        return self.job.spec

    @property
    def old(self) -> ElasticJobStatus:
        return self.job.status

    @property
    def stamp(self) -> str:
        return format_time(self.now)

    @property
    def running(self) -> list[PodView]:
        return self.by_phase.get("Running", [])

    @property
    def succeeded(self) -> list[PodView]:
        return self.by_phase.get("Succeeded", [])

    @property
    def failed(self) -> list[PodView]:
        return sorted(self.by_phase.get("Failed", []), key=lambda p: p.index)

    @property
    def admitted(self) -> int | None:
        """Pods Kueue's admission allows (None: no Kueue gate on this job)."""
        gate = self.job.queue
        return None if gate is None else gate.admitted

    @property
    def wanted(self) -> int:
        """``replicas``, capped at Kueue's admitted count for a queued job."""
        admitted = self.admitted
        return self.spec.replicas if admitted is None else min(self.spec.replicas, admitted)

    def finish(self, phase: str, reason: str | None, message: str | None) -> Plan:
        resumed = self.job.queue.message if self.job.queue is not None else None
        return _finish(
            self.job.generation, self.old, self.st, self.plan, phase, reason, message,
            self.stamp, self.now, self.wakeups, resumed,
        )  # fmt: skip


#: (phase, reason, message) that ends a pass
_Outcome = tuple[str, str, str]


def _observe(job: JobView, pods: Sequence[PodView], now: datetime, rdzv: RendezvousView) -> _Pass:
    """Start the new status from the old one and what the rendezvous reports."""
    st = job.status.model_copy(deep=True)
    st.selector = selector(job.name)
    if rdzv.round is not None:
        st.round = rdzv.round
    if rdzv.world_size is not None:
        st.world_size = rdzv.world_size
    if rdzv.restarts_spent is not None:
        st.restarts_spent = rdzv.restarts_spent
    st.restarts_spent = st.restarts_spent or 0
    st.replacements = st.replacements or 0
    st.observed_generation = job.generation
    if job.queue is not None:  # a queued job says what Kueue admitted (0: nothing yet)
        st.admitted_replicas = job.queue.admitted or 0
    live = [p for p in pods if not p.deleting]
    by_phase: dict[str, list[PodView]] = {}
    for pod in live:
        by_phase.setdefault(pod.phase, []).append(pod)
    return _Pass(job, now, rdzv, pods, st, Plan(status=st), live, by_phase)


#: :class:`DeletePod` reason of a Pod force-deleted because its Node is lost (rule 10).
LOST_REASON = "node lost"


def _lost_nodes(p: _Pass, terminal: bool) -> None:
    """Rule 10: force-delete the Pods of Nodes not Ready for ``nodeLostSeconds``; a lost
    Pod that still ran leaves the rendezvous and is recorded as the last failure, once.
    In a finished job only the Pods already being deleted."""
    patience = timedelta(seconds=p.spec.node_lost_seconds)
    for pod in sorted(p.pods, key=lambda x: x.index):
        since = pod.node_not_ready_since
        running = pod.phase in ACTIVE_PHASES
        if since is None or not (pod.deleting or (running and not terminal)):
            continue
        lost_at = since + patience
        if p.now < lost_at:
            p.wakeups.append(lost_at)
            continue
        p.plan.delete.append(DeletePod(pod.name, LOST_REASON, force=True))
        if not running or terminal:
            continue
        if pod.name not in p.plan.remove_nodes:
            p.plan.remove_nodes.append(pod.name)
        if pod.uid:
            p.plan.fence.append((pod.uid, f"node {pod.node_name} lost"))
        waited = (p.now - since).total_seconds()
        message = (
            f"{FailureCause.NODE_LOST.value}: node {pod.node_name} not Ready since "
            f"{format_time(since)} ({waited:.0f}s, nodeLostSeconds "
            f"{p.spec.node_lost_seconds:g}): pod {pod.name} force-deleted and replaced"
        )
        failure = LastFailure(pod=pod.name, message=message, time=format_time(lost_at))
        if _is_newer(failure, p.st.last_failure):
            p.st.last_failure = failure
        p.plan.events.append(Event("Warning", "PodLost", message))


def _note_failures(p: _Pass) -> None:
    """Rule 8 and the announcements: failed and deleted Pods' nodes leave the rendezvous
    (every pass until the Pod is gone: idempotent); a new failure (newest last) is recorded
    and announced once; worker-group restarts the sidecars spent are announced, and the
    in-process restarts recorded (:func:`~kelastic_operator.inprocess_status.apply_inprocess`)."""
    for pod in sorted(p.failed, key=lambda x: (failure_of(x, p.now).time or "", x.index)):
        failure = failure_of(pod, p.now)
        p.plan.remove_nodes.append(pod.name)
        if _is_newer(failure, p.st.last_failure):
            p.st.last_failure = failure
            p.plan.events.append(
                Event("Warning", "PodFailed", f"pod {pod.name} failed: {failure.message}")
            )
        after_preflight(p.st, p.plan, pod)  # its Node quarantined
    # Pods being deleted leave rendezvous at once (their sidecars may not get to say so);
    # one a disruption takes (drain, preemption) with a departure notice first
    for pod in p.pods:
        if not pod.deleting or pod.phase not in ACTIVE_PHASES:
            continue
        if pod.disruption and pod.name not in p.plan.depart_nodes + p.plan.disrupted_nodes:
            p.plan.disrupted_nodes.append(pod.name)
            if pod.name not in p.rdzv.departing:
                p.plan.events.append(Event("Normal", "PodDisrupted", f"pod {pod.name} is "
                    f"taken by {pod.disruption}: its node leaves the rendezvous, no restart "
                    "charged"))  # fmt: skip
        if pod.name not in p.plan.remove_nodes:
            p.plan.remove_nodes.append(pod.name)
    spent_before = p.old.restarts_spent or 0
    spent = p.rdzv.restarts_spent
    if spent is not None and spent > spent_before:
        round_ = p.rdzv.round if p.rdzv.round is not None else "?"
        last = p.rdzv.last_restart
        cause = f": {last.message}" if last is not None else ""
        p.plan.events.append(
            Event("Warning", "WorkersRestarted", f"worker group restarted: {spent}/"
                  f"{p.spec.max_restarts} restarts spent (round {round_}){cause}")
        )  # fmt: skip
    if p.rdzv.last_restart is not None:  # amended in place when a stopped worker is found
        p.st.last_restart = p.rdzv.last_restart
    inprocess = apply_inprocess(p.spec, p.old, p.st, p.rdzv.inprocess)
    if inprocess is not None:
        p.plan.events.append(inprocess)
    _note_hang(p)
    _note_checkpoint(p)


def _note_checkpoint(p: _Pass) -> None:
    """``status.lastCheckpoint``: what the current round's workers restored from the
    in-memory checkpoints (nothing when no node recorded a step: a fresh start, or a job
    without them); a ``CheckpointNotRestored`` Warning, once per round, when some rank
    held a step but the ranks have none in common (the workers start without one).

    A round's step and tier are the ones its sidecars agreed on: what its nodes say their
    workers loaded (``checkpoint-loads``) when any did, else what the records gave when
    this operator first saw the round complete. A node writes its record again once the
    round's workers stopped (before it joins the next round), with the steps the round
    saved; computed again from those, the status would name a step nobody restored (found
    on real nodes: ``round 2, memory 2771`` where the workers had agreed on none)."""
    restore = p.rdzv.restore
    if restore is None or not (restore.held or restore.step is not None):
        return
    old = p.st.last_checkpoint
    when = datetime.fromtimestamp(restore.time, timezone.utc) if restore.time > 0 else None
    step, tier = restore.step, restore.tier.value
    stamp = format_time(when) if when is not None else None
    if old is not None and old.round == restore.round:
        step, tier, stamp = old.step, old.tier, old.time  # as agreed when the round began
    said = Counter((d.step, d.tier) for d in p.rdzv.loads.values() if d.round == restore.round)
    if said:
        step, tier = said.most_common(1)[0][0]  # one value unless a record was crafted
    loads = [d for d in p.rdzv.loads.values() if (d.round, d.step) == (restore.round, step)]
    p.st.last_checkpoint = LastCheckpoint(
        round=restore.round, step=step, tier=tier, time=stamp,
        loadedRanks=sum(d.ranks for d in loads) if loads else None,
        loadSeconds=round(max(d.seconds for d in loads), 4) if loads else None,
    )  # fmt: skip
    if step is None and (old is None or old.round != restore.round):
        p.plan.events.append(Event(
            "Warning", "CheckpointNotRestored",
            f"round {restore.round}: no checkpoint step every one of its {restore.ranks} "
            "ranks holds: the workers start without one",
        ))  # fmt: skip


def _note_hang(p: _Pass) -> None:
    """Rule 7's ``status.lastHang``: the newest hung round's evidence from every node that
    reported it, summarised; a ``HangEvidence`` Event when it changed (a newer round, or
    more nodes of the same one)."""
    if not p.rdzv.hangs:
        return
    newest = max(h.round for h in p.rdzv.hangs)
    nodes = sum(1 for h in p.rdzv.hangs if h.round == newest)
    old = p.st.last_hang
    if old is not None and (old.round, old.nodes) >= (newest, nodes):
        return
    message = summarize(p.rdzv.hangs)
    p.st.last_hang = LastHang(round=newest, nodes=nodes, message=message, time=p.stamp)
    p.plan.events.append(Event("Warning", "HangEvidence", message))


def _job_failed(p: _Pass) -> _Outcome | None:
    """Rule 2: a Pod's trainer, or a sidecar's report, says the whole job failed."""
    fatal = [x for x in p.failed if is_job_failure(x)]
    if not fatal and not p.rdzv.failed_reports:
        return None
    if fatal:
        cause = failure_of(fatal[0], p.now)
        p.st.last_failure = cause
        message = cause.message
    else:
        node, message = sorted(p.rdzv.failed_reports.items())[0]
        p.st.last_failure = LastFailure(pod=node, message=message, time=p.stamp)
    _cleanup(p.spec, p.live, p.plan, "job failed")
    return "Failed", "JobFailed", message


def _job_succeeded(p: _Pass) -> _Outcome | None:
    """Rule 3: some Pod succeeded and none still runs. (Some succeeded and some still run:
    the job is finishing, which later rules respect.)"""
    p.finishing = bool(p.succeeded or p.rdzv.succeeded_nodes)
    if not p.finishing or p.running:
        return None
    _cleanup(p.spec, p.live, p.plan, "job succeeded")
    return "Succeeded", "AllPodsSucceeded", f"{len(p.succeeded)} pod(s) succeeded"


def _suspend(p: _Pass, gate: QueueGate | None = None) -> _Outcome:
    """Rule 3 (suspended): stop every Pod that has not succeeded, with departure notices;
    ``startTime`` is cleared (set again when the resumed job runs, as batch/v1 resets it on
    resume) and so is the replacement backoff (the failed Pods go too, uncounted).
    ``gate``: Kueue holds the job (not admitted yet, or evicted) rather than
    ``spec.suspend``; its target is forgotten too (the next admission's count sets it)."""
    if gate is not None:
        message = stop_pods(p.pods, p.plan, f"Kueue: {gate.message}", "held by Kueue")
        p.st.target_replicas = None
        p.st.last_resize_time = None
        outcome: _Outcome = (SUSPENDED_PHASE, gate.reason.value, f"{gate.message} ({message})")
    else:
        message = stop_pods(p.pods, p.plan)
        outcome = SUSPENDED_PHASE, SUSPENDED_REASON, message
    p.st.stragglers = []  # no Pod runs to be slow
    p.st.start_time = None
    p.st.next_replacement_time = None
    p.st.counted_failures = None
    return outcome


def _resize(p: _Pass) -> None:
    """Rule 6: stuck Pending Pods shrink ``target`` towards ``minReplicas``; one timeout
    after the last resize it grows back; a new generation resets it."""
    spec, st, now, wanted = p.spec, p.st, p.now, p.wanted
    new_generation = p.old.observed_generation != p.job.generation
    target = st.target_replicas if st.target_replicas and not new_generation else wanted
    target = min(wanted, max(spec.min_nodes, min(target, wanted)))
    timeout = timedelta(seconds=spec.pending_timeout_seconds)
    last_resize = parse_time(st.last_resize_time)
    if target < wanted and last_resize is not None and not p.finishing:
        grow_at = last_resize + timeout
        if now >= grow_at:
            p.plan.events.append(
                Event("Normal", "GrowingBack", f"trying {wanted} pods again (was {target})")
            )
            target, st.last_resize_time = wanted, p.stamp
            last_resize = now
        else:
            p.wakeups.append(grow_at)
    for pod in p.by_phase.get("Pending", []):
        deadline = _stuck_at(spec, pod, last_resize)
        if deadline is None:
            continue
        if now >= deadline:
            p.stuck.append(pod)
        else:
            p.pending_deadlines.append((pod.name, deadline))
    if p.stuck and target > spec.min_nodes and not p.finishing:
        new_target = max(spec.min_nodes, target - len(p.stuck))
        stuck_names = ", ".join(x.name for x in p.stuck)
        p.plan.events.append(
            Event("Warning", "Shrinking", f"{len(p.stuck)} pod(s) pending for over "
                  f"{spec.pending_timeout_seconds:g}s ({stuck_names}): shrinking from {target} "
                  f"to {new_target} pods (minReplicas {spec.min_nodes})")
        )  # fmt: skip
        target, st.last_resize_time = new_target, p.stamp
        p.wakeups.append(now + timeout)
    st.target_replicas = p.target = target
    if target == wanted and new_generation:
        st.last_resize_time = None


def _scale_down(p: _Pass) -> None:
    """Rule 4 (beyond the target): delete Pods beyond ``target``, stuck Pending ones first,
    then the highest indices; their nodes depart the rendezvous at once."""
    stuck_names = {x.name for x in p.stuck}
    candidates = sorted(
        (x for x in p.live if x.phase != "Succeeded"),
        key=lambda x: (x.name not in stuck_names, -x.index),
    )
    beyond = candidates[: max(0, len(p.live) - p.target)]
    for pod in beyond:
        p.plan.delete.append(DeletePod(pod.name, f"scale down to {p.target} pods"))
        p.plan.depart_nodes.append(pod.name)
        if pod.name not in p.plan.remove_nodes:
            p.plan.remove_nodes.append(pod.name)
    p.gone = {x.name for x in beyond}
    p.wakeups.extend(at for name, at in p.pending_deadlines if name not in p.gone)
    if beyond:
        names = ", ".join(x.name for x in beyond)
        p.plan.events.append(
            Event("Normal", "ScalingDown", f"deleting {names} (target {p.target} pods)")
        )


def _replace_failed(p: _Pass) -> _Outcome | None:
    """Rule 5: replace failed Pods within the budget, with backoff; the budget spent fails
    the job. A failure counted by an earlier pass whose Pod is still there (its deletion
    failed or is pending) is deleted again without counting it twice."""
    spec, st, now = p.spec, p.st, p.now
    p.waiting = [x for x in p.failed if x.name not in p.gone]
    budget = spec.pod_replacement.max_replacements
    replaced = st.replacements or 0
    next_at: datetime | None = None
    failure_keys = {_failure_key(x, now) for x in p.failed}
    counted = [k for k in p.old.counted_failures or [] if k in failure_keys]
    for pod in p.waiting if not p.finishing else []:
        if _failure_key(pod, now) in counted:
            p.plan.delete.append(DeletePod(pod.name, REPLACE_REASON))
            continue
        if replaced >= budget:
            cause = st.last_failure or failure_of(pod, now)
            _cleanup(spec, p.live, p.plan, "job failed")
            st.next_replacement_time = None
            return "Failed", "ReplacementBudgetSpent", (
                f"pod replacement budget spent ({replaced}/{budget} replaced); "
                f"last failure: {cause.pod}: {cause.message}"
            )  # fmt: skip
        failed_at = (pod.trainer.finished_at if pod.trainer else None) or now
        ready_at = failed_at + timedelta(seconds=backoff_seconds(spec, replaced))
        if now >= ready_at:
            replaced = st.replacements = replaced + 1
            counted.append(_failure_key(pod, now))
            p.plan.delete.append(DeletePod(pod.name, REPLACE_REASON))
            p.plan.events.append(
                Event("Normal", "ReplacingPod",
                      f"replacing failed pod {pod.name} ({replaced}/{budget})")
            )  # fmt: skip
        else:
            next_at = ready_at if next_at is None else min(next_at, ready_at)
            p.wakeups.append(ready_at)
    st.next_replacement_time = format_time(next_at) if next_at else None
    st.counted_failures = counted or None
    return None


def _replace_outdated(p: _Pass) -> None:
    """Rule 4 (a spec change): replace every Pod built from an older spec, all at once (any
    Pod change restarts the whole worker group anyway; one at a time would restart it once
    per Pod). They leave on purpose: no restart is spent."""
    if p.finishing:
        return
    current = pod_spec_hash(p.spec)
    outdated = [
        x for x in p.live
        if x.phase in ACTIVE_PHASES and x.spec_hash is not None and x.spec_hash != current
        and x.name not in p.gone
    ]  # fmt: skip
    if not outdated:
        return
    for pod in outdated:
        p.plan.delete.append(DeletePod(pod.name, UPDATE_REASON))
        p.plan.depart_nodes.append(pod.name)
        if pod.name not in p.plan.remove_nodes:
            p.plan.remove_nodes.append(pod.name)
    names = ", ".join(x.name for x in outdated)
    p.plan.events.append(Event("Normal", "UpdatingPods", f"spec changed: replacing {names}"))


def _create_missing(p: _Pass) -> None:
    """Rule 4 (below the target): create missing Pods at the lowest free indices (a Pod
    being deleted, or failed and being replaced, keeps its slot until it is gone)."""
    present = {x.index for x in p.pods}
    free = (i for i in range(p.target + len(present)) if i not in present)
    count = 0 if p.finishing else max(0, p.target - len(p.pods))
    missing = [next(free) for _ in range(count)]
    for index in missing:
        name = f"{p.job.name}-{index}"
        p.plan.create.append(CreatePod(name, index))
        if p.st.start_time is not None and name not in p.plan.remove_nodes:
            p.plan.remove_nodes.append(name)  # a stale node of a deleted Pod
        if name in p.rdzv.departing:  # the earlier Pod's notice must not cover this one
            p.plan.clear_departures.append(name)
    if missing:
        names = ", ".join(f"{p.job.name}-{i}" for i in missing)
        p.plan.events.append(Event("Normal", "CreatingPods", f"creating {names}"))


def _phase(p: _Pass) -> _Outcome:
    """Rule 7: the phase otherwise."""
    spec, st, running = p.spec, p.st, p.running
    replacing = bool(p.waiting) or (st.start_time is not None and len(running) < spec.min_nodes)
    if p.finishing:
        return "Running", "Finishing", (
            f"{len(p.succeeded)} pod(s) succeeded, {len(running)} still running"
        )  # fmt: skip
    if replacing and st.start_time is not None:
        failing = ", ".join(x.name for x in p.waiting) or "pods missing"
        return "Restarting", "ReplacingPods", (
            f"{len(running)}/{spec.min_nodes} required pods running; replacing {failing}"
        )  # fmt: skip
    if len(running) >= spec.min_nodes:
        st.start_time = st.start_time or p.stamp
        capped = p.admitted is not None and p.admitted < spec.replicas
        note = f"; Kueue admitted {p.admitted} of the {spec.replicas} wanted" if capped else ""
        return "Running", "PodsRunning", (
            f"{len(running)} pod(s) running (minReplicas {spec.min_nodes}){note}"
        )  # fmt: skip
    return "Pending", "WaitingForPods", f"{len(running)}/{spec.min_nodes} required pods running"


def _decide(job: JobView, pods: Sequence[PodView], now: datetime, rdzv: RendezvousView) -> Plan:
    """The rules of the module docstring, in order."""
    p = _observe(job, pods, now, rdzv)
    phase = p.old.phase or "Pending"
    _lost_nodes(p, terminal=phase in TERMINAL_PHASES)
    if phase in TERMINAL_PHASES:  # rule 1: only clean up
        _cleanup(p.spec, p.live, p.plan, f"job {phase.lower()}")
        p.st.stragglers = []
        return p.finish(phase, None, None)
    _note_failures(p)
    for ending in (_job_failed, _job_succeeded):
        outcome = ending(p)
        if outcome is not None:
            return p.finish(*outcome)
    if p.spec.suspend:
        return p.finish(*_suspend(p))
    if p.job.queue is not None and p.job.queue.admitted is None:  # Kueue holds it
        return p.finish(*_suspend(p, p.job.queue))
    _resize(p)
    _scale_down(p)
    outcome = _replace_failed(p)
    if outcome is not None:
        return p.finish(*outcome)
    _replace_outdated(p)
    if not p.finishing:  # rules 11 and 12
        apply_stragglers(p.spec, p.pods, p.rdzv.stragglers, p.st, p.plan, p.gone)
        after_hardware_failures(p.rdzv.charges, p.pods, p.st, p.plan, p.gone)
    _create_missing(p)
    return p.finish(*_phase(p))


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
    resumed: str | None = None,
) -> Plan:
    st.phase = phase  # type: ignore[assignment]
    if reason is not None:
        _set_conditions(st, phase, reason, message or "", generation, stamp, resumed)
    if phase in TERMINAL_PHASES and st.completion_time is None:
        st.completion_time = stamp
    if phase != old.phase:
        kind = "Warning" if phase in ("Failed", "Restarting") else "Normal"
        text = f"{old.phase or 'new'} -> {phase}" + (f": {message}" if message else "")
        plan.events.append(Event(kind, phase, text))
    plan.status = st
    plan.requeue_after = max(0.0, (min(wakeups) - now).total_seconds()) if wakeups else None
    return plan
