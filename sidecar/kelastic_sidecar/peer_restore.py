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
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kelastic.checkpoint.scan import committed_slots
from kelastic.checkpoint.store import SLOTS, slot_path
from kelastic.etcd_values.checkpoints import CheckpointsDoc, parse_endpoint, peer_sources

from .replica import REPLICA_DIR_NAME, ReplicaError, fetch_slot

if TYPE_CHECKING:
    from .rendezvous import RendezvousInfo

__all__ = ["Fetched", "restore_from_peers"]

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
    mine = records.get(me)
    out: list[Fetched] = []
    for local_rank in range(nproc):
        rank = info.group_rank * nproc + local_rank
        if mine is not None and step in mine.ranks.get(rank, ()):
            continue
        started = time.monotonic()
        dest = slot_path(directory, rank, _free_slot(directory, rank, job))
        own = _own_replica(directory, job, rank, step)
        if own is not None:  # copied, not moved: it is still this node's replica to send
            tmp = dest.with_name(f".{dest.name}.fetch-{os.urandom(8).hex()}")
            shutil.copyfile(own, tmp)
            os.replace(tmp, dest)
            out.append(Fetched(rank, me, 0, time.monotonic() - started))
            continue
        for node, doc in peer_sources(records, info.participants, job, rank, step):
            address = parse_endpoint(doc.endpoint)
            if node == me or address is None:
                continue
            try:
                size = fetch_slot(address, doc.token, job, rank, step, dest)
            except ReplicaError as exc:
                log.warning("checkpoint: rank %d step %d not fetched from %s: %s", rank, step,
                            node, exc)  # fmt: skip
                continue
            out.append(Fetched(rank, node, size, time.monotonic() - started))
            break
        else:
            log.error("checkpoint: no node could give rank %d step %d: its load will fail",
                      rank, step)  # fmt: skip
    return out
