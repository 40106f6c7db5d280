"""The node's part in agreeing on a checkpoint step (``kelastic.checkpoint``'s slots).

Before it joins a round the sidecar records its node's slots in etcd (:func:`publish`,
:func:`publish_record`): the steps each global rank of the slot folder committed and that
pass every checksum (:func:`kelastic.checkpoint.scan.verified_steps`), at
:meth:`kelastic.contract.Keys.checkpoint`. The workers are stopped then, so the slots
hold still and the record is exact; one write per node and restart, none per step.
A round completes only once every participant has joined, so every participant's record
is written by then; each sidecar reads them (:func:`agree`) and computes the same
:func:`kelastic.etcd_values.checkpoints.restorable_step`, which it gives its workers as
``$KELASTIC_CHECKPOINT_STEP`` (``kelastic.checkpoint.load()`` loads that step).

Why the sidecar and not the worker: the workers get no etcd endpoint nor credentials
(only the sidecar's container does), and the sidecar outlives them: it reads the slots
when no writer is running.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path

from kelastic import contract
from kelastic.checkpoint import CheckpointError
from kelastic.checkpoint.scan import verified_steps
from kelastic.checkpoint.volume import touch_volume
from kelastic.etcd_values import CorruptValueError, ForeignValueError
from kelastic.etcd_values.checkpoints import (
    CheckpointsDoc,
    decode_checkpoints,
    encode_checkpoints,
    restorable_step,
)
from kelastic_etcd import EtcdClient, EtcdError

from .config import SidecarConfig
from .rendezvous import RendezvousInfo

__all__ = ["agree", "prepare_volume", "publish", "publish_record", "worker_env"]

log = logging.getLogger(__name__)


def prepare_volume(env: Mapping[str, str]) -> int:
    """Allocate and write the checkpoint volume in full at the sidecar's start when the
    job has one (``$KELASTIC_CHECKPOINT_MEMORY`` bytes in
    :func:`kelastic.contract.checkpoint_dir`; see
    :func:`kelastic.checkpoint.volume.touch_volume`), so a volume too small fails now with
    a clear error instead of SIGBUS in the trainer later. Returns the bytes checked (0:
    no volume).

    Raises:
        ValueError: the variable is not a positive integer, or the volume is missing or
            cannot hold the bytes (the message names the folder, the bytes needed and
            free, and ``spec.checkpoint.memory``).
    """
    raw = env.get(contract.ENV_CHECKPOINT_MEMORY, "")
    if not raw:
        return 0
    if not (raw.isascii() and raw.isdigit() and 0 < len(raw) <= 18 and int(raw) > 0):
        raise ValueError(f"${contract.ENV_CHECKPOINT_MEMORY}={raw!r:.40} is not a size in bytes")
    size = int(raw)
    directory = Path(env.get(contract.ENV_CHECKPOINT_DIR) or contract.DEFAULT_CHECKPOINT_DIR)
    started = time.monotonic()
    try:
        touch_volume(directory, size)
    except (CheckpointError, OSError) as exc:
        raise ValueError(
            f"the checkpoint volume ({size} bytes, spec.checkpoint.memory) is unusable: {exc}"
        ) from exc
    log.info("checkpoint volume %s: %d bytes allocated and written in %.3f s", directory, size,
             time.monotonic() - started)  # fmt: skip
    return size


def publish(store: EtcdClient, keys: contract.Keys, cfg: SidecarConfig, *,
            stopped: bool) -> None:  # fmt: skip
    """The supervisor's step before each rendezvous: :func:`publish_record` of the
    node's slot folder (:func:`kelastic.contract.checkpoint_dir`) when its workers are
    ``stopped`` (not carried in process into the next round) and the sidecar sees the
    folder (else the workers load their own newest step, as without a sidecar)."""
    directory = contract.checkpoint_dir()
    if stopped and directory.is_dir():
        publish_record(store, keys, cfg.node, directory, cfg.job_uid)


def worker_env(store: EtcdClient, keys: contract.Keys, cfg: SidecarConfig, info: RendezvousInfo,
               nproc: int, carried: bool) -> dict[str, str] | None:  # fmt: skip
    """``$KELASTIC_CHECKPOINT_STEP`` for the round's workers (:func:`agree`; ``"none"``
    when no step is restorable by every rank), or None (no variable) when the workers
    are ``carried`` in process (they keep their state: no load) or the sidecar does not
    see the slot folder. Never raises for etcd or the codec."""
    if carried or not contract.checkpoint_dir().is_dir():
        return None
    step = agree(store, keys, info.participants, nproc, cfg.job_uid)
    log.info("round %d: checkpoint step to restore: %s", info.round,
             "none" if step is None else step)  # fmt: skip
    value = contract.CHECKPOINT_STEP_NONE if step is None else str(step)
    return {contract.ENV_CHECKPOINT_STEP: value}


def publish_record(store: EtcdClient, keys: contract.Keys, node: str, directory: Path,
                   job: str) -> CheckpointsDoc:  # fmt: skip
    """Record ``node``'s verified committed steps of ``job`` in ``directory`` at
    ``keys.checkpoint(node)`` (an empty record when it holds none). Call it while no
    worker of the node runs (before joining a round).

    Returns:
        The record written (or that could not be: the failure is logged, and the
        record is deleted if etcd lets it, so that a stale one is never agreed on).

    Never raises for etcd, the slots or the codec (each logged).
    """
    started = time.monotonic()
    try:
        ranks = verified_steps(directory, job)
    except OSError as exc:
        log.error("checkpoint: cannot read the slots in %s: %s", directory, exc)
        ranks = {}
    doc = CheckpointsDoc(job, ranks, time.time())
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
    if ranks:
        log.info("checkpoint: committed steps %s recorded (slots checked in %.3f s)",
                 {r: list(s) for r, s in ranks.items()}, time.monotonic() - started)  # fmt: skip
    return doc


def agree(store: EtcdClient, keys: contract.Keys, participants: tuple[str, ...], nproc: int,
          job: str) -> int | None:  # fmt: skip
    """The round's restorable step from its participants' records (see
    :func:`~kelastic.etcd_values.checkpoints.restorable_step`); None when some rank has
    no step in common, or a record is missing, corrupt or of another version, or etcd
    does not answer (each logged). Never raises for etcd or the codec."""
    try:
        found = store.get_prefix(keys.checkpoints_prefix)
    except EtcdError as exc:
        log.error("checkpoint: cannot read the committed steps: %s", exc)
        return None
    records: dict[str, CheckpointsDoc | None] = {}
    for node in participants:
        key = keys.checkpoint(node)
        got = found.get(key)
        try:
            records[node] = decode_checkpoints(got[0], key) if got else None
        except (CorruptValueError, ForeignValueError) as exc:
            log.error("checkpoint: %s", exc)
            records[node] = None
    return restorable_step(records, participants, nproc, job)
