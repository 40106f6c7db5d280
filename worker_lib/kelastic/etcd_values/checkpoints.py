"""A node's committed checkpoint steps at :meth:`kelastic.contract.Keys.checkpoint`:
bytes <-> :class:`CheckpointsDoc`, and the job's restorable step (pure, stdlib only).

Each node's sidecar writes, before it joins a rendezvous round (its workers stopped, so
its slots hold still), the steps of ``kelastic.checkpoint`` that each global rank of its
slot folder has committed *and* that pass their checksums::

    {"version": 1, "job": "<run id>", "ranks": {"0": [12, 11], "1": [12, 11]},
     "time": 1764190000.5}

Once the round is complete, every sidecar reads its participants' records and agrees on
:func:`restorable_step`: the highest step that the node now running each rank of the new
world committed for that rank (the process-restart rung restores from the node's own
slots, so a rank whose node changed holds nothing yet). Every node computes the same
value from the same records; a rank without a step in common makes it None (the user's
own fallback, for every rank alike: never a mixed step).

Bounds (writer and reader alike): at most :data:`MAX_CHECKPOINTS_BYTES` bytes; ``job``
a name (1..1024 characters); at most :data:`MAX_LOCAL_RANKS` ranks, each a decimal
global rank in 0..:data:`MAX_RANK` with at most :data:`MAX_SLOTS` distinct steps (a rank's slots)
in 0..:data:`MAX_STEP`, newest first; ``time`` seconds since the epoch.
"""

from __future__ import annotations

import enum
import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from kelastic._safejson import is_int, load_object

from ._fields import CorruptValueError, ForeignValueError, is_name, is_time

__all__ = [
    "CHECKPOINTS_VERSION",
    "MAX_CHECKPOINTS_BYTES",
    "MAX_LOCAL_RANKS",
    "MAX_SLOTS",
    "MAX_STEP",
    "CheckpointsDoc",
    "Restore",
    "RestoreTier",
    "decode_checkpoints",
    "encode_checkpoints",
    "restorable_step",
    "restore_of",
]

CHECKPOINTS_VERSION: Final = 1
#: Largest record accepted, bytes.
MAX_CHECKPOINTS_BYTES: Final = 256 * 1024
#: Most ranks one node's record holds (its slot folder's ranks).
MAX_LOCAL_RANKS: Final = 4096
#: Highest global rank, and highest step (as ``kelastic.checkpoint.slot_format``).
MAX_RANK: Final = 2**31 - 2
MAX_STEP: Final = 2**53
#: Most steps a rank's record lists: its slots (``kelastic.checkpoint.store.SLOTS``).
MAX_SLOTS: Final = 3
_FIELDS: Final = frozenset({"version", "job", "ranks", "time"})


class RestoreTier(enum.StrEnum):
    """Where a round's workers restore their state from (``status.lastCheckpoint.tier``,
    the sidecar's ``kelastic_checkpoint_restores_total{tier}``). A peer's replica and the
    persisted copy on disk come with replication and persistence."""

    #: Every rank from its own node's slots (the process-restart rung).
    MEMORY = "memory"
    #: No step every rank holds: the workers start without one (their own fallback).
    NONE = "none"


@dataclass(frozen=True)
class Restore:
    """What a round's workers restore (:func:`restore_of`).

    Attributes:
        round: the rendezvous round.
        step: the step every rank loads; None with :attr:`RestoreTier.NONE`.
        tier: where from.
        ranks: the round's world size.
        held: whether some rank's node recorded some step of the job (False on a fresh
            start: nothing was lost).
        time: when the newest of the participants' records was written, seconds since
            the epoch (0.0: none was).
    """

    round: int
    step: int | None
    tier: RestoreTier
    ranks: int
    held: bool
    time: float = 0.0


@dataclass(frozen=True)
class CheckpointsDoc:
    """One node's committed, verified steps.

    Attributes:
        job: the run id (``TORCHELASTIC_RUN_ID``) the slots were saved under.
        ranks: global rank -> its committed steps, newest first (at most
            :data:`MAX_SLOTS`).
        time: when the sidecar read its slots, seconds since the epoch.
    """

    job: str
    ranks: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    time: float = 0.0


