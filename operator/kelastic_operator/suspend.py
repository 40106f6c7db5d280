"""``spec.suspend``: a suspended job has no Pods (pure functions).

batch/v1 Job's meaning (``spec.suspend``, KEP-2232): while the field is true the job runs
no Pods. Setting it on a running job stops its Pods: each is deleted with its grace period
(the sidecar and the workers get SIGTERM and the grace to save their state), and each
node's departure notice (:data:`kelastic.contract.DEPARTURE_SCALE_DOWN`, the notice a
scale-down posts) is written to the rendezvous first, so its peers re-rendezvous without
spending the restart budget. Setting it back to false creates the Pods again (rule 4 of
:mod:`kelastic_operator.reconcile`, once the stopped ones are gone) and the workers resume
from the newest checkpoint the training script finds.

Status while suspended: ``phase`` Suspended, the condition ``Suspended`` True (reason
:data:`SUSPENDED_REASON`); resumed, the condition stays, False (reason
:data:`RESUMED_REASON`), as Job's does. ``startTime`` is cleared on suspension and set
again when the resumed job runs (at least ``minReplicas`` Pods Running): batch/v1 resets it
on resume too. A finished job (Succeeded, Failed) ignores the field, as batch/v1 does; a
job some of whose Pods already succeeded stops its other Pods and then succeeds.

:func:`stop_pods` adds the suspension's deletions to a pass's
:class:`~kelastic_operator.reconcile_views.Plan`; :func:`suspended_condition` is the
condition a pass writes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .model import Condition
from .reconcile_views import DeletePod, Event, Plan, PodView

__all__ = [
    "RESUMED_REASON",
    "SUSPENDED_CONDITION",
    "SUSPENDED_PHASE",
    "SUSPENDED_REASON",
    "SUSPEND_DELETE_REASON",
    "stop_pods",
    "suspended_condition",
]

#: ``status.phase`` of a job whose ``spec.suspend`` is true.
SUSPENDED_PHASE = "Suspended"
#: The condition type (batch/v1 Job's ``Suspended``).
SUSPENDED_CONDITION = "Suspended"
#: Reason of the condition while suspended (batch/v1's ``JobSuspended``).
SUSPENDED_REASON = "JobSuspended"
#: Reason of the condition once resumed (batch/v1's ``JobResumed``).
RESUMED_REASON = "JobResumed"
#: :class:`~kelastic_operator.reconcile_views.DeletePod` reason of a Pod stopped by it.
SUSPEND_DELETE_REASON = "job suspended"


def stop_pods(
    pods: Sequence[PodView],
    plan: Plan,
    cause: str = "spec.suspend",
    state: str = "the job is suspended",
) -> str:
    """Stop the Pods of a suspended job: add to ``plan`` (in place) a deletion of each Pod
    not already being deleted and not Succeeded (a succeeded Pod stays: it says the job
    finished), highest index first, its node's departure notice (``depart_nodes``) and
    its removal from the rendezvous (``remove_nodes``), and one ``Suspending`` Event.

    Args:
        pods: the job's Pods as observed (Pods being deleted are skipped).
        plan: the pass's plan.
        cause: what stops them (the Event's prefix: ``spec.suspend``, or Kueue's hold).
        state: the returned message's prefix.

    Returns:
        The status message: how many Pods are being stopped, or that none is left.
    """
    stopping = sorted(
        (x for x in pods if not x.deleting and x.phase != "Succeeded"), key=lambda x: -x.index
    )
    for pod in stopping:
        if pod.name not in {d.name for d in plan.delete}:
            plan.delete.append(DeletePod(pod.name, SUSPEND_DELETE_REASON))
        if pod.name not in plan.depart_nodes:
            plan.depart_nodes.append(pod.name)
        if pod.name not in plan.remove_nodes:
            plan.remove_nodes.append(pod.name)
    if stopping:
        names = ", ".join(x.name for x in stopping)
        plan.events.append(Event("Normal", "Suspending", f"{cause}: stopping {names}"))
    terminating = sum(1 for x in pods if x.deleting) + len(stopping)
    if terminating:
        return f"{state}: {terminating} pod(s) stopping"
    return f"{state}: no pods"


def suspended_condition(
    old: Mapping[str, Condition],
    suspended: bool,
    message: str,
    generation: int,
    now: str,
    reason: str = SUSPENDED_REASON,
    resumed: str | None = None,
) -> Condition | None:
    """The ``Suspended`` condition of a pass (``metav1.Condition``; its transition time
    moves only when its status does).

    Args:
        old: the job's current conditions by type.
        suspended: whether the job is suspended now (phase Suspended).
        message: the status message while suspended.
        generation: ``metadata.generation``; now: the pass's time (RFC 3339).
        reason: the reason while suspended (Kueue's hold gives its own,
            :class:`~kelastic_operator.kueue.QueueReason`).
        resumed: the message once resumed (default: ``spec.suspend``'s).

    Returns:
        True with ``reason`` (:data:`SUSPENDED_REASON`) while suspended; False with
        :data:`RESUMED_REASON` once resumed; None for a job never suspended (no condition).
    """
    prev = old.get(SUSPENDED_CONDITION)
    if not suspended and prev is None:
        return None
    flag = "True" if suspended else "False"
    changed = prev is None or prev.status != flag
    return Condition(
        type=SUSPENDED_CONDITION,
        status=flag,  # type: ignore[arg-type]
        reason=reason if suspended else RESUMED_REASON,
        message=message if suspended else resumed or "the job was resumed (spec.suspend false)",
        lastTransitionTime=now if changed or prev is None else prev.last_transition_time,
        observedGeneration=generation,
    )
