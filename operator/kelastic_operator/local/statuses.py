"""How ``kelastic run`` reads what each sidecar says: its ``/status`` answer while it runs
(:func:`fetch_status`), the status it kept as it exited (:func:`kept_status`,
:mod:`kelastic.last_status`). Both are decoded by :func:`kelastic.last_status.decode_last_status`
(bounded JSON: a port squatted by another process, a torn or crafted file never raises
past here). What is said of them is :mod:`~kelastic_operator.local.progress`'s.
"""

from __future__ import annotations

import http.client
import subprocess
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

from kelastic.last_status import (
    MAX_BYTES,
    LastStatusError,
    decode_last_status,
    read_last_status,
)

from .replicas import Replica

__all__ = [
    "LAST_WORD_TIMEOUT",
    "POLL_TIMEOUT",
    "fetch_status",
    "kept_status",
    "sidecar_status",
    "sidecar_statuses",
]

#: Seconds a poll waits for each sidecar's ``/status`` (the run's loop polls often).
POLL_TIMEOUT: Final = 1.0
#: Seconds the job's last poll waits for each (its last word: said before the job's end).
LAST_WORD_TIMEOUT: Final = 5.0
#: Most sidecars asked at once (a local run has a few Pods; more wait their turn).
MAX_ASKED_AT_ONCE: Final = 16


def fetch_status(pod: Replica, timeout: float = POLL_TIMEOUT) -> dict[str, Any]:
    """The sidecar's ``/status`` document ({} when it does not answer within ``timeout``
    seconds, answers no bounded JSON object, or its answer is cut off: a sidecar exiting
    mid-response raises ``http.client.IncompleteRead``, which is no ``OSError``)."""
    url = f"http://127.0.0.1:{pod.http_port}/status"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return decode_last_status(resp.read(MAX_BYTES + 1), url)
    except (OSError, LastStatusError, http.client.HTTPException):
        return {}


def kept_status(pod: Replica) -> tuple[dict[str, Any], str]:
    """``(document, problem)``: the last status ``pod``'s exited sidecar kept in its run
    dir; ``({}, "")`` when it kept none (no kelastic sidecar, or it died before it could:
    SIGKILL, OOM), ``({}, why)`` when the file cannot be read."""
    run_dir = pod.sidecar_run_dir
    if run_dir is None:
        return {}, ""
    try:
        return read_last_status(run_dir) or {}, ""
    except (OSError, LastStatusError) as exc:
        return {}, (f"the sidecar's last status cannot be read ({exc}); what it said after "
                    "the last poll is not shown")  # fmt: skip


def sidecar_status(pod: Replica, timeout: float, last_word: bool) -> tuple[dict[str, Any], str]:
    """``(document, problem)`` of ``pod``'s kelastic sidecar: its ``/status`` while it
    runs (waiting ``timeout`` seconds), else, with ``last_word``, the status it kept
    (:func:`kept_status`); ``({}, "")`` for no answer, no sidecar or nothing kept.

    With ``last_word``, a sidecar that runs but does not answer is waited for to exit
    (``timeout`` seconds more): one whose job ended on its node stops its HTTP server
    first and keeps its status as it exits (found in a run: the restart that exhausted
    the budget, charged after the loop's last poll, was never said)."""
    if pod.sidecar is None:
        return {}, ""
    if pod.sidecar.proc.poll() is None:
        doc = fetch_status(pod, timeout)
        if doc or not last_word:
            return doc, ""
        try:
            pod.sidecar.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return {}, ""
    return kept_status(pod) if last_word else ({}, "")


def sidecar_statuses(pods: Sequence[Replica], timeout: float, last_word: bool
                     ) -> list[tuple[dict[str, Any], str]]:  # fmt: skip
    """:func:`sidecar_status` of every pod, in ``pods``' order, asked at once (up to
    :data:`MAX_ASKED_AT_ONCE` at a time): a poll costs the slowest sidecar's ``timeout``,
    not the sum of them (asked one after another, three hung sidecars made every poll
    3 s late and the job's last word up to 10 s per Pod)."""
    if len(pods) < 2:
        return [sidecar_status(pod, timeout, last_word) for pod in pods]
    with ThreadPoolExecutor(min(len(pods), MAX_ASKED_AT_ONCE), "kelastic-status") as pool:
        return list(pool.map(lambda pod: sidecar_status(pod, timeout, last_word), pods))