def _check(doc: Any, where: str) -> CheckpointsDoc:
    def bad(what: str) -> CorruptValueError:
        return CorruptValueError(f"corrupt checkpoint record at {where}: {what}")

    if not isinstance(doc, dict) or set(doc) != _FIELDS:
        raise bad(f"fields {sorted(doc) if isinstance(doc, dict) else type(doc).__name__}")
    if not is_int(doc["version"], 0, 2**31):
        raise bad("bad version")
    if doc["version"] != CHECKPOINTS_VERSION:
        raise ForeignValueError(
            f"checkpoint record at {where} has version {doc['version']}, "
            f"this kelastic reads {CHECKPOINTS_VERSION}"
        )
    if not is_name(doc["job"]):
        raise bad("bad job")
    if not is_time(doc["time"]):
        raise bad("bad time")
    ranks = doc["ranks"]
    if not isinstance(ranks, dict) or len(ranks) > MAX_LOCAL_RANKS:
        raise bad(f"ranks is not an object of at most {MAX_LOCAL_RANKS} ranks")
    out: dict[int, tuple[int, ...]] = {}
    for key, steps in ranks.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
            raise bad(f"rank {key!r:.40} is not a decimal rank")
        rank = int(key)
        if rank > MAX_RANK or key != str(rank):
            raise bad(f"rank {key!r:.40} is out of range")
        if not isinstance(steps, list) or len(steps) > MAX_SLOTS:
            raise bad(f"rank {rank}: steps is not a list of at most {MAX_SLOTS}")
        if not all(is_int(s, 0, MAX_STEP) for s in steps):
            raise bad(f"rank {rank}: a step outside 0..{MAX_STEP}")
        if any(a <= b for a, b in itertools.pairwise(steps)):
            raise bad(f"rank {rank}: steps {steps} are not distinct, newest first")
        out[rank] = tuple(steps)
    return CheckpointsDoc(doc["job"], out, float(doc["time"]))


def decode_checkpoints(raw: bytes, where: str) -> CheckpointsDoc:
    """Parse a node's checkpoint record (bounded, :func:`kelastic._safejson.load_object`).

    Args:
        raw: the bytes read from etcd.
        where: the etcd key, for the message.

    Raises:
        CorruptValueError: outside the module's bounds (not bounded JSON, a missing or
            unknown field, a bad rank or step, steps not newest first).
        ForeignValueError: another version of the record.
    """
    doc = load_object(raw, f"corrupt checkpoint record at {where}",
                      max_bytes=MAX_CHECKPOINTS_BYTES, error=CorruptValueError)  # fmt: skip
    return _check(doc, where)


def encode_checkpoints(doc: CheckpointsDoc) -> bytes:
    """The record of ``doc`` (ranks in increasing order).

    Raises:
        CorruptValueError: outside :func:`decode_checkpoints`'s bounds (strict: nothing
            written is refused when read).
    """
    value = {
        "version": CHECKPOINTS_VERSION,
        "job": doc.job,
        "ranks": {str(r): list(doc.ranks[r]) for r in sorted(doc.ranks)},
        "time": doc.time,
    }
    raw = json.dumps(value, separators=(",", ":")).encode()
    if len(raw) > MAX_CHECKPOINTS_BYTES:
        raise CorruptValueError(f"a checkpoint record of {len(raw)} bytes is too large")
    _check(json.loads(raw), "the checkpoint record to write")
    return raw


def restorable_step(records: Mapping[str, CheckpointsDoc | None], participants: Sequence[str],
                    nproc: int, job: str) -> int | None:  # fmt: skip
    """The step every rank of the round can restore from its own node's slots.

    Rank ``r`` of the round runs on ``participants[r // nproc]`` (group rank order,
    ``nproc`` workers per node, as ``kelastic_sidecar.assignment``); the result is the
    highest step that every rank's node recorded for that rank under ``job``.

    Args:
        records: node name -> its decoded record, or None (missing or corrupt).
        participants: the round's nodes, ordered by group rank.
        nproc: workers per node (>= 1).
        job: the run id; a record of another run counts as none.

    Returns:
        The step, or None when some rank has no step in common with the others (or
        there are no ranks).

    Raises:
        ValueError: ``nproc`` < 1.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    common: set[int] | None = None
    for group_rank, node in enumerate(participants):
        doc = records.get(node)
        for local_rank in range(nproc):
            rank = group_rank * nproc + local_rank
            steps = set(doc.ranks.get(rank, ())) if doc is not None and doc.job == job else set()
            common = steps if common is None else common & steps
            if not common:
                return None
    return max(common) if common else None


def restore_of(round_: int, records: Mapping[str, CheckpointsDoc | None],
               participants: Sequence[str], nproc: int, job: str) -> Restore:  # fmt: skip
    """The round's :class:`Restore`: :func:`restorable_step` of ``records`` (same
    arguments, same errors), with where from, how many ranks, whether anything was held
    and when the records were written. Every sidecar and the operator compute the same
    one from the same records."""
    step = restorable_step(records, participants, nproc, job)
    mine = [d for n in participants if (d := records.get(n)) is not None and d.job == job]
    return Restore(
        round=round_,
        step=step,
        tier=RestoreTier.NONE if step is None else RestoreTier.MEMORY,
        ranks=len(participants) * nproc,
        held=any(d.ranks for d in mine),
        time=max((d.time for d in mine), default=0.0),
    )
