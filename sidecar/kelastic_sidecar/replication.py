"""Replication of the node's checkpoint slots to a peer node, and the restore of a rank's
slot from the node that holds it (``spec.checkpoint.replicas``; the ``peer`` tier).

Each sidecar serves its node's slots and the replicas it holds
(:class:`~kelastic_sidecar.replica.ReplicaServer`, on ``$KELASTIC_REPLICA_PORT``, to a
request carrying its token) and records where (``endpoint``, ``token``) in its
checkpoint record, beside the replicas' verified steps
(:func:`kelastic_sidecar.checkpoints.publish_record`). Its :class:`Replication` thread
sends, every :data:`POLL_SECONDS`, the newest committed slot of each of its ranks to its
*peer*, the next node of the round by group rank (a ring, so every node holds one
other's replicas), when the peer has not acknowledged that step yet, at most
``rate`` bytes per second; a step is safe from the loss of this node once its replica is
acknowledged. A save every step outpaces any network: only the newest step is sent,
the ones between are skipped (DLRover's flash checkpoint skips a memory save while its
buffer is being persisted; here the training never waits for the network).

After the agreement (:func:`kelastic.etcd_values.checkpoints.restore_of` says ``peer``),
:func:`restore_from_peers` puts each of the node's ranks' agreed slot in its slot folder
before the workers start: a replica the node holds itself is moved there, else it is
fetched from a node that holds it (:func:`~kelastic.etcd_values.checkpoints.peer_sources`:
the rank's former node first, then replicas), checked in full; the workers' ``load()``
then reads it as their own slot. A rank none could be got for loads nothing and its
worker fails (``CheckpointRestoreError``): the round fails, never a mixed step.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from kelastic.checkpoint.scan import CommittedSlot, committed_slots
from kelastic.checkpoint.store import SLOTS, slot_path
from kelastic.etcd_values.checkpoints import CheckpointsDoc, parse_endpoint, peer_sources

from .replica import (
    REPLICA_DIR_NAME,
    ReplicaError,
    ReplicaServer,
    fetch_slot,
    new_token,
    send_slot,
    sweep_fetches,
)

if TYPE_CHECKING:
    from .config import ReplicationSettings
    from .rendezvous import RendezvousInfo

__all__ = ["POLL_SECONDS", "Fetched", "Peer", "Replication", "restore_from_peers"]

log = logging.getLogger(__name__)

#: Seconds between two looks at the node's committed slots.
POLL_SECONDS: Final = 0.2
#: Seconds one replica may take to send before it is given up (retried at the next look).
SEND_TIMEOUT: Final = 600.0


@dataclass(frozen=True)
class Peer:
    """Where this node's replicas go: the peer's node name, ``(host, port)`` and token."""

    node: str
    address: tuple[str, int]
    token: str


def ring_peer(info: RendezvousInfo, records: Mapping[str, CheckpointsDoc | None],
              job: str) -> Peer | None:  # fmt: skip
    """The next participant after this node by group rank (the last's is the first), with
    the endpoint of its record of ``job``; None alone in the round or when that node
    serves nothing (no record, no endpoint: replicas off there, or an older sidecar)."""
    if info.group_world_size < 2:
        return None
    node = info.participants[(info.group_rank + 1) % len(info.participants)]
    doc = records.get(node)
    if doc is None or doc.job != job or not doc.endpoint:
        return None
    address = parse_endpoint(doc.endpoint)
    return Peer(node, address, doc.token) if address is not None else None


def newest_slots(directory: Path, job: str) -> dict[int, CommittedSlot]:
    """Each rank's newest committed slot in ``directory`` (header and commit word only).

    Raises:
        OSError: the folder or a slot cannot be read.
    """
    newest: dict[int, CommittedSlot] = {}
    for slot in committed_slots(directory, job):
        if slot.rank not in newest or slot.seq > newest[slot.rank].seq:
            newest[slot.rank] = slot
    return newest


class Replication:
    """The node's replication: its :class:`~kelastic_sidecar.replica.ReplicaServer` and the
    thread that sends its ranks' newest committed slots to the round's :class:`Peer`.

    Args:
        settings: ``spec.checkpoint.replicas``' settings.
        job: the run id the slots are saved under.
        directory: the node's slot folder (replicas go in its ``replicas`` folder).
        host: the address the job's other sidecars reach this one at (the Pod's IP).
        on_sent: called with ``(rank, step, bytes, seconds)`` of each acknowledged replica.
        on_failure: called with each replica that could not be sent.
        poll: seconds between two passes of the sending thread; None: no thread (the
            caller calls :meth:`replicate_once`).
    """

    def __init__(self, settings: ReplicationSettings, job: str, directory: Path, host: str, *,
                 on_sent: Callable[[int, int, int, float], None] = lambda *_a: None,
                 on_failure: Callable[[ReplicaError], None] = lambda _e: None,
                 poll: float | None = POLL_SECONDS) -> None:  # fmt: skip
        self._settings, self._job, self._directory, self._host = settings, job, directory, host
        self._on_sent, self._on_failure = on_sent, on_failure
        self.token = new_token()
        self.server = ReplicaServer(directory, job, self.token, port=settings.port,
                                    max_slot_bytes=settings.max_slot_bytes)  # fmt: skip
        self._lock = threading.Lock()
        self._peer: Peer | None = None
        #: rank -> the newest step the current peer acknowledged.
        self.acked: dict[int, int] = {}
        self._stop = threading.Event()
        self._poll = poll
        self._thread = threading.Thread(target=self._run, name="ckpt-replicate", daemon=True)
        self._failing = False

    @property
    def endpoint(self) -> str:
        """``host:port`` of the server for the node's record (``[v6]:port`` for IPv6)."""
        port = self.server.address[1]
        return f"[{self._host}]:{port}" if ":" in self._host else f"{self._host}:{port}"

    def start(self) -> None:
        """Serve, and send replicas from now on (to the peer :meth:`follow` names); the
        leftovers of fetches cut by this sidecar's last death are removed first.

        Raises:
            OSError: the port cannot be bound.
        """
        for name in sweep_fetches(self._directory):
            log.info("checkpoint replicas: removed %s, a fetch cut by the last exit", name)
        self.server.start()
        if self._poll is not None:
            self._thread.start()
        log.info("checkpoint replicas: serving at %s, sending at most %s bytes/s",
                 self.endpoint, self._settings.rate or "unlimited")  # fmt: skip

    def follow(self, info: RendezvousInfo, records: Mapping[str, CheckpointsDoc | None]) -> None:
        """Send to ``info``'s round's ring peer from now on (:func:`ring_peer`); a new peer
        holds nothing yet: everything is sent again."""
        peer = ring_peer(info, records, self._job)
        with self._lock:
            if peer != self._peer:
                self._peer, self.acked = peer, {}
                log.info("round %d: checkpoint replicas go to %s", info.round,
                         peer.node if peer is not None else "no peer")  # fmt: skip

    def status(self) -> dict[str, object]:
        """``/status``'s ``checkpoint.replication``: the endpoint, the peer and the step
        it acknowledged per rank."""
        with self._lock:
            peer = self._peer.node if self._peer is not None else None
            acked = {str(rank): step for rank, step in sorted(self.acked.items())}
        return {"endpoint": self.endpoint, "peer": peer, "acked": acked}

    def lag(self) -> int:
        """Steps between the node's newest committed step and the newest one its peer
        acknowledged, the largest over its ranks (0: none behind, or no peer)."""
        with self._lock:
            if self._peer is None:
                return 0
            acked = dict(self.acked)
        try:
            newest = newest_slots(self._directory, self._job)
        except OSError:
            return 0
        return max((max(0, s.step - acked.get(r, -1)) for r, s in newest.items()), default=0)

    def close(self) -> None:
        """Stop sending and serving (a transfer under way is cut)."""
        self._stop.set()
        self.server.close()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.wait(self._poll or POLL_SECONDS):
            try:
                self.replicate_once()
            except Exception:  # the thread must outlive any slot or peer
                log.exception("checkpoint replicas: a pass failed")

    def replicate_once(self) -> list[tuple[int, int]]:
        """Send each rank's newest committed slot the peer has not acknowledged yet.
        Returns ``(rank, step)`` of each one acknowledged; a failure is logged (once
        until one succeeds again), counted and retried at the next pass."""
        with self._lock:
            peer = self._peer
        if peer is None:
            return []
        try:
            newest = newest_slots(self._directory, self._job)
        except OSError as exc:
            log.error("checkpoint replicas: cannot read the slots in %s: %s", self._directory, exc)
            return []
        sent: list[tuple[int, int]] = []
        for rank, slot in sorted(newest.items()):
            with self._lock:
                if self._peer != peer or self._stop.is_set():
                    break
                if self.acked.get(rank, -1) >= slot.step:
                    continue
            path = slot_path(self._directory, rank, slot.slot)
            started = time.monotonic()
            try:
                step = send_slot(peer.address, peer.token, self._job, path,
                                 rate_bytes_per_s=self._settings.rate or None,
                                 timeout=SEND_TIMEOUT)  # fmt: skip
            except ReplicaError as exc:
                self._on_failure(exc)
                if not self._failing:
                    log.warning("checkpoint replicas: rank %d step %d not sent to %s: %s",
                                rank, slot.step, peer.node, exc)  # fmt: skip
                self._failing = True
                continue
            self._failing = False
            with self._lock:
                if self._peer == peer:
                    self.acked[rank] = max(step, self.acked.get(rank, -1))
            self._on_sent(rank, step, _size(path), time.monotonic() - started)
            sent.append((rank, step))
        return sent


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


@dataclass(frozen=True)
class Fetched:
    """One rank's agreed slot put in place by :func:`restore_from_peers`.

    Attributes:
        rank: the global rank.
        source: the node it came from (this node's name: its own replica, moved).
        bytes: bytes fetched (0 for a replica moved).
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
    its own replica moved in, else fetched from each of
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
        if own is not None:
            os.replace(own, dest)
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
