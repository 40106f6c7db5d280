"""Stragglers in the job's status, and their Pods replaced when ``spec.stragglers.action``
says ``Replace``: plain functions over one reconcile pass (called by
:mod:`~kelastic_operator.reconcile`, as :mod:`~kelastic_operator.suspend` and
:mod:`~kelastic_operator.ttl` are).

Each node's sidecar judges its own ranks' step times and writes its stragglers now to
etcd when an episode begins or ends (:mod:`kelastic.etcd_values.stragglers`); the
rendezvous view carries them (:class:`~kelastic_operator.reconcile_views.StragglerView`).
A verdict of an earlier Pod of the same name is ignored (its ``pod_uid`` is not the Pod's;
without one, from a sidecar that does not know it, when it is not at least
:data:`MARGIN` after the Pod's creation, which the API gives to the second), as is one of
a Pod that is not running.

- :func:`apply_stragglers`: ``status.stragglers`` (the highest ratios first, at most
  :data:`~kelastic_operator.model.MAX_STRAGGLERS_SHOWN`), a ``StragglerDetected`` Event
  for each new one; with ``Replace``, each straggler's Pod is deleted with a departure
  notice (its peers re-form charging nothing, as for a scale-down), created again by
  reconcile's rule 4, and its Node quarantined (``status.quarantinedNodes``): a slow GPU
  or link stays slow, and the replacement must not land on it again.
- :func:`stragglers_condition`: the ``Stragglers`` condition (added once a straggler was
  seen; True while there is one).

Why ``Replace`` replaces at once rather than at the job's next restart: a straggler slows
every rank of a synchronous job for as long as it stays (the fast ones wait in each
collective), and a restart may never come; the replacement costs one round change, which
spends no restart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta

from .model import (
    MAX_STRAGGLERS_SHOWN,
    Condition,
    ElasticJobSpec,
    ElasticJobStatus,
    StragglerStatus,
)
from .quarantine import add_quarantined
from .reconcile_views import Event, Plan, PodView, StragglerView, format_time

__all__ = [
    "REPLACE_STRAGGLER_REASON",
    "STRAGGLERS_CONDITION",
    "apply_stragglers",
    "stragglers_condition",
]

#: The condition's type.
STRAGGLERS_CONDITION = "Stragglers"
#: :class:`DeletePod` reason of a straggler's Pod replaced.
REPLACE_STRAGGLER_REASON = "straggler replaced"


#: How long after a Pod's creation a verdict without a ``pod_uid`` must be taken to count
#: as the Pod's: its ``creationTimestamp`` is given to the second, and a straggler needs
#: its first steps (minutes, not seconds, after the Pod's creation).
MARGIN = timedelta(seconds=2)


def _is_its(view: StragglerView, pod: PodView) -> bool:
    if view.pod_uid and pod.uid:
        return view.pod_uid == pod.uid
    return pod.created is None or view.since >= pod.created + MARGIN


def _current(pods: Sequence[PodView], found: Sequence[StragglerView]) -> list[StragglerView]:
    """The verdicts about running Pods, each of the Pod it names (:func:`_is_its`)."""
    running = {p.name: p for p in pods if p.phase == "Running" and not p.deleting}
    out = []
    for view in found:
        pod = running.get(view.node)
        if pod is not None and _is_its(view, pod):
            out.append(view)
    return sorted(out, key=lambda v: (-v.ratio, v.node, v.local_rank))[:MAX_STRAGGLERS_SHOWN]


def apply_stragglers(
    spec: ElasticJobSpec,
    pods: Sequence[PodView],
    found: Sequence[StragglerView],
    st: ElasticJobStatus,
    plan: Plan,
    gone: set[str],
) -> None:
    """Set ``st.stragglers`` from ``found`` (the rendezvous view's verdicts) and add to
    ``plan`` (in place) an Event per new straggler and, with ``Replace``, the deletion,
    departure notice and rendezvous removal of each straggler's Pod (not those in ``gone``:
    deleted by an earlier rule of the pass) and its Node's quarantine.

    Args:
        spec: the job's spec; pods: its Pods as observed; found: the sidecars' verdicts.
        st: the new status (its ``stragglers`` and ``quarantinedNodes`` are written).
        plan: the pass's plan; gone: Pods an earlier rule deletes.
    """
    current = _current(pods, found)
    known = {(s.pod, s.local_rank, s.scope) for s in st.stragglers}
    st.stragglers = [
        StragglerStatus(
            pod=v.node,
            localRank=v.local_rank,
            scope=v.scope,
            medianSeconds=v.median_s,
            ratio=v.ratio,
            since=format_time(v.since),
        )
        for v in current
    ]
    for v in current:
        if (v.node, v.local_rank, v.scope) not in known:
            plan.events.append(Event("Warning", "StragglerDetected", v.describe()))
    if spec.stragglers.action != "Replace":
        return
    nodes = {p.name: p.node_name for p in pods}
    for name in sorted({v.node for v in current} - gone):
        plan.depart(name, REPLACE_STRAGGLER_REASON)
        gone.add(name)
        node = nodes.get(name, "")
        add_quarantined(st, node)
        plan.events.append(Event(
            "Normal", "ReplacingStraggler",
            f"replacing {name} (spec.stragglers.action Replace)"
            + (f"; its node {node} quarantined" if node else ""),
        ))  # fmt: skip


def stragglers_condition(
    old: Mapping[str, Condition], st: ElasticJobStatus, generation: int, now: str
) -> Condition | None:
    """The ``Stragglers`` condition (``metav1.Condition``: its transition time moves only
    when its status does): True with ``StragglersDetected`` while ``st.stragglers`` has
    one (the message names the slowest), False with ``NoStragglers`` after; None for a
    job that never had one (no condition)."""
    prev = old.get(STRAGGLERS_CONDITION)
    if not st.stragglers and prev is None:
        return None
    flag = "True" if st.stragglers else "False"
    changed = prev is None or prev.status != flag
    if st.stragglers:
        worst = st.stragglers[0]
        message = (f"{len(st.stragglers)} straggler(s); slowest: local rank {worst.local_rank} "
                   f"on {worst.pod}, {worst.ratio:.2f}x its node's other ranks")  # fmt: skip
    else:
        message = "no rank is slower than its node's others by spec.stragglers.factor"
    return Condition(
        type=STRAGGLERS_CONDITION,
        status=flag,  # type: ignore[arg-type]
        reason="StragglersDetected" if st.stragglers else "NoStragglers",
        message=message,
        lastTransitionTime=now if changed or prev is None else prev.last_transition_time,
        observedGeneration=generation,
    )
