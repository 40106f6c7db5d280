"""Spare workers of an attempt: in-process restart's spare ranks, the launcher's half.

With ``spares`` in an ``assign`` (``spec.inProcess.spareRanks``) the launcher starts that
many extra processes of the worker command beside the attempt's workers, in *spare slots*
``nproc .. nproc + spares - 1``. A spare runs the script like a worker (imports, data, the
model: warm) until :class:`kelastic.inprocess.Wrapper`, which says ``hello`` as a spare
and waits there. Its env is local rank 0's with ``LOCAL_RANK`` = its slot,
``RANK``/``ROLE_RANK`` at or above ``WORLD_SIZE`` (NVIDIA's inactive ranks; unique in the
job), ``KELASTIC_INPROCESS_SPARE=1`` and no timer token.

When a worker of the attempt dies and its peers restart in process, the sidecar's
coordinator sends one waiting spare the ``go`` of the dead rank (its env) and the
launcher a ``promote`` (:class:`kelastic.control_messages.Promote`): :meth:`Spares.promote`
makes the spare's process that local rank (its exit, error file and log prefix are the
rank's from then on), and a new spare starts in the freed slot (forked from the zygote
when warm start is on). A spare that dies while waiting is no failure of the attempt: it
is logged and replaced (at most :data:`MAX_REPLACEMENTS` times per slot and attempt, so a
script that cannot start does not loop); one that exits 0 was told it is not needed and
is not replaced. Spares stop with their attempt's workers
(:meth:`kelastic._workers.WorkerGroup.terminate`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final

from kelastic import contract
from kelastic._workers import Spawner, Worker, WorkerGroup, WorkerSpec
from kelastic.control_messages import Promote, Started

__all__ = ["MAX_REPLACEMENTS", "SpareKeeper", "Spares", "spare_env"]

logger = logging.getLogger("kelastic.launch")

#: Spares a slot may get per attempt after its first (dead spares replaced, promoted
#: ones not counted).
MAX_REPLACEMENTS: Final = 5


def spare_env(template: Mapping[str, str], nproc: int, spares: int, index: int) -> dict[str, str]:
    """The env of spare ``index`` (0-based) of a node running ``nproc`` workers and
    ``spares`` spares, from ``template``, the full env of its local rank 0.

    ``LOCAL_RANK`` is the spare slot ``nproc + index``; ``RANK`` and ``ROLE_RANK`` are
    ``WORLD_SIZE + GROUP_RANK * spares + index`` (unique in the job, never a real rank;
    ``WORLD_SIZE + index`` when the template lacks them); ``KELASTIC_TIMER_TOKEN`` is
    removed (a spare owns no timers until promoted); ``KELASTIC_INPROCESS_SPARE=1``; no
    agreed checkpoint step (:func:`kelastic.contract.without_restore`: no rank's state is
    a spare's own; promoted, its peers hold the state in process).
    """
    env = dict(template)
    try:
        world = int(env.get(contract.WORLD_SIZE, "0"))
        group = int(env.get(contract.GROUP_RANK, "0"))
    except ValueError:
        world, group = 0, 0
    placeholder = str(max(world, 0) + max(group, 0) * spares + index)
    env[contract.LOCAL_RANK] = str(nproc + index)
    env[contract.RANK] = env[contract.ROLE_RANK] = placeholder
    env.pop(contract.KELASTIC_TIMER_TOKEN, None)
    env[contract.ENV_INPROCESS_SPARE] = "1"
    return contract.without_restore(env)  # no rank's state is a spare's own


class Spares:
    """The spare slots of one attempt (see the module doc).

    Args:
        group: the attempt's workers (:attr:`WorkerGroup.spares` holds the spares).
        count: spares wanted.
        template: the full env of the attempt's local rank 0.
        cmd: the worker command.
        log_root: the attempt's log folder (``logs/attempt_<n>/``); spare ``i``'s
            ``g``-th process logs in ``spare<i>.<g>/`` there.
    """

    def __init__(
        self,
        group: WorkerGroup,
        count: int,
        template: Mapping[str, str],
        cmd: list[str],
        log_root: Path,
    ) -> None:
        self.group = group
        self._log_root = log_root
        self.count = count
        self.nproc = len(group.workers)
        self._template = dict(template)
        self._cmd = cmd
        self._generation: dict[int, int] = {}  # slot -> spares started in it
        self._replaced: dict[int, int] = {}  # slot -> dead spares replaced
        self._dead: dict[int, Worker] = {}  # pid -> a spare that died (for a late promote)

    @property
    def slots(self) -> range:
        """The spare slots (local ranks of spares)."""
        return range(self.nproc, self.nproc + self.count)

    def start_all(self, spawner: Spawner | None) -> None:
        """Start a spare in every slot (after the workers: they start first)."""
        for slot in self.slots:
            self._start(slot, spawner)

    def _start(self, slot: int, spawner: Spawner | None) -> Worker:
        group = self.group
        generation = self._generation.get(slot, 0)
        self._generation[slot] = generation + 1
        index = slot - self.nproc
        log_dir = self._log_root / f"spare{index}.{generation}"
        env = spare_env(self._template, self.nproc, self.count, index)
        env[contract.TORCHELASTIC_ERROR_FILE] = str(log_dir / contract.ERROR_FILE_NAME)
        label = f"spare{env[contract.RANK]}"  # unique in the job: "[spare4]: ..." lines
        worker = Worker(WorkerSpec(slot, label, env, log_dir))
        group.spares[slot] = worker
        worker.start(self._cmd, spawner)
        if worker.pid is not None:
            logger.info("attempt %d: spare %d (%s) started, pid %d%s", group.attempt, index,
                        label, worker.pid, " (warm)" if worker.warm else "")  # fmt: skip
        else:
            worker.reported = True  # could not start: tend() does not retry it
        return worker

    def tend(self, spawner: Spawner | None) -> list[Worker]:
        """Replace the spares that died while waiting (not while the group stops; not one
        that exited 0: it was told it is not needed). Returns the new spares."""
        group = self.group
        started: list[Worker] = []
        if group.stopping or group.stopped:
            return started
        for slot, worker in list(group.spares.items()):
            if worker.returncode is None or worker.reported:
                continue
            worker.reported = True
            if worker.pid is not None:
                self._dead[worker.pid] = worker
            rc = worker.returncode
            how = f"killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
            index = slot - self.nproc
            if rc == 0:
                logger.info("attempt %d: spare %d (pid %s) exited: not needed",
                            group.attempt, index, worker.pid)  # fmt: skip
                continue
            if self._replaced.get(slot, 0) >= MAX_REPLACEMENTS:
                logger.error("attempt %d: spare %d (pid %s) %s; %d replaced already: slot left "
                             "empty", group.attempt, index, worker.pid, how,
                             MAX_REPLACEMENTS)  # fmt: skip
                continue
            self._replaced[slot] = self._replaced.get(slot, 0) + 1
            logger.warning("attempt %d: spare %d (pid %s) %s while waiting (no failure of the "
                           "attempt); starting a new one", group.attempt, index, worker.pid,
                           how)  # fmt: skip
            started.append(self._start(slot, spawner))
        return started

    def promote(self, slot: int, local_rank: int, pid: int, env: Mapping[str, str]) -> Worker:
        """Make the spare ``pid`` of ``slot`` the worker of ``local_rank`` (whose process
        exited and was reported); ``env`` is the rank's spec env (what the spare's ``go``
        gave it). The slot is then empty: :meth:`refill` it. A spare that died since its
        ``go`` (before or after :meth:`tend` saw it) becomes that rank all the same, with
        its exit not reported yet: the caller reports it as the rank's exit (the sidecar
        then takes it as that rank's death).

        Returns:
            The worker, running or exited.

        Raises:
            ValueError: ``pid`` is no spare of ``slot`` (alive or dead) of this attempt,
                or ``local_rank`` has no exited, reported worker.
        """
        group = self.group
        spare = group.spares.get(slot)
        old = group.workers.get(local_rank)
        if old is None or old.running or not old.reported:
            raise ValueError(f"local_rank {local_rank} has no exited, reported worker")
        if spare is not None and spare.pid == pid:
            del group.spares[slot]
        else:
            # only a promote that fits takes the dead spare: one naming another slot
            # must not lose it for the right one that follows
            spare = self._dead.get(pid)
            if spare is None or spare.spec.local_rank != slot:
                raise ValueError(f"pid {pid} is no spare of slot {slot}")
            del self._dead[pid]
        spare.reported = False  # its exit, when it comes or came, is the rank's
        label = env.get(contract.RANK) or str(local_rank)
        error_file = str(spare.spec.log_dir / contract.ERROR_FILE_NAME)  # as at its start
        spare.relabel(WorkerSpec(local_rank, label, {**env, contract.TORCHELASTIC_ERROR_FILE:
                                                     error_file}, spare.spec.log_dir))  # fmt: skip
        group.workers[local_rank] = spare
        logger.warning("attempt %d: local_rank %d (rank %s) is now pid %d, the spare of slot %d "
                       "(no process start; its logs stay in %s)%s", group.attempt, local_rank,
                       label, pid, slot, spare.spec.log_dir,
                       "" if spare.running else "; it has exited already")  # fmt: skip
        return spare

    def refill(self, slot: int, spawner: Spawner | None) -> Worker | None:
        """Start a new spare in the (empty) ``slot`` unless the group stops."""
        group = self.group
        if group.stopping or group.stopped or slot in group.spares or slot not in self.slots:
            return None
        return self._start(slot, spawner)


class SpareKeeper:
    """The launcher's spares across attempts: the current attempt's :class:`Spares`.

    Args:
        cmd: the worker command.
    """

    def __init__(self, cmd: list[str]) -> None:
        self._cmd = cmd
        self.current: Spares | None = None

    def start(
        self, group: WorkerGroup, count: int, specs: list[WorkerSpec], spawner: Spawner | None
    ) -> None:
        """A new attempt (``group``, its workers started from ``specs``): start ``count``
        spares (none when 0; the last attempt's were stopped with its workers)."""
        self.current = None
        if count > 0 and specs:
            self.current = Spares(group, count, specs[0].env, self._cmd, specs[0].log_dir.parent)
            self.current.start_all(spawner)

    def tend(self, group: WorkerGroup | None, spawner: Spawner | None) -> None:
        """Replace the spares of ``group`` (the current attempt) that died while waiting."""
        spares = self.current
        if spares is not None and spares.group is group:
            spares.tend(spawner)

    def promote(
        self,
        group: WorkerGroup | None,
        msg: Promote,
        send: Callable[[Started], None],
        spawner: Spawner | None,
    ) -> None:
        """A ``promote``: the spare ``msg.pid`` of ``msg.spare_slot`` was sent the ``go``
        of the dead ``msg.local_rank`` (whose exit the caller reported first): it is that
        local rank from now on (``send`` gets the ``started`` with its pid: no process
        start; the caller reports its exit next when it died meanwhile), and a new spare
        starts in its slot. Ignored (logged) when it does not fit the running attempt (a
        late one: that attempt is being stopped) or names no spare of the slot."""
        spares = self.current
        if (spares is None or group is None or spares.group is not group
                or group.attempt != msg.attempt or group.stopping or group.stopped):  # fmt: skip
            logger.warning("promote of spare slot %d for attempt %d ignored: not running",
                           msg.spare_slot, msg.attempt)  # fmt: skip
            return
        old = group.workers.get(msg.local_rank)
        try:
            spares.promote(msg.spare_slot, msg.local_rank, msg.pid,
                           old.spec.env if old is not None else {})  # fmt: skip
        except ValueError as exc:
            logger.warning("promote of spare slot %d to local_rank %d ignored: %s",
                           msg.spare_slot, msg.local_rank, exc)  # fmt: skip
            return
        send(Started(attempt=group.attempt, pids={msg.local_rank: msg.pid}, warm=1))
        spares.refill(msg.spare_slot, spawner)
