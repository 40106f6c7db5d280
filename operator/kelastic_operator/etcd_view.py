"""What a job's etcd keys say, as the operator reads them: the pure parsing of one range
read of the job's prefix into a :class:`~kelastic_operator.reconcile_views.RendezvousView`
(:func:`view_from_keys`), each value by its one codec (:mod:`kelastic.etcd_values`,
:mod:`kelastic_operator.inprocess_record`), and which keys a change of wakes the job
(:func:`status_keys`). No I/O: :mod:`~kelastic_operator.rendezvous_store` reads the keys.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from functools import partial
from typing import TypeVar

from kelastic import contract, etcd_values
from kelastic.etcd_values import ReportOutcome
from kelastic.etcd_values.checkpoints import (
    CheckpointsDoc,
    Restore,
    decode_checkpoints,
    restore_of,
)
from kelastic.etcd_values.loads import LoadDoc, decode_load

from .inprocess_record import decode_record
from .model import LastRestart
from .reconcile_views import JOB_FAILED_PREFIX, ChargeView, RendezvousView, StragglerView

__all__ = ["MAX_RESTART_SUMMARY", "status_keys", "view_from_keys"]

_Doc = TypeVar("_Doc")


def status_keys(prefix: str) -> list[str]:
    """The keys (or prefixes ending in ``/``) under ``prefix`` that
    :func:`view_from_keys` reads: a change of any of them may change the job's status."""
    keys = contract.Keys(prefix)
    return [
        keys.rdzv_state,
        keys.restarts,
        keys.reports_prefix,
        keys.inprocess_iteration,
        keys.hangs_prefix,
        keys.stragglers_prefix,
        keys.checkpoints_prefix,
        keys.checkpoint_loads_prefix,
    ]


def _read(decode: Callable[[bytes], _Doc], raw: bytes | None) -> _Doc | None:
    """The tolerant (``partial``) reading of one value by its codec; None when missing or
    refused (a value no writer could produce, or another version's: the sidecars refuse
    it too)."""
    if raw is None:
        return None
    try:
        return decode(raw)
    except (etcd_values.CorruptValueError, etcd_values.ForeignValueError):
        return None


def _state(raw: bytes) -> etcd_values.StateDoc:
    return etcd_values.decode_state(raw, partial=True)


def _restarts(raw: bytes) -> etcd_values.RestartsDoc:
    return etcd_values.decode_restarts(raw, partial=True)


def _report(raw: bytes) -> etcd_values.ReportDoc:
    return etcd_values.decode_report(raw, partial=True)


#: Longest restart summary the view carries (the rest of a long one is in the record).
MAX_RESTART_SUMMARY = 1024


#: Most characters of a charge's text (:attr:`ChargeView.text`) and host the view keeps.
MAX_CHARGE_TEXT = 4096


def _charges(doc: etcd_values.RestartsDoc) -> tuple[ChargeView, ...]:
    """The record's charges: each one's round, cause, Pod, Node (``detail.host``) and text
    (``detail``'s summary, message and stderr tail: whatever of them are strings), cut."""
    out = []
    for entry in doc.get("history") or []:
        detail = entry["detail"]
        host = detail.get("host")
        tail = detail.get("tail")
        parts = [detail.get("summary"), detail.get("message")]
        parts += list(tail) if isinstance(tail, list) else []
        text = "\n".join(p for p in parts if isinstance(p, str))[:MAX_CHARGE_TEXT]
        host = host[:MAX_CHARGE_TEXT] if isinstance(host, str) else ""
        out.append(ChargeView(entry["round"], entry["cause"], entry["node"], host, text))
    return tuple(out)


def _last_restart(doc: etcd_values.RestartsDoc) -> LastRestart | None:
    """The newest charge: its round, cause, node and summary (``detail.summary``, the
    sidecar's ``Failure``; else ``<cause> on <node>``), texts cut to
    :data:`MAX_RESTART_SUMMARY` characters."""
    history = doc.get("history") or []
    if not history:
        return None
    entry = history[-1]
    summary = entry["detail"].get("summary")
    if not isinstance(summary, str) or not summary:
        summary = f"{entry['cause']} on {entry['node']}"
    if entry["detail"].get("ignored") is True:  # the record's, not a charge
        summary = f"not charged (an Ignore rule): {summary}"
    return LastRestart(
        round=entry["round"],
        cause=entry["cause"][:MAX_RESTART_SUMMARY],
        node=entry["node"][:MAX_RESTART_SUMMARY],
        message=summary[:MAX_RESTART_SUMMARY],
    )


