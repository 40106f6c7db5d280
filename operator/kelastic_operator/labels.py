"""Labels and names the operator puts on a job's Pods, and the selector that finds them."""

from __future__ import annotations

import re

#: Label holding the ElasticJob's name on each of its Pods.
LABEL_JOB = "kelastic.dev/job-name"
#: Label holding the Pod's replica index (``<job>-<index>``).
LABEL_INDEX = "kelastic.dev/replica-index"
#: Label holding the ElasticJob's uid (tells reruns of a same-named job apart).
LABEL_UID = "kelastic.dev/job-uid"
#: Annotation holding :func:`~kelastic_operator.pods.pod_spec_hash` of the spec a Pod was
#: built from: a Pod whose hash differs from the job's is replaced (spec change).
ANNOTATION_SPEC_HASH = "kelastic.dev/pod-spec-hash"
#: The kelastic sidecar's container name (a native sidecar: an init container).
SIDECAR_CONTAINER = "kelastic-sidecar"


def pod_name(job: str, index: int) -> str:
    """``<job>-<index>``: the Pod name, also the node's name in rendezvous.

    Raises:
        ValueError: ``index`` is negative.
    """
    if index < 0:
        raise ValueError(f"replica index must be >= 0, got {index}")
    return f"{job}-{index}"


def pod_index(job: str, name: str) -> int | None:
    """The replica index in a Pod name ``<job>-<index>``, or None if it is not one."""
    match = re.fullmatch(re.escape(job) + r"-(0|[1-9][0-9]*)", name)
    return int(match.group(1)) if match else None


def selector(job: str) -> str:
    """The label selector of a job's Pods (``status.selector``, the scale subresource's)."""
    return f"{LABEL_JOB}={job}"
