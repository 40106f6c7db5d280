"""In-process restarts of a job, coordinated by the sidecars through etcd.

NVIDIA's in-process restart (``nvidia_resiliency_ext.inprocess``) restarts the
wrapped function in the same processes: a fault in *iteration* ``n`` makes every rank
abort, pass a *termination barrier*, and call the function again as iteration ``n + 1``.
There the coordination lives in a store served by rank 0's process; here nothing lives
only on one rank: each node's sidecar runs one :class:`InProcessCoordinator` that speaks
to its local ranks over ``inprocess.sock`` (:mod:`~kelastic_sidecar.inprocess.server`,
protocol :mod:`kelastic.inprocess_messages`) and agrees with the other nodes through etcd
(:mod:`~kelastic_sidecar.inprocess.record`):

1. ``fault(n)`` from a local rank, ``n`` the current iteration: compare-and-set the
   iteration record ``n -> n + 1`` (one restart spent) while the job's in-process budget
   lasts; a lost race (record already past ``n``) is the fencing at work. Budget spent,
   corrupt record, etcd failing: ``give_up`` to that rank only (it exits; the process
   restart follows, and the supervisor's worker-group stop ends the others). A fault of
   an older iteration is stale and ignored.
2. One etcd watch on the record (and the barrier keys): a higher iteration ``m`` sends
   ``abort(m)`` to every local rank and starts the hard-timeout clock: a rank that has not
   sent ``ready(m)`` within ``hard_timeout`` seconds is SIGKILLed by pid (its exit is then
   the launcher's to report: the process path).
3. Every local rank ``ready(m)``: write ``inprocess/ready/<m>/<node>`` (group rank, pod IP,
   a port picked now), bound to the node's rendezvous lease; once every node of the round
   wrote one, group rank 0's node (the only one watching them) writes
   ``inprocess/go/<m>`` (:mod:`~kelastic_sidecar.inprocess.barrier`); at that key:
   ``go(m)`` to each local rank with the round's env, ``MASTER_ADDR``/``PORT``
   from group rank 0's key and ``KELASTIC_INPROCESS_ITERATION=m``. A barrier not complete
   within ``barrier_timeout`` after the abort gives up (``give_up`` to every local rank).
4. A new abort during the barrier (another fault, ``m2 > m``) supersedes it: only the
   highest iteration is honoured.
5. A worker *process* died (its non-zero exit, from the supervisor's monitor:
   :meth:`InProcessCoordinator.absorb_exit`): the hybrid rung
   (:mod:`~kelastic_sidecar.inprocess.hybrid`): the record moves ``n -> n + 1`` as for a
   fault, the dead rank counts as ready and is started again at the ``go`` (the
   supervisor sends the launcher ``respawn``); refused, the exit is the process path's.
6. The round ends for its membership (a lost node, nodes joining or leaving on purpose,
   a peer's restart; :meth:`InProcessCoordinator.carry`): the node-change rung
   (:mod:`~kelastic_sidecar.inprocess.carry`): every rank aborts and waits for the next
   round's ``go``, with that round's ranks and world size.
7. Otherwise the round ends (the supervisor's monitor returned): ``give_up`` to every
   connected rank and forget the round.

All state changes run on one thread (``inprocess-loop``) from a queue fed by the socket's
reader threads, the etcd watch thread and the supervisor's calls: no locks around the
state, no polling (the loop sleeps until the next event or deadline).

Iterations are job-wide and only grow. A round's workers start in the record's iteration
(the supervisor's ``assign`` carries ``KELASTIC_INPROCESS_ITERATION``, added by
:meth:`InProcessCoordinator.begin_round`); a worker whose ``hello`` says 0 in a later
iteration is taken to be in the round's first one.

Over ~400 lines as one cohesive thing: the supervisor's calls into one node's coordinator
and the threads that feed its machine; this docstring is the protocol's description, and
the state lives in :mod:`~kelastic_sidecar.inprocess.machine` and its rungs' parts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Final, TypeVar

from kelastic import contract
from kelastic.control_messages import Assign, WorkerAssignment
from kelastic_etcd import EtcdClient, EtcdError, Watcher

from ..config import InProcessSettings
from ..failure import Failure
from ..metrics import SidecarMetrics
from .barrier import TerminationBarrier
from .carry import CarryRung, carry_request, with_master
from .hybrid import RespawnRung
from .machine import RestartMachine
from .parts import OnKill, OnPromote, OnRespawn, no_kill, no_promote, no_respawn
from .record import (
    Advance,
    AdvanceOutcome,
    IterationRecord,
    IterationRecordError,
    decode_iteration_record,
    encode_iteration_record,
)
from .round import RoundContext
from .server import InProcessServer
from .spares import SpareRung

if TYPE_CHECKING:
    from pathlib import Path

    from ..rendezvous import EtcdRendezvousHandler, RendezvousInfo
    from ..round_end import RoundEnd

__all__ = ["InProcessCoordinator", "RoundContext", "lease_of"]

log = logging.getLogger("kelastic_sidecar.inprocess")

T = TypeVar("T")

#: Seconds a supervisor call waits for the coordinator's thread.
CALL_TIMEOUT: Final = 30.0


def lease_of(handler: EtcdRendezvousHandler | None) -> Callable[[], int | None]:
    """A :attr:`RoundContext.lease_id` reading ``handler``'s current lease (it changes
    when etcd was away longer than the lease TTL)."""

    def current() -> int | None:
        lease = handler.state.lease if handler is not None else None
        return lease.id if lease is not None and not lease.lost else None

    return current


class InProcessCoordinator:
    """One node's in-process restart coordinator (see the module doc): the socket
    server, the loop thread running the :class:`~.machine.RestartMachine`,
    the etcd watch thread, and the supervisor's calls.

    Args:
        settings: the knobs; when not ``enabled`` every method is a no-op and
            :meth:`status` is None.
        store: the etcd client.
        keys: the job's key layout.
        node: this node's name.
        metrics: the sidecar's metrics.
        run_dir: where ``inprocess.sock`` is created.
        pod_ip: this node's address (``MASTER_ADDR`` of an iteration when group rank 0).
        kill: how a rank is killed (``os.kill``; tests may watch it).
        clock: monotonic seconds.
        on_respawn: ``(round, local_rank, env)``: start that dead local rank again with
            ``env`` (called on the loop thread; it must not block; the supervisor queues a
            ``respawn`` for the launcher).
        on_promote: ``(round, spare_slot, local_rank)``: a waiting spare took that dead
            local rank's place (called on the loop thread; it must not block; the
            supervisor queues a ``promote`` for the launcher).
        on_kill: ``(pid, why)``: the hard timeout is about to SIGKILL that worker (called
            on the loop thread before the kill; it must not block; the supervisor queues
            it as a reap, so its monitor holds every hang).
    """

    def __init__(
        self,
        settings: InProcessSettings,
        store: EtcdClient,
        keys: contract.Keys,
        node: str,
        metrics: SidecarMetrics,
        run_dir: Path,
        pod_ip: str,
        *,
        kill: Callable[[int, int], None] = os.kill,
        clock: Callable[[], float] = time.monotonic,
        on_respawn: OnRespawn | None = None,
        on_promote: OnPromote | None = None,
        on_kill: OnKill | None = None,
    ) -> None:
        self.settings = settings
        self.enabled = settings.enabled
        self._store = store
        self._keys = keys
        self.node = node
        self.pod_ip = pod_ip
        self._metrics = metrics
        self._clock = clock
        self._events: queue.Queue[Callable[[], None]] = queue.Queue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.server = InProcessServer(
            contract.inprocess_socket_path(run_dir),
            on_message=lambda s, m: self._events.put(lambda: self.machine.message(s, m)),
            on_closed=lambda s: self._events.put(lambda: self.machine.closed(s)),
            on_drop=lambda reason: metrics.inprocess_dropped.labels(reason=reason).inc(),
        )
        #: The state; only the loop thread touches it.
        spares, carry = SpareRung(), CarryRung()
        self.machine = RestartMachine(
            settings, store, keys, node, metrics, self.server.drop,
            respawn=RespawnRung(spares), spares=spares, carry=carry,
            barrier=TerminationBarrier(carry), on_respawn=on_respawn or no_respawn,
            on_promote=on_promote or no_promote, kill=kill, on_kill=on_kill or no_kill,
            clock=clock,
        )  # fmt: skip
        self._status: dict[str, Any] | None = self.machine.status_doc() if self.enabled else None
        #: The watch thread's copy of the record and barrier keys: key -> (value, revision).
        self._view: dict[str, tuple[bytes, int]] = {}
        self._ready_root = keys.inprocess_ready_prefix(0)[: -len("0/")]
        #: The watch thread's current watch and what it covers (:meth:`_watched`).
        self._watcher: Watcher | None = None
        self._watching: tuple[str, ...] = ()

    # ------------------------------------------------------------------ supervisor API

    def start(self) -> None:
        """Bind ``inprocess.sock`` and start the coordinator and etcd watch threads.

        Raises:
            OSError: the socket cannot be created.
        """
        if not self.enabled:
            return
        self.server.start()
        for target, name in ((self._loop, "inprocess-loop"), (self._watch, "inprocess-watch")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info(
            "in-process restarts on: budget %d, soft timeout %.1fs, hard timeout %.1fs",
            self.settings.max_restarts, self.settings.soft_timeout, self.settings.hard_timeout,
        )  # fmt: skip

    def close(self) -> None:
        """Stop the threads and the socket (connected ranks see it close); idempotent."""
        if not self.enabled:
            return
        self._stop.set()
        self._events.put(lambda: None)
        watcher = self._watcher
        if watcher is not None:  # its wait raises now, not at its timeout
            watcher.close()
        self.server.close()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5.0)

    def begin_round(
        self, assign: Assign, info: RendezvousInfo, handler: EtcdRendezvousHandler | None
    ) -> Assign:
        """A round starts with ``assign`` (not sent yet): remember its context (the ready
        keys are bound to ``handler``'s lease), and return the ``assign`` with
        ``KELASTIC_INPROCESS_ITERATION`` (the job's current iteration) in every worker's
        env and the node's spare ranks (``spares``). Unchanged when disabled. Raises
        nothing (a coordinator that does not answer within 30 s is logged; the round then
        goes on without in-process restarts).
        """
        if not self.enabled:
            return assign
        ctx = RoundContext(
            round=info.round, group_rank=info.group_rank,
            group_world_size=info.group_world_size, nproc=len(assign.workers),
            envs={w.local_rank: dict(w.env) for w in assign.workers}, pod_ip=self.pod_ip,
            participants=tuple(info.participants), lease_id=lease_of(handler),
        )  # fmt: skip
        base = self.begin(with_master(ctx, assign.workers[0].env) if assign.workers else ctx)
        workers = tuple(
            WorkerAssignment(w.local_rank, {**w.env, contract.ENV_INPROCESS_ITERATION: str(base)})
            for w in assign.workers
        )
        return replace(assign, workers=workers, spares=self.settings.spare_ranks)

    def begin(self, ctx: RoundContext) -> int:
        """Start coordinating the round ``ctx``; return the iteration its workers start in
        (the record's, read now; the last known when etcd does not answer). A corrupt
        record is counted and replaced by a fresh one past every iteration this node knew
        of (as :class:`~kelastic_sidecar.restart_budget.RestartBudget` repairs its own)."""
        record = self._read_or_repair() or IterationRecord()
        try:
            return self._call(lambda: self.machine.begin(ctx, record))
        except TimeoutError:
            log.error("the in-process coordinator is stuck; round %d starts without it", ctx.round)
            return record.iteration
        finally:
            watcher = self._watcher
            if watcher is not None and self._watched() != self._watching:
                watcher.wake()  # group rank 0 now, or no longer: the watch changes

    def end_round(self, reason: str) -> None:
        """The round ended for this node: ``give_up`` to every connected rank, forget the
        round (the job's iteration stays)."""
        if not self.enabled:
            return
        try:
            self._call(lambda: self.machine.end(reason))
        except TimeoutError:
            log.error("the in-process coordinator is stuck; its ranks are stopped anyway")

    def carry(self, end: RoundEnd) -> bool:
        """The round ended (``end``, from the supervisor's monitor): True when the
        workers stay for the next round (the node-change rung,
        :mod:`~kelastic_sidecar.inprocess.carry`: a lost node, nodes joining or leaving on
        purpose, a peer's restart; every rank aborts and waits for the next round's
        ``go``); the supervisor then stops nothing and sends no ``assign``, and calls
        :meth:`begin_round` as usual. False (the process path; call :meth:`end_round`):
        disabled, another kind of end, no round running in process, a rank that never
        said ``hello``, the budget spent for a lost node, etcd failing, or a coordinator
        that does not answer within 30 s. Raises nothing."""
        request = carry_request(end) if self.enabled else None
        if request is None:
            return False
        try:
            return self._call(lambda: self.machine.carry(request))
        except TimeoutError:
            log.error("the in-process coordinator is stuck; the workers start again")
            return False

    def absorb_exit(self, local_rank: int, pid: int | None, failure: Failure) -> bool:
        """A worker of the round exited non-zero (``failure``, from
        :func:`~kelastic_sidecar.round_end.classify_exit`; a timer-server reap and this
        coordinator's hard-timeout kill included): True when the hybrid rung takes it (its
        peers restart in process, it is started again at the ``go`` through
        ``on_respawn``); False for the process path: disabled, no round running in process,
        the in-process budget spent, etcd failing, a rank that died again before its
        ``hello`` (see :func:`~kelastic_sidecar.inprocess.hybrid_verdicts.absorb_verdict`), or a
        coordinator that does not answer within 30 s. Raises nothing.
        """
        if not self.enabled:
            return False
        try:
            return self._call(lambda: self.machine.absorb(local_rank, pid, failure))
        except TimeoutError:
            log.error("the in-process coordinator is stuck; local rank %d's exit ends the round",
                      local_rank)  # fmt: skip
            return False

    def status(self) -> dict[str, Any] | None:
        """``/status``'s ``inprocess``: ``enabled``, ``iteration``, ``restarts``,
        ``max_restarts``, ``phase``, ``respawns`` (dead local ranks this node started
        again: the hybrid rung), ``spares`` (``configured``: spare ranks per node,
        ``waiting``: their slots waiting now, ``promoted``: dead ranks they replaced),
        ``last`` (``iteration``, ``cause`` (a fault's, or ``worker_died``/``hang`` for a
        dead worker), ``rank``, ``node``, ``message``, ``died`` (the local workers whose
        death this restart took, one line each, e.g. ``local rank 1 (pid 4242) killed by
        SIGKILL``; only on their node), ``signal`` (the last one's, e.g. ``SIGKILL``),
        ``promoted`` (those a waiting spare replaced, one line each), ``resumed_s``:
        seconds from the abort until every local rank progressed, None until then); None
        when disabled."""
        doc = self._status
        return None if doc is None else {**doc, "last": dict(doc["last"] or {}) or None}

    # ------------------------------------------------------------------ threads

    def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the loop thread and return its result.

        Raises:
            TimeoutError: the loop did not run it within :data:`CALL_TIMEOUT` seconds.
        """
        box: list[T] = []
        done = threading.Event()

        def run() -> None:
            try:
                box.append(fn())
                self._status = self.machine.status_doc()  # what the caller sees next
            finally:
                done.set()

        self._events.put(run)
        if not done.wait(CALL_TIMEOUT) or not box:
            raise TimeoutError("the in-process coordinator did not answer")
        return box[0]

    def _loop(self) -> None:
        while not self._stop.is_set():
            deadline = self.machine.next_deadline()
            wait = None if deadline is None else max(0.0, deadline - self._clock())
            try:
                event = self._events.get(timeout=wait)
            except queue.Empty:
                event = None
            try:
                if event is not None:
                    event()
                self.machine.expire()
            except Exception:  # one bad event must not end coordination
                log.exception("in-process coordinator: unexpected error")
            self._status = self.machine.status_doc()

    def _watched(self) -> tuple[str, ...]:
        """What this node's watch covers: the record and the ``go`` keys, and the ready
        keys while it is its round's group rank 0 (the ``go``'s one writer: see
        :mod:`~kelastic_sidecar.inprocess.barrier`)."""
        ctx = self.machine.ctx  # the loop thread's; a reference read is atomic
        keys = (self._keys.inprocess_iteration, self._keys.inprocess_go_prefix)
        return (*keys, self._ready_root) if ctx is not None and ctx.group_rank == 0 else keys

    def _watch(self) -> None:
        """The etcd watch on the record and the barrier's keys (:meth:`_watched`): keep a
        copy of those keys (one read, then each change applied from the watch's events:
        no read per change), hand the record and the current iteration's barrier keys to
        the loop. Re-created when the node becomes or stops being group rank 0."""
        watcher: Watcher | None = None
        since = 0
        while not self._stop.is_set():
            try:
                want = self._watched()
                if watcher is None or want != self._watching:
                    if watcher is not None:
                        watcher.close()
                    watcher = None
                    watcher = self._watcher = Watcher(self._store, want, journal=True)
                    self._watching, since = want, 0
                    continue  # the role may have changed meanwhile: look again first
                if since and not watcher.wait(since, 1.0):
                    continue
                if self._watched() != self._watching:
                    continue  # woken by a new role (begin): re-create the watch first
                since = self._read_view(watcher, since)
            except Exception as exc:  # EtcdError, or a bug: the watch must go on
                if self._stop.is_set():
                    break  # closed (close() closes the watch)
                if isinstance(exc, EtcdError):
                    log.warning("in-process watch: %s; retrying", exc)
                else:
                    log.exception("in-process watch: unexpected error; retrying")
                if watcher is not None:
                    watcher.close()
                watcher = None
                self._stop.wait(1.0)
        if watcher is not None:
            watcher.close()

    def _read_view(self, watcher: Watcher, since: int) -> int:
        """Bring the copy of the watched keys up to date (the watch's events since
        ``since``; a read of them all at first, or when the events are not all known),
        queue what the machine needs; return the revision the copy is at. When the only
        change was a write of the record (an abort), the machine gets it alone.

        Raises:
            EtcdError: etcd did not answer.
        """
        key = self._keys.inprocess_iteration
        events = watcher.events_since(since) if since else None
        if not events:  # the first time, or events not all known (or none: read anyway)
            snap = self._store.read(list(self._watching))
            self._view = dict(snap.values)
            revision = snap.revision
        else:
            for name, value, rev in events:
                if value is None:
                    self._view.pop(name, None)
                else:
                    self._view[name] = (value, rev)
            revision = max([since, *(rev for _, _, rev in events)])
            if all(name == key and value is not None for name, value, _ in events):
                put = self._view[key]
                self._events.put(lambda: self.machine.view(put, -1, {}))
                return revision
        raw = self._view.get(key)
        target = self.machine.iteration
        if raw is not None:
            with contextlib.suppress(IterationRecordError):
                target = max(target, decode_iteration_record(raw[0], key).iteration)
        prefix, go = self._keys.inprocess_ready_prefix(target), self._keys.inprocess_go(target)
        barrier = {k: v for k, v in self._view.items() if k.startswith(prefix) or k == go}
        self._events.put(lambda: self.machine.view(raw, target, barrier))
        return revision

    def _read_or_repair(self) -> IterationRecord | None:
        """The record now (a missing one is iteration 0); a corrupt one is counted and
        replaced by compare-and-set; None when etcd does not answer (logged)."""
        key = self._keys.inprocess_iteration
        try:
            got = self._store.get(key)
            if got is None:
                return IterationRecord()
            try:
                return decode_iteration_record(got[0], key)
            except IterationRecordError as exc:
                known = self.machine
                fresh = IterationRecord(iteration=known.iteration + 1, restarts=known.restarts)
                self._store.cas(key, encode_iteration_record(fresh), got[1])
                out = AdvanceOutcome(Advance.ADVANCED, fresh, 0, "", str(exc), got[1])
                self._events.put(lambda: self.machine.corrupt.replaced(out))  # on its thread
                return self._read_or_repair_once()
        except EtcdError as exc:
            log.error("cannot read the in-process record: %s", exc)
            return None

    def _read_or_repair_once(self) -> IterationRecord | None:
        got = self._store.get(self._keys.inprocess_iteration)
        try:
            return IterationRecord() if got is None else decode_iteration_record(got[0])
        except IterationRecordError:
            return None
