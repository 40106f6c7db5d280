"""Replication of the node's checkpoint slots to a peer node (``spec.checkpoint.replicas``;
the ``peer`` tier).

Each sidecar serves its node's slots and the replicas it holds
(:class:`~kelastic_sidecar.replica.ReplicaServer`, on ``$KELASTIC_REPLICA_PORT``, to a
request carrying its token) and records where (``endpoint``, ``token``) in its
checkpoint record, beside the replicas' verified steps
(:func:`kelastic_sidecar.checkpoints.publish_record`).

*What* is replicated is a schedule by step number, the same on every node: the steps
that are multiples of ``every`` (``spec.checkpoint.replicateEverySteps``). A node's slots
hold only its ranks' newest three steps, and a replica arrives some steps behind, so
after a node loss the survivors' slots and the lost node's replicas would share no step
at all (the first version sent the newest step of each rank and found none in most
node losses of a job saving every step). So each sidecar first *snapshots* each due
step of its ranks among its replicas (a kernel copy of the slot, its commit word checked
after: a save begun over it drops the copy), where the trainer's next saves cannot
overwrite it, and keeps the two newest; then it sends the newest snapshot of each rank
to its *peer*, the next node of the round's ring (every node holds one other's; by
group rank, with the zones known a ring whose neighbours are in different zones wherever
the round allows: :func:`ring_order`), when the peer has not acknowledged it yet, at
most ``rate`` bytes per second.
After the loss of a node, its ranks' two newest due steps are on its peer and every
survivor holds its own two newest due steps: the newest due step they share is
restored. A step is safe from the loss of this node once its replica is acknowledged;
the training never waits for the network (a due step still being sent when the next
comes is superseded: DLRover's flash checkpoint likewise skips a memory save while its
buffer is being persisted).

After a node loss, :mod:`kelastic_sidecar.peer_restore` gets each rank's agreed step back
from whoever holds it.

Memory: with replicas, a node's checkpoint volume holds its ranks' three slots, their two
snapshots and the peer's ranks' two replicas: about seven times a rank's state per rank.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from kelastic.checkpoint.scan import CommittedSlot, committed_slots
from kelastic.checkpoint.store import slot_path
from kelastic.etcd_values.checkpoints import CheckpointsDoc, parse_endpoint

from .replica import (
    REPLICA_DIR_NAME,
    ReplicaError,
    ReplicaServer,
    new_token,
    send_slot,
    snapshot,
    sweep_fetches,
)

if TYPE_CHECKING:
    from .config import ReplicationSettings
    from .rendezvous import RendezvousInfo

__all__ = ["POLL_SECONDS", "Peer", "Replication", "newest_slots", "ring_order", "ring_peer"]

log = logging.getLogger(__name__)

#: Seconds between two passes of the sends (the snapshots look at the slots four times
#: as often: a due step stays in its slot for two saves only).
POLL_SECONDS: Final = 0.2
#: Seconds one replica may take to send before it is given up (retried at the next look).
SEND_TIMEOUT: Final = 600.0


@dataclass(frozen=True)
class Peer:
    """Where this node's replicas go: the peer's node name, ``(host, port)`` and token."""

    node: str
    address: tuple[str, int]
    token: str


def ring_order(participants: Sequence[str], records: Mapping[str, CheckpointsDoc | None],
               job: str) -> list[str]:  # fmt: skip
    """The round's ring of replicas: each node sends to the next (the last to the first).

    The nodes are grouped by failure domain (each record's ``domain``, ``""`` when
    unknown or missing) and placed largest group first on the even positions of the
    ring, then on the odd ones, each group in group-rank order: consecutive nodes are in
    different domains wherever the groups' sizes allow it (the fewest same-domain pairs
    possible: ``max(0, 2 * largest - n)``), and every node still holds exactly one
    peer's replicas (its volume is sized for one). With one domain (or none known) it is
    group-rank order. Every sidecar computes the same ring from the same records.
    """
    groups: dict[str, list[str]] = {}
    for node in participants:
        doc = records.get(node)
        groups.setdefault(doc.domain if doc is not None and doc.job == job else "", []).append(node)
    if len(groups) < 2:
        return list(participants)
    first = {node: i for i, node in enumerate(participants)}
    flat = [n for g in sorted(groups.values(), key=lambda g: (-len(g), first[g[0]])) for n in g]
    order = [""] * len(flat)
    positions = [*range(0, len(flat), 2), *range(1, len(flat), 2)]
    for position, node in zip(positions, flat, strict=True):
        order[position] = node
    return order


def ring_peer(info: RendezvousInfo, records: Mapping[str, CheckpointsDoc | None],
              job: str) -> Peer | None:  # fmt: skip
    """This node's next participant on the round's :func:`ring_order` (by group rank when
    the failure domains are unknown), with the endpoint of its record of ``job``; None
    alone in the round or when that node serves nothing (no record, no endpoint: replicas
    off there, or an older sidecar)."""
    if info.group_world_size < 2:
        return None
    ring = ring_order(info.participants, records, job)
    me = info.participants[info.group_rank]
    node = ring[(ring.index(me) + 1) % len(ring)]
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
    """The node's replication: its :class:`~kelastic_sidecar.replica.ReplicaServer`, the
    thread that snapshots its ranks' due steps among its replicas, and the thread that
    sends those snapshots to the round's :class:`Peer`.

    Args:
        settings: ``spec.checkpoint.replicas``' settings.
        job: the run id the slots are saved under.
        directory: the node's slot folder (replicas go in its ``replicas`` folder).
        host: the address the job's other sidecars reach this one at (the Pod's IP).
        on_sent: called with ``(rank, step, bytes, seconds)`` of each acknowledged replica.
        on_failure: called with each replica that could not be sent.
        poll: seconds between two sends' passes (the snapshots' is a quarter of it); None:
            no threads (the caller calls :meth:`snapshot_once` and :meth:`replicate_once`).
    """

    def __init__(self, settings: ReplicationSettings, job: str, directory: Path, host: str, *,
                 on_sent: Callable[[int, int, int, float], None] = lambda *_a: None,
                 on_failure: Callable[[ReplicaError], None] = lambda _e: None,
                 poll: float | None = POLL_SECONDS) -> None:  # fmt: skip
        self._settings, self._job, self._directory, self._host = settings, job, directory, host
        self._replicas = directory / REPLICA_DIR_NAME
        self._on_sent, self._on_failure = on_sent, on_failure
        self.token = new_token()
        self.server = ReplicaServer(directory, job, self.token, port=settings.port,
                                    max_slot_bytes=settings.max_slot_bytes)  # fmt: skip
        self._lock = threading.Lock()
        self._peer: Peer | None = None
        self._ranks: frozenset[int] | None = None  # the round's ranks here (None: any)
        #: rank -> the newest due step of the node's own ranks snapshotted.
        self.snapped: dict[int, int] = {}
        #: rank -> the newest step the current peer acknowledged.
        self.acked: dict[int, int] = {}
        self._stop = threading.Event()
        self._poll = poll
        self._threads = [
            threading.Thread(target=self._loop, args=(self.snapshot_once, (poll or 0) / 4),
                             name="ckpt-snapshot", daemon=True),
            threading.Thread(target=self._loop, args=(self.replicate_once, poll or 0),
                             name="ckpt-replicate", daemon=True),
        ]  # fmt: skip
        self._failing = False

    @property
    def endpoint(self) -> str:
        """``host:port`` of the server for the node's record (``[v6]:port`` for IPv6)."""
        port = self.server.address[1]
        return f"[{self._host}]:{port}" if ":" in self._host else f"{self._host}:{port}"

    def start(self) -> None:
        """Serve, and snapshot and send replicas from now on (to the peer :meth:`follow`
        names); the leftovers of fetches cut by this sidecar's last death are removed
        first.

        Raises:
            OSError: the port cannot be bound.
        """
        for name in sweep_fetches(self._directory):
            log.info("checkpoint replicas: removed %s, a fetch cut by the last exit", name)
        self.server.start()
        if self._poll is not None and self._settings.replicas:  # 0: serve only
            for thread in self._threads:
                thread.start()
        if not self._settings.replicas:
            log.info("checkpoint slots served at %s (a replicated state: a joining node "
                     "fetches its step there); no replicas sent", self.endpoint)  # fmt: skip
            return
        log.info("checkpoint replicas: serving at %s; every %d steps snapshotted and sent at "
                 "most %s bytes/s", self.endpoint, self._settings.every,
                 self._settings.rate or "unlimited")  # fmt: skip

    def follow(self, info: RendezvousInfo, records: Mapping[str, CheckpointsDoc | None],
               nproc: int) -> None:  # fmt: skip
        """Snapshot and send this node's ranks of ``info``'s round (``nproc`` per node; the
        slots of ranks it ran before are left alone) to the round's ring peer from now on
        (:func:`ring_peer`); a new peer holds nothing yet: everything is sent again. Serving
        only (no replicas), there is no peer."""
        peer = ring_peer(info, records, self._job) if self._settings.replicas else None
        first = info.group_rank * nproc
        with self._lock:
            self._ranks = frozenset(range(first, first + nproc))
            if peer != self._peer:
                self._peer, self.acked = peer, {}
                log.info("round %d: checkpoint replicas go to %s", info.round,
                         peer.node if peer is not None else "no peer")  # fmt: skip

    def rewind(self, step: int | None) -> None:
        """The job went back to ``step`` (None: to no step): the snapshots and the peer's
        replicas of newer steps were dropped (the one-history rule), so they are taken
        and sent again when the training saves those step numbers anew."""
        with self._lock:
            keep = -1 if step is None else step
            self.snapped = {r: s for r, s in self.snapped.items() if s <= keep}
            self.acked = {r: s for r, s in self.acked.items() if s <= keep}

    def status(self) -> dict[str, object]:
        """``/status``'s ``checkpoint.replication``: the endpoint, the peer, and per rank
        the newest due step snapshotted and the step the peer acknowledged."""
        with self._lock:
            peer = self._peer.node if self._peer is not None else None
            snapped = {str(rank): step for rank, step in sorted(self.snapped.items())}
            acked = {str(rank): step for rank, step in sorted(self.acked.items())}
        return {"endpoint": self.endpoint, "peer": peer, "snapshotted": snapped, "acked": acked}

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
        """Stop snapshotting, sending and serving (a transfer under way is cut)."""
        self._stop.set()
        self.server.close()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=5.0)

    def _loop(self, step: Callable[[], object], every: float) -> None:
        while not self._stop.wait(every):
            try:
                step()
            except Exception:  # the thread must outlive any slot or peer
                log.exception("checkpoint replicas: a pass failed")

    def snapshot_once(self) -> list[tuple[int, int]]:
        """Copy each rank's newest committed *due* step (a multiple of ``every``: every
        node snapshots the same step numbers) newer than its last snapshot into the
        replica slots (:func:`~kelastic_sidecar.replica.snapshot`): the two newest stay,
        whatever the trainer saves next, so that after the loss of another node the job
        finds a step its replicas and this node's ranks have in common. Returns
        ``(rank, step)`` of each snapshot made; a due step already overwritten is
        skipped (the next one is taken)."""
        try:
            committed = committed_slots(self._directory, self._job)
        except OSError as exc:
            log.error("checkpoint replicas: cannot read the slots in %s: %s", self._directory, exc)
            return []
        with self._lock:
            ranks = self._ranks
        due: dict[int, CommittedSlot] = {}
        for slot in committed:
            if ranks is not None and slot.rank not in ranks:
                continue
            if slot.step % self._settings.every == 0 and (
                    slot.rank not in due or slot.step > due[slot.rank].step):  # fmt: skip
                due[slot.rank] = slot
        made: list[tuple[int, int]] = []
        for rank, slot in sorted(due.items()):
            with self._lock:
                if self.snapped.get(rank, -1) >= slot.step:
                    continue
            source = slot_path(self._directory, rank, slot.slot)
            try:
                placed = snapshot(source, self._replicas, self._job, rank, slot.step)
            except OSError as exc:
                log.warning("checkpoint replicas: rank %d step %d not snapshotted: %s", rank,
                            slot.step, exc)  # fmt: skip
                continue
            if placed is not None:
                with self._lock:
                    self.snapped[rank] = slot.step
                made.append((rank, slot.step))
        return made

    def replicate_once(self) -> list[tuple[int, int]]:
        """Send each rank's newest snapshot the peer has not acknowledged yet. Returns
        ``(rank, step)`` of each one acknowledged; a failure is logged (once until one
        succeeds again), counted and retried at the next pass."""
        with self._lock:
            peer, ranks = self._peer, self._ranks
            snapped = {r: s for r, s in self.snapped.items() if ranks is None or r in ranks}
        if peer is None:
            return []
        sent: list[tuple[int, int]] = []
        for rank, step in sorted(snapped.items()):
            with self._lock:
                if self._peer != peer or self._stop.is_set():
                    break
                if self.acked.get(rank, -1) >= step:
                    continue
            path = _held((self._replicas, self._directory), self._job, rank, step)
            if path is None:  # replaced since (a newer snapshot is on its way)
                continue
            started = time.monotonic()
            try:
                got = send_slot(peer.address, peer.token, self._job, path,
                                rate_bytes_per_s=self._settings.rate or None,
                                timeout=SEND_TIMEOUT)  # fmt: skip
            except ReplicaError as exc:
                self._on_failure(exc)
                if not self._failing:
                    log.warning("checkpoint replicas: rank %d step %d not sent to %s: %s",
                                rank, step, peer.node, exc)  # fmt: skip
                self._failing = True
                continue
            self._failing = False
            with self._lock:
                if self._peer == peer:
                    self.acked[rank] = max(got, self.acked.get(rank, -1))
            self._on_sent(rank, got, _size(path), time.monotonic() - started)
            sent.append((rank, got))
        return sent


def _held(folders: tuple[Path, ...], job: str, rank: int, step: int) -> Path | None:
    """The slot of the first of ``folders`` (the replicas, then the node's own slots)
    holding ``rank``'s committed ``step``, or None."""
    for folder in folders:
        try:
            held = committed_slots(folder, job)
        except OSError:
            continue
        for slot in held:
            if slot.rank == rank and slot.step == step:
                return slot_path(folder, rank, slot.slot)
    return None


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0
