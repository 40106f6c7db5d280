"""Replication of checkpoint slots between sidecars: the transport.

Each node's sidecar sends its ranks' newest committed slot files to a peer node's
sidecar, and a replacement node fetches a rank's slot back from whichever sidecar holds
it, so that a job restores from memory even when a node and its slots are gone. The idea
is DLRover flash checkpoint's backup groups (each node's shared-memory checkpoint copied
to a peer node's memory) and ML Flashpoint's peer replication (a node's checkpoint kept
on its peers, restored from them).

This package is the transport only (what to send, to whom and when is decided
elsewhere): the protocol's one codec (:mod:`.wire`: JSON lines, bounded and strict), a
TCP server (:class:`ReplicaServer`: puts stored as ``replicas/rank-<R>.slot0|1`` in the
node's checkpoint folder, gets served from the node's own slots or its replicas, both
authenticated by the job's shared token) and its two clients (:func:`send_slot`,
:func:`fetch_slot`). Slot bytes travel with ``sendfile`` and are received through a
4 MiB buffer into their file (never a slot-sized object in memory); a server checks a
replica's header only, and a replica is verified in full
(:func:`kelastic.checkpoint.scan.verified_step`) before it is used: :func:`fetch_slot`
makes the same checks on the bytes while it receives them, before it places the slot.
"""

from .client import ReplicaError, fetch_slot, send_slot, sweep_fetches
from .server import RefuseReason, ReplicaServer
from .slots import REPLICA_DIR_NAME, REPLICA_SLOTS, snapshot
from .wire import ReplicaWireError, new_token

__all__ = [
    "REPLICA_DIR_NAME",
    "REPLICA_SLOTS",
    "RefuseReason",
    "ReplicaError",
    "ReplicaServer",
    "ReplicaWireError",
    "fetch_slot",
    "new_token",
    "send_slot",
    "snapshot",
    "sweep_fetches",
]