def _stragglers(node: str, raw: bytes) -> list[StragglerView]:
    """A node's stragglers now (its key names the node; the value's own ``node`` must
    agree, else it is read as missing, as a refused value is)."""
    doc = _read(etcd_values.decode_stragglers, raw)
    if doc is None or doc["node"] != node:
        return []
    since = datetime.fromtimestamp(doc["time"], timezone.utc)
    return [
        StragglerView(
            node,
            e["local_rank"],
            e["scope"],
            float(e["median_s"]),
            float(e["others_median_s"]),
            float(e["ratio"]),
            since,
            doc["pod_uid"],
        )
        for e in doc["stragglers"]
    ]


def _restore(keys: contract.Keys, kv: Mapping[str, bytes], state: etcd_values.StateDoc,
             nproc: int, replicated: bool) -> Restore | None:  # fmt: skip
    """What the complete round's workers restored from the checkpoint slots: its
    participants' records (``checkpoints/<node>``) agreed on as every sidecar does
    (:func:`~kelastic.etcd_values.checkpoints.restore_of`, the job's run id being the
    prefix's uid); None without a complete round or when no participant has a record."""
    participants = state.get("participants")
    if not state.get("complete") or not participants or nproc < 1:
        return None
    records: dict[str, CheckpointsDoc | None] = {}
    for node in participants:
        key = keys.checkpoint(node)
        records[node] = _read(partial(decode_checkpoints, where=key), kv.get(key))
    if not any(records.values()):
        return None
    uid = keys.prefix.rstrip("/").rsplit("/", 1)[-1]
    order = tuple(sorted(participants, key=lambda n: participants[n]))  # by group rank
    return restore_of(state.get("round") or 0, records, order, nproc, uid, replicated=replicated)


def view_from_keys(prefix: str, kv: Mapping[str, bytes], nproc_per_node: int, *,
                   replicated: bool = False) -> RendezvousView:  # fmt: skip
    """Parse the job's keys (full key -> value) into a :class:`RendezvousView`, each value
    by its one codec (:mod:`kelastic.etcd_values`, :mod:`kelastic.inprocess_record`).

    Tolerant where the sidecars are strict: a missing key, or a missing field (a value of
    an older or newer sidecar, of another version), leaves its part of the view empty; a
    value the codec refuses (not bounded JSON, a field outside the writer's bounds) is
    read as missing, never raises. Only reports of a failed *job* (summary starting with
    :data:`~kelastic_operator.reconcile.JOB_FAILED_PREFIX`) count as failures; a node's own
    failure is handled through its Pod.

    Args:
        prefix: the job prefix (:func:`kelastic.contract.job_prefix`).
        kv: the keys under it.
        nproc_per_node: workers per node (world size = nodes x this).
        replicated: the job's checkpoint state is replicated
            (``spec.checkpoint.stateLayout: Replicated``): the restore is agreed as its
            sidecars do.
    """
    keys = contract.Keys(prefix)
    state = _read(_state, kv.get(keys.rdzv_state)) or {}
    participants = state.get("participants")
    world = None
    if state.get("complete") and participants is not None:
        world = len(participants) * nproc_per_node
    restarts = _read(_restarts, kv.get(keys.restarts)) or {}
    failed: dict[str, str] = {}
    succeeded: set[str] = set()
    departing = frozenset(k[len(keys.departing_prefix) :] for k in kv
                          if k.startswith(keys.departing_prefix))  # fmt: skip
    hangs, stragglers = [], []
    loads: dict[str, LoadDoc] = {}
    for key, raw in kv.items():
        if key.startswith(keys.checkpoint_loads_prefix):
            load = _read(partial(decode_load, where=key, partial=True), raw)
            if load is not None:
                loads[key[len(keys.checkpoint_loads_prefix) :]] = load
        if key.startswith(keys.hangs_prefix):
            hang = _read(etcd_values.decode_hang, raw)
            if hang is not None:
                hangs.append(hang)
        if key.startswith(keys.stragglers_prefix):
            stragglers.extend(_stragglers(key[len(keys.stragglers_prefix) :], raw))
        if not key.startswith(keys.reports_prefix):
            continue
        node = key[len(keys.reports_prefix) :]
        report = _read(_report, raw)
        if report is None:
            continue
        summary = report.get("summary") or ""
        outcome = report.get("outcome")
        if outcome is ReportOutcome.FAILED and summary.startswith(JOB_FAILED_PREFIX):
            failed[node] = summary  # a node's own failure (e.g. its join timed out) is not
        elif outcome is ReportOutcome.SUCCEEDED:
            succeeded.add(node)
    return RendezvousView(
        round=state.get("round"),
        world_size=world,
        restarts_spent=restarts.get("count"),
        failed_reports=failed,
        succeeded_nodes=frozenset(succeeded),
        inprocess=decode_record(kv.get(keys.inprocess_iteration)),
        departing=departing,
        hangs=tuple(sorted(hangs, key=lambda h: h.node)),
        last_restart=_last_restart(restarts),
        stragglers=tuple(stragglers),
        charges=_charges(restarts),
        restore=_restore(keys, kv, state, nproc_per_node, replicated),
        loads=loads,
    )
