"""Which Nodes the job's Pods must avoid (``status.quarantinedNodes``): plain functions over
one reconcile pass, called by :mod:`~kelastic_operator.reconcile` (the Pods the operator
creates afterwards carry a required node-affinity term against them:
:func:`kelastic_operator.placement.avoid_nodes`). A Node is quarantined, once, when:

- a Pod of the job failed its **preflight** check there (its trainer's termination message
  starts with :data:`kelastic.contract.PREFLIGHT_FAILED_PREFIX`): :func:`after_preflight`;
- :data:`HARDWARE_FAILURES` restarts of the job were charged on it (the restart record's
  charges carry the Node their sidecar ran on) for failures whose text looks like the
  hardware's, not the program's (:func:`hardware_looking`: GPU Xid and ECC errors, a GPU
  fallen off the bus, NCCL's and InfiniBand verbs' system errors, a bus error, an I/O
  error): :func:`after_hardware_failures`. The job's Pods still running there are then
  replaced (a departure notice first, so nothing more is charged), as a bad GPU keeps
  failing every restart on it. Two, not one: a single NCCL error can be a peer's fault or
  the network's; the same Node failing twice is the pattern operators quarantine on.
- a straggler's Pod was replaced (:mod:`~kelastic_operator.stragglers`).

At most :data:`~kelastic_operator.model.MAX_QUARANTINED` Nodes, the oldest dropped.
Clearing the list is a status patch (README).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

from kelastic import contract

from .model import MAX_QUARANTINED, ElasticJobStatus
from .reconcile_views import ChargeView, Event, Plan, PodView

__all__ = [
    "HARDWARE_FAILURES",
    "HARDWARE_PATTERNS",
    "REPLACE_QUARANTINED_REASON",
    "add_quarantined",
    "after_hardware_failures",
    "after_preflight",
    "hardware_looking",
]

#: Hardware-looking charges on one Node that quarantine it.
HARDWARE_FAILURES: Final = 2
#: What a hardware failure's text looks like (case-insensitive; searched in the failure's
#: summary, message and stderr tail). Program errors that merely mention CUDA (an illegal
#: address, a device-side assert) are not among them.
HARDWARE_PATTERNS: Final = (
    r"\bXid\b",  # the NVIDIA driver's error report
    r"uncorrectable ECC|double[- ]bit ECC|ECC error",
    r"fallen off the bus|GPU is lost|GPU lost",
    r"cudaErrorECCUncorrectable|CUDA_ERROR_ECC_UNCORRECTABLE|cudaErrorHardwareStackError",
    r"unspecified launch failure",
    r"ncclSystemError|NCCL (WARN|error).*(system error|NET/IB|IB verbs)",
    r"\bibv_\w+ failed|transport retry counter exceeded",
    r"\bBus error\b|\bSIGBUS\b",
    r"Input/output error",
)
_HARDWARE: Final = re.compile("|".join(f"(?:{p})" for p in HARDWARE_PATTERNS), re.IGNORECASE)
#: :class:`DeletePod` reason of a Pod moved off a Node quarantined for hardware failures.
REPLACE_QUARANTINED_REASON = "node quarantined"


def hardware_looking(text: str) -> bool:
    """Whether a failure's text looks like the hardware's fault (:data:`HARDWARE_PATTERNS`)."""
    return _HARDWARE.search(text) is not None


def add_quarantined(st: ElasticJobStatus, node: str) -> bool:
    """Put ``node`` in ``st.quarantinedNodes`` unless it is there (the oldest dropped past
    :data:`MAX_QUARANTINED`). Returns True when it was added."""
    if not node or node in st.quarantined_nodes:
        return False
    st.quarantined_nodes = [*st.quarantined_nodes, node][-MAX_QUARANTINED:]
    return True


def after_preflight(st: ElasticJobStatus, plan: Plan, pod: PodView) -> None:
    """A Pod that failed its preflight check quarantines its Node (with an Event)."""
    message = pod.trainer.message if pod.trainer is not None else ""
    if not message.startswith(contract.PREFLIGHT_FAILED_PREFIX):
        return
    if add_quarantined(st, pod.node_name):
        plan.events.append(Event(
            "Warning", "NodeQuarantined", f"node {pod.node_name}: pod {pod.name} failed its "
            "preflight check; the job's new Pods avoid it",
        ))  # fmt: skip


def after_hardware_failures(
    charges: Sequence[ChargeView],
    pods: Sequence[PodView],
    st: ElasticJobStatus,
    plan: Plan,
    gone: set[str],
) -> None:
    """Quarantine each Node with :data:`HARDWARE_FAILURES` hardware-looking charges (of
    distinct rounds) and replace the job's Pods running there (not those in ``gone``,
    deleted by an earlier rule of the pass): deleted with a departure notice, created
    again by reconcile's rule 4 elsewhere.

    Args:
        charges: the restart record's charges; pods: the job's Pods as observed.
        st: the new status; plan: the pass's plan; gone: Pods already being deleted.
    """
    rounds: dict[str, dict[int, str]] = {}
    for charge in charges:
        if charge.host and hardware_looking(charge.text):
            rounds.setdefault(charge.host, {})[charge.round] = charge.text
    for host, seen in sorted(rounds.items()):
        if len(seen) < HARDWARE_FAILURES or not add_quarantined(st, host):
            continue
        last = seen[max(seen)]
        plan.events.append(Event(
            "Warning", "NodeQuarantined", f"node {host}: {len(seen)} hardware-looking failures "
            f"charged on it (rounds {', '.join(map(str, sorted(seen)))}; the last: "
            f"{last[:300]}); the job's Pods there are replaced and its new Pods avoid it",
        ))  # fmt: skip
        for pod in pods:
            if pod.node_name != host or pod.deleting or pod.name in gone:
                continue
            if pod.phase not in ("Pending", "Running"):
                continue
            plan.depart(pod.name, REPLACE_QUARANTINED_REASON)
            gone.add(pod.name)
