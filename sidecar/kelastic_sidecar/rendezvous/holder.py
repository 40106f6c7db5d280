"""The rendezvous state holder: one node's view of the rendezvous keys in etcd.

It reads the state key with the alive, departure and join-request keys in one
transaction (:class:`View`), writes the state by compare-and-set on the state key's
``mod_revision`` (the CAS token, :attr:`View.token`), removes dead nodes
(:meth:`RendezvousStateHolder.sync`), and holds the node's etcd session: its lease, its
alive key and its join request, and the long-lived watch a waiting node needs. The
operations that drive it (join, exit, leave, close) are
:class:`~kelastic_sidecar.rendezvous.executor.RendezvousExecutor`'s; the public API is
:class:`~kelastic_sidecar.rendezvous.handler.EtcdRendezvousHandler`'s. See the module
docstring of :mod:`kelastic_sidecar.rendezvous.handler` for the design.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kelastic.contract import Keys
from kelastic.etcd_values import decode_departure
from kelastic_etcd import EtcdClient, EtcdError, EtcdLeaseNotFound, Lease, Snapshot, Watcher

from .state import (
    CorruptStateError,
    RendezvousError,
    RendezvousSettings,
    RendezvousState,
    decode_state,
    encode_state,
    sanitize,
)

log = logging.getLogger("kelastic_sidecar.rendezvous")


@dataclass(frozen=True)
class View:
    """A sanitized state as read from etcd."""

    state: RendezvousState
    token: int | None  # mod_revision of the state key; None when there is none yet
    alive: frozenset[str]
    revision: int  # store revision of the read
    departing: dict[str, str]  # node -> reason of the operator's departure notices
    joining: dict[str, int]  # node -> mod_revision of its pending join request
    # The state came from a watch event, the rest from an earlier read: good for
    # finishing an operation, not for deciding a write (see RendezvousExecutor's wait).
    partial: bool = False


class RendezvousStateHolder:
    """One node's state, session and writes in the rendezvous (see the module docstring).

    Args: see :class:`~kelastic_sidecar.rendezvous.handler.EtcdRendezvousHandler`.

    Attributes:
        store, keys, node, settings: as given.
        join_requested: our join request was written in the current ``next_rendezvous``.
        announced: our alive key was written at least once.
        corrupt_states: corrupt states read (and replaced on the next write).
    """

    def __init__(
        self,
        store: EtcdClient,
        keys: Keys,
        node: str,
        settings: RendezvousSettings,
        on_corrupt: Callable[[CorruptStateError], None] | None = None,
    ) -> None:
        self.store = store
        self.keys = keys
        self.node = node
        self.settings = settings
        # What a waiting node must notice: a state write, a departure notice, and a
        # lease gone (its alive key deleted); a peer's alive key appearing changes
        # nothing by itself (its join request and state write follow).
        self._watch = [keys.rdzv_state, keys.departing_prefix]
        self._watch_gone = [keys.alive_prefix]
        # Join requests: a joining node announces itself here (bound to its lease), and
        # whoever writes the state for its own join applies the others' requests too.
        self._joining_prefix = keys.joining_prefix
        self._joining_key = keys.joining(node)
        self._reads = [
            keys.rdzv_state,
            keys.alive_prefix,
            keys.departing_prefix,
            self._joining_prefix,
        ]
        self._names_only = [keys.alive_prefix, self._joining_prefix]  # values unused
        self.join_requested = False
        self.announced = False
        self._lease: Lease | None = None
        self._lease_lock = threading.Lock()
        self._watcher: Watcher | None = None  # created by open()
        self._shut_down = False
        self._on_corrupt = on_corrupt
        self.corrupt_states = 0
        self._max_round = -1  # highest round read from a valid state

    # ------------------------------------------------------------------ session

    @property
    def lease(self) -> Lease | None:
        """This node's current lease (``None`` before the first grant)."""
        return self._lease

    @property
    def lease_lost(self) -> bool:
        """True when this node's lease was lost (expired, or revoked by :meth:`shutdown`)."""
        lease = self._lease
        return lease is not None and lease.lost

    def open(self) -> None:
        """Grant the lease (unless a live one is held) and create the watcher.

        Raises:
            RendezvousError: the holder was shut down.
            EtcdError: etcd failed.
        """
        with self._lease_lock:
            self._check_open()
            if self._lease is None or self._lease.lost:
                self._lease = self.store.grant_lease(self.settings.lease_ttl)
        self.waiter()

    def waiter(self) -> Watcher:
        """The session's watcher, created on first use when :meth:`open` was not called."""
        with self._lease_lock:
            self._check_open()
            if self._watcher is None:
                self._watcher = Watcher(self.store, self._watch, deletions=self._watch_gone)
            return self._watcher

    def _check_open(self) -> None:
        if self._shut_down:
            raise RendezvousError(f"{self.node}: the rendezvous handler was shut down")

    def shutdown(self) -> None:
        """Close the watch, stop the keep-alive and revoke the lease: the alive key
        vanishes. Final; idempotent; an unreachable etcd is logged (the lease then
        expires after its TTL)."""
        with self._lease_lock:
            self._shut_down = True
            lease, watcher = self._lease, self._watcher
        if watcher is not None:
            watcher.close()
        if lease is None:
            return
        try:
            lease.revoke()
        except EtcdError as exc:
            log.warning(
                "%s: cannot revoke lease %x (%s); it expires by its TTL", self.node, lease.id, exc
            )

    # ------------------------------------------------------------------ state

    def lease_gone(self, view: View) -> bool:
        """Whether our lease is gone: lost by the keep-alive (no refresh for a TTL, or
        etcd said so), or our alive key is missing and etcd says the lease is gone.

        An alive key deleted while our lease lives is the operator taking this node out
        (its Pod is going): that is not a lost lease.
        """
        lease = self._lease
        if lease is None:
            return False
        if lease.lost:
            return True
        return self.node not in view.alive and not lease.check()

    def ensure_alive(self, request_join: bool = False) -> View:
        """Hold a live lease and write our alive key bound to it; the view right after.

        With ``request_join``, our join request is written too. The writes and the read
        are one etcd transaction.
        """
        with self._lease_lock:
            self._check_open()
            value = json.dumps(
                {
                    "node": self.node,
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "since": time.time(),
                }
            ).encode()
            for _ in range(3):
                lease = self._lease
                if lease is None or lease.lost:
                    if lease is not None:
                        log.warning("%s: lease %x lost; taking a new one", self.node, lease.id)
                    lease = self._lease = self.store.grant_lease(self.settings.lease_ttl)
                puts = {self.keys.alive(self.node): value}
                if request_join:
                    puts[self._joining_key] = b"join"
                try:
                    snap = self.store.put_read(
                        puts, self._reads, lease=lease.id, keys_only=self._names_only
                    )
                    self.join_requested = self.join_requested or request_join
                    self.announced = True
                    return self.view(snap)
                except EtcdLeaseNotFound:
                    lease.stop_keep_alive()
                    self._lease = None
            raise RendezvousError(f"{self.node}: cannot keep an etcd lease alive")

    def read(self) -> View:
        return self.view(self.store.read(self._reads, keys_only=self._names_only))

    def view(self, snap: Snapshot) -> View:
        """The view of a snapshot of the state key, the alive, departing and joining keys."""
        alive: set[str] = set()
        departing: dict[str, str] = {}
        joining: dict[str, int] = {}
        alive_prefix, departing_prefix = self.keys.alive_prefix, self.keys.departing_prefix
        for key, (raw, revision) in snap.values.items():
            if key.startswith(alive_prefix):
                alive.add(key[len(alive_prefix) :])
            elif key.startswith(self._joining_prefix):
                joining[key[len(self._joining_prefix) :]] = revision
            elif key.startswith(departing_prefix):
                departing[key[len(departing_prefix) :]] = decode_departure(raw)
        got = snap.values.get(self.keys.rdzv_state)
        if got is None:
            state, token = RendezvousState(run_id=self.settings.run_id), None
        else:
            try:
                state = decode_state(
                    got[0], run_id=self.settings.run_id, where=self.keys.rdzv_state
                )
            except CorruptStateError as exc:
                state = self._replacement(exc, snap.revision)
            else:
                self._max_round = max(self._max_round, state.round)
            token = got[1]
        return View(state, token, frozenset(alive), snap.revision, departing, joining)

    def _replacement(self, exc: CorruptStateError, revision: int) -> RendezvousState:
        """A fresh state to put over a corrupt one. Its round is above every round used
        before: each round took at least one write of the state key, so rounds stay
        below the store's revision (and below this node's highest round + 1)."""
        self.corrupt_states += 1
        fresh = RendezvousState(
            run_id=self.settings.run_id, round=max(revision, self._max_round + 1)
        )
        log.error("%s; replacing it with a fresh state of round %d", exc, fresh.round)
        if self._on_corrupt is not None:
            try:
                self._on_corrupt(exc)
            except Exception:
                log.exception("on_corrupt callback failed")
        return fresh

    def write(
        self, view: View, new: RendezvousState, admitted: tuple[str, ...] = ()
    ) -> tuple[bool, View]:
        """Compare-and-set ``new`` over ``view``: (whether it was written, the view after).

        One etcd transaction: the view after the write, or after a lost write what the
        winner wrote, comes back with it, so no read follows. The join requests of
        ``admitted`` (applied in ``new``) must still be those of ``view`` and are
        deleted with the write, and so is ours once ``new`` lists us.
        """
        require = {self._joining_prefix + n: view.joining[n] for n in admitted}
        delete = list(require)
        listed = new.participants.keys() | new.wait_list | new.redundancy_list
        if self.node in view.joining and self.node in listed:
            delete.append(self._joining_key)
        ok, snap = self.store.cas_read(  # the state by compare-and-set on its mod_revision
            self.keys.rdzv_state,
            encode_state(new),
            view.token,
            self._reads[1:],
            keys_only=self._names_only,
            require=require,
            delete=delete,
        )
        return ok, self.view(snap)

    def request_join(self) -> View:
        """Write our join request (bound to our lease); the view right after."""
        lease = self._lease
        snap = self.store.put_read(
            {self._joining_key: b"join"},
            self._reads,
            lease=lease.id if lease is not None else None,
            keys_only=self._names_only,
        )
        self.join_requested = True
        return self.view(snap)

    def withdraw_join_request(self) -> None:
        """Delete our join request (best effort: it goes with our lease anyway).

        It is not written again in this :meth:`next_rendezvous`.
        """
        try:
            self.store.delete(self._joining_key)
        except EtcdError as exc:
            log.warning("%s: cannot withdraw the join request (%s)", self.node, exc)

    def sync(self, view: View | None = None, tolerate: frozenset[str] = frozenset()) -> View:
        """Read the state (unless ``view`` is current) and write back the removal of dead
        nodes, if any; the nodes of ``tolerate`` are not removed for a missing alive key."""
        view = self.read() if view is None else view
        while True:
            alive = view.alive | tolerate
            clean, dead = sanitize(view.state, alive, self.settings, view.departing)
            if not dead:
                return view
            before = view.state
            ok, view = self.write(view, clean)
            if ok:
                self.log_dead(before, dead)

    def log_dead(self, state: RendezvousState, dead: tuple[str, ...]) -> None:
        log.warning(
            "%s: removed %s from round %d of %s: etcd lease gone (node dead or cut off)",
            self.node, ", ".join(dead), state.round, self.settings.run_id,
        )  # fmt: skip
