"""The restore from a peer (the ``peer`` tier of ``spec.checkpoint.replicas``): after the
agreement (:func:`kelastic.etcd_values.checkpoints.restore_of` says ``peer``),
:func:`restore_from_peers` puts each of the node's ranks' agreed step in its slot folder
before the workers start: a replica the node holds itself (its own snapshot, or the
replica of a rank it runs now) is copied there, else it is fetched from a node that holds
it (:func:`~kelastic.etcd_values.checkpoints.peer_sources`: the rank's former node first,
then replicas), checked in full; the workers' ``load()`` then reads it as their own slot.
A rank none could be got for loads nothing and its worker fails
(``CheckpointRestoreError``): the round fails, never a mixed step. The sending side is
:mod:`kelastic_sidecar.replication`.

With a replicated state (``spec.checkpoint.stateLayout: Replicated``),
:func:`restore_replicated` gives each rank without the agreed step a copy of *any*
rank's (:func:`kelastic.checkpoint.adopt.adopt_slot`): one on the node (its slots or
replicas, as its record lists them verified), else one fetched from a serving node
(:func:`~kelastic.etcd_values.checkpoints.replicated_sources`), once per node: the
node's other ranks copy that one.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kelastic.checkpoint import CheckpointError
from kelastic.checkpoint.adopt import adopt_slot
from kelastic.checkpoint.scan import committed_slots
from kelastic.checkpoint.store import SLOTS, slot_path
from kelastic.etcd_values.checkpoints import (
    CheckpointsDoc,
    parse_endpoint,
    peer_sources,
    replicated_sources,
)

from .replica import REPLICA_DIR_NAME, ReplicaError, fetch_slot

if TYPE_CHECKING:
    from .rendezvous import RendezvousInfo

__all__ = ["Fetched", "ranks_to_fill", "restore_from_peers", "restore_replicated"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fetched:
    """One rank's agreed slot put in place by :func:`restore_from_peers`.

    Attributes:
        rank: the global rank.
        source: the node it came from (this node's name: its own replica, copied).
        bytes: bytes fetched (0 for its own replica).
        seconds: how long it took.
    """

    rank: int
    source: str
    bytes: int
    seconds: float


def _free_slot(directory: Path, rank: int, job: str) -> int:
    """The slot index of ``rank`` to put a fetched slot in: one holding no committed slot
    of ``job`` (missing, uncommitted, another job's), else the oldest."""
    held = {s.slot: s.seq for s in committed_slots(directory, job) if s.rank == rank}
    free = [slot for slot in range(SLOTS) if slot not in held]
    return free[0] if free else min(held, key=lambda slot: held[slot])


def _own_replica(directory: Path, job: str, rank: int, step: int) -> Path | None:
    replicas = directory / REPLICA_DIR_NAME
    for slot in committed_slots(replicas, job):
        if slot.rank == rank and slot.step == step:
            return slot_path(replicas, rank, slot.slot)
    return None


def restore_from_peers(directory: Path, me: str, info: RendezvousInfo, nproc: int,
                       records: Mapping[str, CheckpointsDoc | None], job: str,
                       step: int) -> list[Fetched]:  # fmt: skip
    """Put ``step``'s slot of each of this node's ranks in ``info``'s round (group rank
    times ``nproc`` plus local rank) that its own record does not hold in ``directory``:
    its own replica copied in (it stays a replica: a new peer gets it), else fetched from each of
    :func:`~kelastic.etcd_values.checkpoints.peer_sources` in turn until one is whole
    (checked in full). Call it after the agreement, before the workers start.

    Returns:
        What was put in place. A rank that none could be got for is logged and left:
        its worker's ``load()`` raises, the round fails (the next agrees again).

    Raises:
        OSError: the slot folder cannot be read.
    """
    out: list[Fetched] = []
    for rank in ranks_to_fill(info, nproc, records.get(me), step):
        started = time.monotonic()
        dest = slot_path(directory, rank, _free_slot(directory, rank, job))
        own = _own_replica(directory, job, rank, step)
        if own is not None:  # copied, not moved: it is still this node's replica to send
            tmp = dest.with_name(f".{dest.name}.fetch-{os.urandom(8).hex()}")
            shutil.copyfile(own, tmp)
            os.replace(tmp, dest)
            out.append(Fetched(rank, me, 0, time.monotonic() - started))
            continue
        sources = [(n, d, rank) for n, d in peer_sources(records, info.participants, job,
                                                         rank, step)]  # fmt: skip
        node, size = _fetch_first(dest, me, sources, job, step)
        if node:
            out.append(Fetched(rank, node, size, time.monotonic() - started))
        else:
            log.error("checkpoint: no node could give rank %d step %d: its load will fail",
                      rank, step)  # fmt: skip
    return out


def ranks_to_fill(info: RendezvousInfo, nproc: int, mine: CheckpointsDoc | None,
                  step: int) -> list[int]:  # fmt: skip
    """This node's global ranks in ``info``'s round (``nproc`` per node) whose ``step``
    its own record ``mine`` does not list: those a restore must put in place."""
    first = info.group_rank * nproc
    return [r for r in range(first, first + nproc)
            if mine is None or step not in mine.ranks.get(r, ())]  # fmt: skip


def _any_copy(directory: Path, mine: CheckpointsDoc | None, job: str,
              step: int) -> Path | None:  # fmt: skip
    """A slot of ``step`` on this node that its record ``mine`` lists as verified, any
    rank's: its slots first, then its replicas."""
    if mine is None or mine.job != job:
        return None
    for folder, listed in ((directory, mine.ranks), (directory / REPLICA_DIR_NAME, mine.replicas)):
        for slot in committed_slots(folder, job):
            if slot.step == step and step in listed.get(slot.rank, ()):
                return slot_path(folder, slot.rank, slot.slot)
    return None


def restore_replicated(directory: Path, me: str, info: RendezvousInfo, nproc: int,
                       records: Mapping[str, CheckpointsDoc | None], job: str,
                       step: int) -> list[Fetched]:  # fmt: skip
    """Give each of this node's ranks in ``info``'s round that its own record does not
    hold ``step`` for a copy of another rank's ``step`` of the replicated state (see the
    module doc): from the node's own slots or replicas, else fetched from each of
    :func:`~kelastic.etcd_values.checkpoints.replicated_sources` in turn until one is
    whole (checked in full). Call it after the agreement (tier memory or peer), before
    the workers start.

    Returns:
        What was put in place (``bytes`` 0 for a copy on the node). A rank that none
        could be got for is logged and left: its worker's ``load()`` raises and the
        round fails.

    Raises:
        OSError: the slot folder cannot be read or written.
    """
    mine = records.get(me)
    out: list[Fetched] = []
    adopted: Path | None = None  # a copy made here: the node's next ranks copy it
    for rank in ranks_to_fill(info, nproc, mine, step):
        started = time.monotonic()
        dest = slot_path(directory, rank, _free_slot(directory, rank, job))
        source, node, fetched = adopted or _any_copy(directory, mine, job, step), me, 0
        if source is None:  # fetched into the rank's slot file, then stamped there
            sources = replicated_sources(records, info.participants, job, step)
            node, fetched = _fetch_first(dest, me, sources, job, step)
            source = dest if node else None
        if source is None:
            log.error("checkpoint: no node could give step %d of the replicated state: rank "
                      "%d's load will fail", step, rank)  # fmt: skip
            continue
        try:
            adopt_slot(source, dest, rank, job, step)
        except CheckpointError as exc:
            log.error("checkpoint: rank %d cannot adopt %s: %s", rank, source, exc)
            continue
        adopted = dest
        out.append(Fetched(rank, node, fetched, time.monotonic() - started))
    return out


def _fetch_first(dest: Path, me: str, sources: Sequence[tuple[str, CheckpointsDoc, int]],
                 job: str, step: int) -> tuple[str, int]:  # fmt: skip
    """``step`` fetched into ``dest`` from the first of ``sources`` (node, its record,
    the rank whose slot it serves) that gives it whole (checked in full as that rank's
    slot; this node itself skipped): ``(the node, bytes)``, or ``("", 0)`` when none
    did."""
    for node, doc, rank in sources:
        address = parse_endpoint(doc.endpoint)
        if node == me or address is None:
            continue
        try:
            return node, fetch_slot(address, doc.token, job, rank, step, dest)
        except ReplicaError as exc:
            log.warning("checkpoint: step %d (rank %d's) not fetched from %s: %s", step, rank,
                        node, exc)  # fmt: skip
    return "", 0
