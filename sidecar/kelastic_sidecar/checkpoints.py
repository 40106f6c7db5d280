"""The node's part in agreeing on a checkpoint step (``kelastic.checkpoint``'s slots).

Before it joins a round the sidecar records its node's slots in etcd (:func:`publish`,
:func:`publish_record`): the steps each global rank of the slot folder committed and that
pass every checksum (:func:`kelastic.checkpoint.scan.verified_steps`), at
:meth:`kelastic.contract.Keys.checkpoint`. The workers are stopped then, so the slots
hold still and the record is exact; one write per node and restart, none per step.
A round completes only once every participant has joined, so every participant's record
is written by then; each sidecar reads them (:func:`read_records`) and computes the same
:func:`kelastic.etcd_values.checkpoints.restore_of`, which it gives its workers as
``$KELASTIC_CHECKPOINT_STEP`` (``kelastic.checkpoint.load()`` loads that step).

Why the sidecar and not the worker: the workers get no etcd endpoint nor credentials
(only the sidecar's container does), and the sidecar outlives them: it reads the slots
when no writer is running.

:class:`RoundCheckpoints` is the supervisor's part: both steps, timed, the persistence
of the slots (:mod:`kelastic_sidecar.persister`, with ``spec.checkpoint.persist``), and
what the round restores (:class:`~kelastic.etcd_values.checkpoints.Restore`) in the ``/status``
document (``checkpoint``, which ``kelastic run`` prints) and the metrics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kelastic import contract
from kelastic.checkpoint.commit import finish_staged
from kelastic.checkpoint.discard import discard_newer
from kelastic.checkpoint.persist import persisted_steps
from kelastic.checkpoint.restored import read_restored
from kelastic.checkpoint.scan import verified_steps
from kelastic.etcd_values import CorruptValueError, ForeignValueError
from kelastic.etcd_values.checkpoints import (
    MAX_PERSISTED,
    MAX_UNFETCHABLE,
    CheckpointsDoc,
    Restore,
    RestoreTier,
    decode_checkpoints,
    encode_checkpoints,
    restore_of,
)
from kelastic_etcd import EtcdClient, EtcdError

from .checkpoint_loads import LoadReporter
from .config import SidecarConfig
from .peer_restore import Fetched, ranks_to_fill, restore_from_peers, restore_replicated
from .persister import Persister
from .rendezvous import RendezvousInfo
from .replica import REPLICA_DIR_NAME
from .replication import Replication

__all__ = [
    "RoundCheckpoints",
    "publish",
    "publish_record",
    "read_records",
    "worker_env",
]

log = logging.getLogger(__name__)


def publish(store: EtcdClient, keys: contract.Keys, cfg: SidecarConfig, *, stopped: bool,
            replication: Replication | None = None,
            unfetchable: Sequence[int] = ()) -> CheckpointsDoc | None:  # fmt: skip
    """The supervisor's step before each rendezvous: :func:`publish_record` of the
    node's slot folder (:func:`kelastic.contract.checkpoint_dir`) when its workers are
    ``stopped`` (not carried in process into the next round) and the sidecar sees the
    folder (else the workers load their own newest step, as without a sidecar), with the
    replicas it holds and where it serves them (``replication``) and the steps it could not
    get from any peer (``unfetchable``, newest first). Returns the record, or
    None when none was made. Workers carried on (not ``stopped``) keep saving: the node's
    record no longer says what its slots hold, so it is deleted (a node joining the
    round fresh would otherwise agree on the steps of an earlier round and load one the
    carried ranks left behind: a mixed restore); a failed deletion is logged."""
    directory = contract.checkpoint_dir()
    if not directory.is_dir():
        return None
    if stopped:
        persisted = cfg.persist.directory if cfg.persist is not None else None
        every = cfg.persist.every_steps if cfg.persist is not None else 0
        return publish_record(store, keys, cfg.node, directory, cfg.job_uid, persisted,
                              replication, unfetchable, cfg.failure_domain,
                              persist_every=every)  # fmt: skip
    try:
        store.delete(keys.checkpoint(cfg.node))
    except EtcdError as exc:
        log.error("checkpoint: cannot delete this node's record while its workers run on: %s",
                  exc)  # fmt: skip
    return None


def worker_env(store: EtcdClient, keys: contract.Keys, cfg: SidecarConfig, info: RendezvousInfo,
               nproc: int, carried: bool, replication: Replication | None = None,
               ) -> tuple[dict[str, str], Restore, list[Fetched], bool] | None:  # fmt: skip
    """``$KELASTIC_CHECKPOINT_STEP`` and ``$KELASTIC_CHECKPOINT_TIER`` for the round's
    workers (the round's :func:`~kelastic.etcd_values.checkpoints.restore_of` from
    :func:`read_records`; ``"none"`` when no step is restorable by every rank, from memory,
    a peer or disk), the round's :class:`Restore`, the slots fetched for it and whether
    some rank of the node could get the step from no peer (its load will fail), or None
    (no variable) when the workers are ``carried`` in process (they keep their state: no
    load) or the sidecar does not see the slot folder. The node's slots and replicas of
    steps newer than the agreed one (all, when none) are dropped first
    (:func:`kelastic.checkpoint.discard.discard_newer`: the training goes on from the
    agreed step and saves those step numbers again; kept, they could make a later
    restore mixed). From a peer, the ranks the node does not hold get their slot before
    the workers start (:func:`~kelastic_sidecar.peer_restore.restore_from_peers`; the
    workers load it as their own: tier ``memory`` in their env); with a replicated state
    (``cfg.layout``) each rank without the step gets a copy of any rank's, from the node
    or a peer (:func:`~kelastic_sidecar.peer_restore.restore_replicated`), and the
    workers' env says the layout (a disk load of a grown world reads another rank's).
    ``replication`` follows the round's ring peer. Never raises for the codec or the slots.

    Raises:
        EtcdError: the records cannot be read (:func:`read_records`): the round's workers
            must not start on this node (the supervisor goes back to the rendezvous).
    """
    directory = contract.checkpoint_dir()
    if not directory.is_dir():
        return None
    if carried:  # no load; the replicas follow the round if etcd answers
        if replication is not None:
            try:
                replication.follow(info, read_records(store, keys, info.participants), nproc)
            except EtcdError as exc:
                log.warning("round %d: replicas keep their peer: %s", info.round, exc)
        return None
    records = read_records(store, keys, info.participants)
    if replication is not None:
        replication.follow(info, records, nproc)
    replicated = cfg.layout is contract.StateLayout.REPLICATED
    restore = restore_of(info.round, records, info.participants, nproc, cfg.job_uid,
                         replicated=replicated)  # fmt: skip
    log.info("round %d: checkpoint step to restore: %s", info.round,
             "none" if restore.step is None else f"{restore.step} from {restore.tier}")  # fmt: skip
    for folder in (directory, directory / REPLICA_DIR_NAME):
        try:
            discard_newer(folder, cfg.job_uid, restore.step)
        except OSError as exc:
            log.error("checkpoint: cannot drop the steps newer than %s in %s: %s",
                      restore.step, folder, exc)  # fmt: skip
    if replication is not None:
        replication.rewind(restore.step)
    fetched: list[Fetched] = []
    missing = False
    fill = restore_replicated if replicated else restore_from_peers
    if restore.step is not None and (
        restore.tier is RestoreTier.PEER or (replicated and restore.tier is RestoreTier.MEMORY)
    ):
        try:
            fetched = fill(directory, cfg.node, info, nproc, records, cfg.job_uid, restore.step)
        except OSError as exc:
            log.error("checkpoint: cannot restore from the peers into %s: %s", directory, exc)
        for f in fetched:
            log.info("round %d: rank %d's step %d from %s (%d bytes in %.3f s)", info.round,
                     f.rank, restore.step, f.source, f.bytes, f.seconds)  # fmt: skip
        needed = ranks_to_fill(info, nproc, records.get(cfg.node), restore.step)
        missing = bool(set(needed) - {f.rank for f in fetched})
    value = contract.CHECKPOINT_STEP_NONE if restore.step is None else str(restore.step)
    tier = (contract.CHECKPOINT_TIER_DISK if restore.tier is RestoreTier.DISK
            else contract.CHECKPOINT_TIER_MEMORY)  # fmt: skip
    env = {contract.ENV_CHECKPOINT_STEP: value, contract.ENV_CHECKPOINT_TIER: tier}
    if replicated:  # a rank of a grown world reads another rank's folder from disk
        env[contract.ENV_CHECKPOINT_LAYOUT] = contract.StateLayout.REPLICATED.value
    return env, restore, fetched, missing


def publish_record(store: EtcdClient, keys: contract.Keys, node: str, directory: Path,
                   job: str, persisted: Path | None = None,
                   replication: Replication | None = None,
                   unfetchable: Sequence[int] = (),
                   domain: str = "", persist_every: int = 0) -> CheckpointsDoc:  # fmt: skip
    """Record ``node``'s verified committed steps of ``job`` in ``directory`` at
    ``keys.checkpoint(node)`` (an empty record when it holds none), with the job's steps
    complete in the persistence folder ``persisted`` (the newest
    :data:`~kelastic.etcd_values.checkpoints.MAX_PERSISTED`;
    :func:`kelastic.checkpoint.persist.persisted_steps`) and, with ``replication``, the
    verified steps of the replicas in ``directory/replicas`` and the endpoint and token
    that serve them, and ``unfetchable`` (the steps it could not get from any peer: never
    the peer tier's again) and ``domain`` (the node's zone: the replicas' ring spreads
    over zones). Call it while no worker of the node runs (before joining a round): a
    save a dead worker returned from but did not commit is committed first
    (:func:`kelastic.checkpoint.commit.finish_staged`; marked due for persistence when
    its step is a multiple of ``persist_every``).

    Returns:
        The record written (or that could not be: the failure is logged, and the
        record is deleted if etcd lets it, so that a stale one is never agreed on).

    Never raises for etcd, the slots or the codec (each logged).
    """
    started = time.monotonic()
    try:
        finish_staged(directory, job, persist_every=persist_every)
        ranks = verified_steps(directory, job)
    except OSError as exc:
        log.error("checkpoint: cannot read the slots in %s: %s", directory, exc)
        ranks = {}
    replicas: dict[int, tuple[int, ...]] = {}
    if replication is not None:
        try:
            replicas = verified_steps(directory / REPLICA_DIR_NAME, job)
        except OSError as exc:
            log.error("checkpoint: cannot read the replicas in %s: %s", directory, exc)
    on_disk: list[tuple[int, int]] = []
    if persisted is not None:
        try:
            on_disk = persisted_steps(persisted, job)[:MAX_PERSISTED]
        except OSError as exc:
            log.error("checkpoint: cannot read the persisted steps in %s: %s", persisted, exc)
    served = (replication.endpoint, replication.token) if replication is not None else ("", "")
    failed = tuple(unfetchable)[:MAX_UNFETCHABLE]
    doc = CheckpointsDoc(job, ranks, time.time(), tuple(on_disk), replicas, *served,
                         unfetchable=failed, domain=domain)  # fmt: skip
    key = keys.checkpoint(node)
    try:
        store.put(key, encode_checkpoints(doc))
    except (EtcdError, CorruptValueError) as exc:
        log.error("checkpoint: cannot record the committed steps in etcd: %s", exc)
        try:
            store.delete(key)
        except EtcdError as again:
            log.error("checkpoint: cannot delete the stale record %s: %s", key, again)
        return doc
    if ranks or on_disk or replicas:
        log.info("checkpoint: committed steps %s, replicas %s, persisted steps %s recorded "
                 "(checked in %.3f s)", {r: list(s) for r, s in ranks.items()},
                 {r: list(s) for r, s in replicas.items()}, [s for s, _ in on_disk],
                 time.monotonic() - started)  # fmt: skip
    return doc


def read_records(store: EtcdClient, keys: contract.Keys,
                 participants: tuple[str, ...]) -> dict[str, CheckpointsDoc | None]:  # fmt: skip
    """Each participant's record (None: missing, corrupt or of another version; each
    logged). Never raises for the codec.

    Raises:
        EtcdError: etcd does not answer (after the client's retries). Not read as "no
            records": this node would agree on no step while its peers, which read them,
            load one (a mixed restore); the caller does not start the round's workers.
    """
    found = store.get_prefix(keys.checkpoints_prefix)
    records: dict[str, CheckpointsDoc | None] = {}
    for node in participants:
        key = keys.checkpoint(node)
        got = found.get(key)
        try:
            records[node] = decode_checkpoints(got[0], key) if got else None
        except (CorruptValueError, ForeignValueError) as exc:
            log.error("checkpoint: %s", exc)
            records[node] = None
    return records


class RoundCheckpoints:
    """The supervisor's part for the checkpoint slots: :func:`publish` before each
    rendezvous (timed), :func:`worker_env` at each start of the workers, and the last
    round's :class:`Restore` (:meth:`status`).

    Args:
        store, keys, cfg: the node's etcd client, key layout and configuration.
        on_check: called with the seconds each check of the node's slots took.
        on_restore: called with each :class:`Restore` of a round whose workers start
            anew (none for workers carried in process).
        loads: tells the operator when the workers have loaded the round's step and how
            long it took (:class:`~kelastic_sidecar.checkpoint_loads.LoadReporter`).
    """

    def __init__(self, store: EtcdClient, keys: contract.Keys, cfg: SidecarConfig, *,
                 on_check: Callable[[float], None] = lambda _s: None,
                 on_restore: Callable[[Restore], None] = lambda _r: None,
                 persister: Persister | None = None,
                 replication: Replication | None = None,
                 loads: LoadReporter | None = None) -> None:  # fmt: skip
        self._store, self._keys, self._cfg = store, keys, cfg
        self.loads = loads
        self._on_check, self._on_restore = on_check, on_restore
        self._checked_s: float | None = None
        self.last: Restore | None = None
        self.fetched: list[Fetched] = []
        #: Steps this node could get from no peer, newest first (its record lists them).
        self.unfetchable: list[int] = []
        self.persister = persister
        self.replication = replication

    def start(self) -> None:
        """Start persisting every ``everySteps`` (with ``spec.checkpoint.persist``) and
        serving and sending replicas (with ``spec.checkpoint.replicas``; a port that cannot
        be bound is logged and the node goes on without replicas: the training matters
        more, and its record then names no endpoint)."""
        if self.persister is not None:
            self.persister.start()
        if self.replication is not None:
            try:
                self.replication.start()
            except OSError as exc:
                log.error("checkpoint replicas: cannot serve (%s): this node keeps and sends "
                          "none", exc)  # fmt: skip
                self.replication.close()
                self.replication = None

    def at_stop(self, seconds: float) -> None:
        """The sidecar is stopped and its workers are: persist what the slots hold (see
        :meth:`Persister.at_stop`) for up to ``seconds``."""
        if self.persister is not None:
            started = time.monotonic()
            steps = self.persister.at_stop(started + seconds)
            if steps:
                log.info("checkpoint steps %s persisted at stop in %.3f s", steps,
                         time.monotonic() - started)  # fmt: skip

    def close(self) -> None:
        """Stop the persistence's poll, the replication and the loads' watch."""
        if self.loads is not None:
            self.loads.close()
        if self.persister is not None:
            self.persister.close()
        if self.replication is not None:
            self.replication.close()

    def before_rendezvous(self, *, stopped: bool) -> None:
        """Record the node's verified committed steps (see :func:`publish`)."""
        started = time.monotonic()
        if publish(self._store, self._keys, self._cfg, stopped=stopped,
                   replication=self.replication,
                   unfetchable=self.unfetchable) is not None:  # fmt: skip
            self._checked_s = time.monotonic() - started
            self._on_check(self._checked_s)

    def worker_env(self, info: RendezvousInfo, nproc: int, carried: bool) -> dict[str, str] | None:
        """The workers' variables for ``info``'s round (see :func:`worker_env`).

        Raises:
            EtcdError: the nodes' records cannot be read: do not start the workers.
        """
        got = worker_env(self._store, self._keys, self._cfg, info, nproc, carried,
                         self.replication)  # fmt: skip
        if got is None:
            return None
        env, self.last, self.fetched, missing = got
        step = self.last.step
        # newer steps are a history the job left (saved again under the same numbers)
        kept = [s for s in self.unfetchable if step is not None and s <= step]
        if missing and step is not None:
            log.warning("round %d: step %d could not be got from any peer: no later round "
                        "restores it from a peer (the next takes another step or tier)",
                        info.round, step)  # fmt: skip
            kept = sorted({*kept, step}, reverse=True)
        self.unfetchable = kept[:MAX_UNFETCHABLE]
        self._on_restore(self.last)
        if self.loads is not None and step is not None:  # tell the operator their load time
            self.loads.begin(info.round, step, self.last.tier.value, nproc)
        return env

    def status(self) -> dict[str, Any] | None:
        """The ``/status`` document's ``checkpoint``: the last round's restore (``round``,
        ``step``, ``tier``, ``ranks``, ``held``, ``time``), ``checked_s`` (seconds this
        node's slot check took), ``loaded`` (``{"ranks", "slowest_s"}``: how many of this
        node's workers have loaded that step so far and the longest load in seconds, from
        their records, :mod:`kelastic.checkpoint.restored`; None before the first) and
        ``persisted_step`` (the newest step this node persisted, with
        ``spec.checkpoint.persist``), ``fetched`` (the slots of this node's ranks got from
        a peer for the round: ``{"ranks", "bytes", "seconds"}``, the seconds of the
        slowest; None when none was) and ``replication`` (with ``spec.checkpoint.replicas``:
        :meth:`Replication.status`); None before any restore."""
        last = self.last
        if last is None:
            return None
        persisted = self.persister.last_step if self.persister is not None else None
        loads = [r for r in read_restored(contract.checkpoint_dir(), last.round)
                 if r.step == last.step] if last.step is not None else []  # fmt: skip
        loaded = (
            {"ranks": len(loads), "slowest_s": max(r.seconds for r in loads)} if loads else None
        )
        fetched = self.fetched
        got = ({"ranks": len(fetched), "bytes": sum(f.bytes for f in fetched),
                "seconds": max(f.seconds for f in fetched)} if fetched else None)  # fmt: skip
        replication = self.replication.status() if self.replication is not None else None
        return {**asdict(last), "tier": last.tier.value, "checked_s": self._checked_s,
                "loaded": loaded, "persisted_step": persisted, "fetched": got,
                "replication": replication}  # fmt: skip
