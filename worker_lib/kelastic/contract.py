"""The pod contract: the one place where the operator, the sidecar and the launcher agree.

Everything that crosses a process or container boundary is named here: the shared
volume's layout, environment variable names (torch's own names for the worker env, so
``torch.distributed.init_process_group("env://")`` and torch's ``@record`` work
unchanged), the etcd key layout, and the control-socket message types.

This module is stdlib only and has no side effects on import. Semantics follow
torch's ``torch.distributed.elastic`` (its ``run``, ``timer`` and ``multiprocessing``
modules) and ``docs/architecture.md``.

Over ~400 lines because it is one cohesive thing: the whole contract between the Pod's
containers, the operator and etcd, in one place to read; split by boundary, a name that
two sides must agree on could be defined twice.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path
from typing import Final

# --------------------------------------------------------------------------- volume

#: Default mount path of the shared ``kelastic-run`` emptyDir in both containers.
DEFAULT_RUN_DIR: Final = "/var/run/kelastic"
#: Name of the shared volume in the Pod.
RUN_VOLUME_NAME: Final = "kelastic-run"
#: Env var overriding the run dir (local mode points it at a temporary directory).
ENV_RUN_DIR: Final = "KELASTIC_RUN_DIR"

TIMER_FIFO_NAME: Final = "timer.fifo"
CONTROL_SOCKET_NAME: Final = "control.sock"
#: In-process restart: wrapped workers <-> the sidecar's coordinator (JSON lines).
INPROCESS_SOCKET_NAME: Final = "inprocess.sock"
#: The sidecar's Unix socket for the trainer's ``preStop`` hook (``kelastic.prestop``).
PRESTOP_SOCKET_NAME: Final = "prestop.sock"
LOGS_DIR_NAME: Final = "logs"
ERROR_FILE_NAME: Final = "error.json"
STDOUT_LOG_NAME: Final = "stdout.log"
STDERR_LOG_NAME: Final = "stderr.log"

#: Kubernetes' default ``terminationMessagePath``; the launcher writes the root cause here.
DEFAULT_TERMINATION_LOG: Final = "/dev/termination-log"
#: Env var overriding the termination-message path (local mode, tests).
ENV_TERMINATION_LOG: Final = "KELASTIC_TERMINATION_LOG"
#: Kubernetes truncates termination messages at 4096 bytes.
TERMINATION_MESSAGE_MAX_BYTES: Final = 4096


#: In-memory checkpoints (``kelastic.checkpoint``): a memory-backed volume of its own
#: (``emptyDir`` with ``medium: Memory`` and a ``sizeLimit``), mounted here in the trainer
#: (and, once it keeps the slots, the sidecar). Not under the run volume: that one is on
#: the node's disk (logs), and a memory volume's pages count against the memory limit
#: of the container that touches them, so it gets its own size. Each rank has two slot
#: files ``rank-<rank>.slot0|1|2`` and a lock file ``rank-<rank>.lock`` in it.
DEFAULT_CHECKPOINT_DIR: Final = "/var/run/kelastic-checkpoints"
#: Name of the checkpoint volume in the Pod.
CHECKPOINT_VOLUME_NAME: Final = "kelastic-checkpoints"
#: Env var overriding the checkpoint folder (local mode, tests, a plain ``/dev/shm``).
ENV_CHECKPOINT_DIR: Final = "KELASTIC_CHECKPOINT_DIR"
#: Set by the sidecar in each worker's env: the step the job agreed to restore (the
#: highest step every rank of the round committed on its own node, checksums verified),
#: or :data:`CHECKPOINT_STEP_NONE`; ``kelastic.checkpoint.load()`` loads that one.
#: Unset (no sidecar): ``load()`` takes the rank's own newest step.
ENV_CHECKPOINT_STEP: Final = "KELASTIC_CHECKPOINT_STEP"
#: :data:`ENV_CHECKPOINT_STEP`'s value when no step is restorable by every rank.
CHECKPOINT_STEP_NONE: Final = "none"
#: Set by the sidecar beside :data:`ENV_CHECKPOINT_STEP`: where every rank loads that step
#: from, :data:`CHECKPOINT_TIER_MEMORY` (its node's slots) or :data:`CHECKPOINT_TIER_DISK`
#: (the job's persistence folder, :data:`ENV_CHECKPOINT_PERSIST_DIR` in the trainer's env
#: too); unset: memory.
ENV_CHECKPOINT_TIER: Final = "KELASTIC_CHECKPOINT_TIER"
CHECKPOINT_TIER_MEMORY: Final = "memory"
CHECKPOINT_TIER_DISK: Final = "disk"
#: Set on the sidecar when the job has a checkpoint volume (``spec.checkpoint.memory``):
#: its size in bytes, allocated and written in full at the sidecar's start
#: (``kelastic.checkpoint.volume.touch_volume``), so a volume too small fails then.
ENV_CHECKPOINT_MEMORY: Final = "KELASTIC_CHECKPOINT_MEMORY"
#: Set on the sidecar when the job persists its checkpoints (``spec.checkpoint.persist``):
#: the folder (on a volume every Pod shares) it writes committed steps to in torch DCP's
#: format (``kelastic.checkpoint.persist``); on the trainer too (the volume mounted read
#: only at the same path), where ``kelastic.checkpoint.load()`` reads a step restored
#: from disk.
ENV_CHECKPOINT_PERSIST_DIR: Final = "KELASTIC_CHECKPOINT_PERSIST_DIR"
#: Persist every step that is a multiple of this (0: only when the Pod stops).
ENV_CHECKPOINT_PERSIST_EVERY: Final = "KELASTIC_CHECKPOINT_PERSIST_EVERY"
#: ``1``: persist what the slots hold when the sidecar is stopped (SIGTERM); ``0``: not.
ENV_CHECKPOINT_PERSIST_ON_STOP: Final = "KELASTIC_CHECKPOINT_PERSIST_ON_STOP"
#: How many complete persisted steps are kept (older ones are removed).
ENV_CHECKPOINT_PERSIST_KEEP: Final = "KELASTIC_CHECKPOINT_PERSIST_KEEP"
#: Set on the sidecar with ``spec.checkpoint.replicas``: how many peer nodes hold a replica
#: of each of its ranks' due steps (:data:`ENV_CHECKPOINT_REPLICATE_EVERY`) (0: none; at most
#: :data:`MAX_CHECKPOINT_REPLICAS`). Its sidecar serves its slots and replicas on
#: :data:`ENV_REPLICA_PORT` then (``kelastic_sidecar.replica``).
ENV_CHECKPOINT_REPLICAS: Final = "KELASTIC_CHECKPOINT_REPLICAS"
MAX_CHECKPOINT_REPLICAS: Final = 1
#: Replicate the steps that are multiples of this (every node the same step numbers).
ENV_CHECKPOINT_REPLICATE_EVERY: Final = "KELASTIC_CHECKPOINT_REPLICATE_EVERY"
DEFAULT_REPLICATE_EVERY: Final = 10
#: Bytes per second the sidecar sends replicas at, at most (0: no limit): the training's
#: own traffic keeps priority on the Pod network.
ENV_CHECKPOINT_REPLICATION_RATE: Final = "KELASTIC_CHECKPOINT_REPLICATION_RATE"
DEFAULT_REPLICATION_RATE: Final = 512 * 1024 * 1024
#: The sidecar's TCP port for replicas and peer restores (0: any free port, as ``kelastic
#: run``'s Pods share one host), and the Pod's port of that name.
ENV_REPLICA_PORT: Final = "KELASTIC_REPLICA_PORT"
DEFAULT_REPLICA_PORT: Final = 29610
REPLICA_PORT_NAME: Final = "ckpt-replica"
#: Set on the sidecar and in each worker's env with ``spec.checkpoint.stateLayout:
#: Replicated`` (unset: sharded): every rank saves the same state (DDP), so a rank of a
#: grown or renumbered world may restore any rank's copy of the agreed step
#: (``kelastic.etcd_values.checkpoints.restore_of``). The sidecar serves its slots on
#: :data:`ENV_REPLICA_PORT` then, replicas or not: a node that joins gets the step there.
ENV_CHECKPOINT_LAYOUT: Final = "KELASTIC_CHECKPOINT_LAYOUT"


class StateLayout(enum.StrEnum):
    """:data:`ENV_CHECKPOINT_LAYOUT`'s values (``spec.checkpoint.stateLayout``'s
    ``Sharded`` and ``Replicated``)."""

    #: Each rank saves its own part (any parallelism): rank ``r`` restores rank ``r``'s.
    SHARDED = "sharded"
    #: Every rank saves the same state (DDP): any rank's copy restores any rank.
    REPLICATED = "replicated"


#: Where the sidecar (read-write) and the trainer (read only) mount the persistence volume.
PERSIST_MOUNT: Final = "/var/run/kelastic-persist"
#: Complete persisted steps kept by default, and the bounds of the settings.
DEFAULT_PERSIST_KEEP: Final = 3
MAX_PERSIST_KEEP: Final = 1000
MAX_PERSIST_EVERY: Final = 10**9
#: Seconds a stopped sidecar spends persisting what its slots hold (a step not finished
#: by then is left as a temporary folder, never as a step): within Kubernetes' default
#: 30 s grace after SIGTERM, the workers' stop included.
PERSIST_STOP_SECONDS: Final = 20.0


def checkpoint_dir() -> Path:
    """The checkpoint folder: ``$KELASTIC_CHECKPOINT_DIR`` or :data:`DEFAULT_CHECKPOINT_DIR`."""
    return Path(os.environ.get(ENV_CHECKPOINT_DIR, DEFAULT_CHECKPOINT_DIR))


def without_restore(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a worker that loads no agreed checkpoint step, in place and returned:
    :data:`ENV_CHECKPOINT_STEP` :data:`CHECKPOINT_STEP_NONE` when it is set, no tier. A
    spare (no rank's state is its own) and a rank started again mid-round (the hybrid
    rung; its node's slots may have moved past the step agreed at the round's start) join
    peers that hold the state in process."""
    if ENV_CHECKPOINT_STEP in env:
        env[ENV_CHECKPOINT_STEP] = CHECKPOINT_STEP_NONE
        env.pop(ENV_CHECKPOINT_TIER, None)
    return env


def run_dir() -> Path:
    """Return the shared run directory: ``$KELASTIC_RUN_DIR`` or :data:`DEFAULT_RUN_DIR`."""
    return Path(os.environ.get(ENV_RUN_DIR, DEFAULT_RUN_DIR))


def timer_fifo_path(base: Path | None = None) -> Path:
    """Path of the expiration-timer FIFO under ``base`` (default :func:`run_dir`)."""
    return (base or run_dir()) / TIMER_FIFO_NAME


def control_socket_path(base: Path | None = None) -> Path:
    """Path of the launcher <-> supervisor Unix socket under ``base``."""
    return (base or run_dir()) / CONTROL_SOCKET_NAME


#: torch's flight recorder's ring size (entries); set in the trainer's env, > 0, it
#: enables the recorder and kelastic's dump of it on a hang (:mod:`kelastic.flight_recorder`).
ENV_FLIGHT_RECORDER_BUFFER: Final = "TORCH_FR_BUFFER_SIZE"
#: Where the workers' flight records and the FIFOs they are asked on are, under the run dir.
FLIGHT_RECORDS_DIR_NAME: Final = "flight-records"


def flight_records_dir(base: Path | None = None) -> Path:
    """Where an armed worker writes its flight record when asked (the sidecar reads it),
    under ``base`` (default :func:`run_dir`)."""
    return (base or run_dir()) / FLIGHT_RECORDS_DIR_NAME


def prestop_socket_path(base: Path | None = None) -> Path:
    """Unix socket where the sidecar hears that its Pod is terminating (``kelastic.prestop``)."""
    return (base or run_dir()) / PRESTOP_SOCKET_NAME


def inprocess_socket_path(base: Path | None = None) -> Path:
    """Unix socket of the sidecar's in-process restart coordinator (``kelastic.inprocess``)."""
    return (base or run_dir()) / INPROCESS_SOCKET_NAME


def worker_log_dir(attempt: int, local_rank: int, base: Path | None = None) -> Path:
    """``logs/attempt_<attempt>/<local_rank>/``: holds stdout.log, stderr.log, error.json."""
    return (base or run_dir()) / LOGS_DIR_NAME / f"attempt_{attempt}" / str(local_rank)


def termination_log_path() -> Path:
    """Where the launcher writes the root-cause summary (the container's termination log)."""
    return Path(os.environ.get(ENV_TERMINATION_LOG, DEFAULT_TERMINATION_LOG))


# ----------------------------------------------------------------------- worker env
# torch.distributed.elastic's names, set by the launcher for each worker process.
RANK: Final = "RANK"
LOCAL_RANK: Final = "LOCAL_RANK"
WORLD_SIZE: Final = "WORLD_SIZE"
LOCAL_WORLD_SIZE: Final = "LOCAL_WORLD_SIZE"
GROUP_RANK: Final = "GROUP_RANK"
GROUP_WORLD_SIZE: Final = "GROUP_WORLD_SIZE"
ROLE_RANK: Final = "ROLE_RANK"
ROLE_WORLD_SIZE: Final = "ROLE_WORLD_SIZE"
ROLE_NAME: Final = "ROLE_NAME"
MASTER_ADDR: Final = "MASTER_ADDR"
MASTER_PORT: Final = "MASTER_PORT"
TORCHELASTIC_RUN_ID: Final = "TORCHELASTIC_RUN_ID"
TORCHELASTIC_RESTART_COUNT: Final = "TORCHELASTIC_RESTART_COUNT"
TORCHELASTIC_MAX_RESTARTS: Final = "TORCHELASTIC_MAX_RESTARTS"
TORCHELASTIC_ERROR_FILE: Final = "TORCHELASTIC_ERROR_FILE"
TORCHELASTIC_TIMER_FILE: Final = "TORCHELASTIC_TIMER_FILE"
#: The supervisor's round number, for logs and checkpoints (not a torch name).
KELASTIC_ROUND: Final = "KELASTIC_ROUND"
#: A secret per worker and attempt, set by the supervisor: kelastic's timer client sends it
#: as the ``token`` field of each FIFO request, so the timer server can refuse requests
#: that name the worker's pid without it (see ``kelastic_sidecar.timer``).
KELASTIC_TIMER_TOKEN: Final = "KELASTIC_TIMER_TOKEN"

WORKER_ENV_NAMES: Final = (
    RANK,
    LOCAL_RANK,
    WORLD_SIZE,
    LOCAL_WORLD_SIZE,
    GROUP_RANK,
    GROUP_WORLD_SIZE,
    ROLE_RANK,
    ROLE_WORLD_SIZE,
    ROLE_NAME,
    MASTER_ADDR,
    MASTER_PORT,
    TORCHELASTIC_RUN_ID,
    TORCHELASTIC_RESTART_COUNT,
    TORCHELASTIC_MAX_RESTARTS,
    TORCHELASTIC_ERROR_FILE,
    TORCHELASTIC_TIMER_FILE,
)

DEFAULT_ROLE: Final = "default"

# ------------------------------------------------------------ in-process restart env
# Set on the trainer container (so the launcher's workers inherit them) and on the sidecar
# when ``spec.inProcess.enabled``; ``kelastic.inprocess.Wrapper`` reads them.
#: "1": the sidecar coordinates in-process restarts; a Wrapper without it calls once.
ENV_INPROCESS: Final = "KELASTIC_INPROCESS"
#: In-process restarts the job may spend before a fault restarts the worker processes.
ENV_INPROCESS_MAX_RESTARTS: Final = "KELASTIC_INPROCESS_MAX_RESTARTS"
#: Seconds without progress (``ping``, or an ``expires()`` acquire) before a rank is aborted.
ENV_INPROCESS_SOFT_TIMEOUT: Final = "KELASTIC_INPROCESS_SOFT_TIMEOUT"
#: Seconds after an abort was asked before a rank that has not unwound is killed.
ENV_INPROCESS_HARD_TIMEOUT: Final = "KELASTIC_INPROCESS_HARD_TIMEOUT"
#: The iteration a worker enters (set in each ``go``; 0 for the first call).
ENV_INPROCESS_ITERATION: Final = "KELASTIC_INPROCESS_ITERATION"
#: "1": the Wrapper turns SIGUSR1 into an exception raised in the wrapped function
#: (``kelastic run --fault raise:rank=R,after=S``; fault injection only).
ENV_INJECT_RAISE: Final = "KELASTIC_INJECT_RAISE"
#: Spare worker processes per node (``spec.inProcess.spareRanks``): they run the script
#: up to the Wrapper and wait there, warm, to take a dead local rank's place.
ENV_INPROCESS_SPARES: Final = "KELASTIC_INPROCESS_SPARES"
#: "1" in a spare worker's env (the launcher sets it): its Wrapper says hello as a spare
#: and waits for a ``go`` naming the rank it replaces; its ``LOCAL_RANK`` is its spare
#: slot (nproc..nproc+spares-1) and its ``RANK`` is at or above ``WORLD_SIZE`` until then.
ENV_INPROCESS_SPARE: Final = "KELASTIC_INPROCESS_SPARE"
#: "1" in the env of a dead rank's process started again at its death (the hybrid rung's
#: early respawn): its Wrapper says hello in the iteration being restarted into and waits
#: for that iteration's ``go`` (which brings ``MASTER_ADDR``/``PORT``) before its first
#: call, so that its start overlaps its peers' abort and termination barrier.
ENV_INPROCESS_AWAIT_GO: Final = "KELASTIC_INPROCESS_AWAIT_GO"
#: Most spare ranks per node.
MAX_INPROCESS_SPARES: Final = 64
DEFAULT_INPROCESS_MAX_RESTARTS: Final = 10
DEFAULT_INPROCESS_SOFT_TIMEOUT: Final = 60.0
DEFAULT_INPROCESS_HARD_TIMEOUT: Final = 90.0
#: The in-process iteration record's ``cause`` for a round change carried in process that
#: is no fault (nodes joining, a planned departure, a peer's restart): no restart spent.
INPROCESS_CAUSE_MEMBERSHIP: Final = "membership"

# --------------------------------------------------------------------- launcher env
# Defaults of ``python -m kelastic.launch`` options (the flags win).
ENV_WARM_START: Final = "KELASTIC_WARM_START"  # "1"/"true": fork workers from a zygote
ENV_PRELOAD: Final = "KELASTIC_PRELOAD"  # comma-separated modules the zygote imports
#: Modules the warm-start zygote imports by default: torch, and what the first
#: ``DistributedDataParallel(...)`` imports lazily (``torch._dynamo`` pulls in sympy and
#: inductor: about as long as ``import torch`` itself).
DEFAULT_PRELOAD: Final = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo")
#: A Python module name (what ``--preload`` and ``spec.warmStart.preload`` accept).
MODULE_NAME_PATTERN: Final = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"

# ---------------------------------------------------------------------- sidecar env
# Set by the operator on the sidecar container (downward API where possible), and by
# local mode on the sidecar process.
ENV_JOB_NAME: Final = "KELASTIC_JOB_NAME"
ENV_NAMESPACE: Final = "KELASTIC_NAMESPACE"
ENV_JOB_UID: Final = "KELASTIC_JOB_UID"  # the run id
ENV_POD_NAME: Final = "KELASTIC_POD_NAME"  # the rendezvous node name
ENV_POD_IP: Final = "KELASTIC_POD_IP"
#: The Pod's uid (downward API): what a sidecar reports about its Pod names this
#: incarnation, not an earlier Pod of the same name. Empty outside Kubernetes.
ENV_POD_UID: Final = "KELASTIC_POD_UID"
#: The Kubernetes Node the Pod runs on (downward API ``spec.nodeName``): the restart
#: record's charges name it, so that the operator can tell a Node that keeps failing.
#: Empty outside Kubernetes.
ENV_HOST_NODE: Final = "KELASTIC_HOST_NODE"
#: The failure domain of the Node the Pod runs on: its ``topology.kubernetes.io/zone``,
#: which the API server copies onto the Pod's labels when it binds it (Kubernetes 1.35+,
#: ``PodTopologyLabelsAdmission``; the downward API reads it from there). With checkpoint
#: replicas, a node's replicas go to a peer in another zone where the round allows.
#: Empty when unknown (an older cluster, a Node without the label, outside Kubernetes).
ENV_FAILURE_DOMAIN: Final = "KELASTIC_FAILURE_DOMAIN"
#: The Node (and Pod) label :data:`ENV_FAILURE_DOMAIN` comes from.
ZONE_LABEL: Final = "topology.kubernetes.io/zone"
ENV_ETCD_ENDPOINTS: Final = "KELASTIC_ETCD_ENDPOINTS"  # comma separated host:port
ENV_ETCD_TLS_DIR: Final = "KELASTIC_ETCD_TLS_DIR"  # holds ca.crt, tls.crt, tls.key
ENV_ETCD_USER: Final = "KELASTIC_ETCD_USER"  # etcd auth (user/password), beside or without TLS
ENV_ETCD_PASSWORD: Final = "KELASTIC_ETCD_PASSWORD"
ENV_MIN_NODES: Final = "KELASTIC_MIN_NODES"
ENV_MAX_NODES: Final = "KELASTIC_MAX_NODES"
ENV_NPROC_PER_NODE: Final = "KELASTIC_NPROC_PER_NODE"
ENV_MAX_RESTARTS: Final = "KELASTIC_MAX_RESTARTS"
ENV_JOIN_TIMEOUT: Final = "KELASTIC_JOIN_TIMEOUT"  # seconds
ENV_LAST_CALL_TIMEOUT: Final = "KELASTIC_LAST_CALL_TIMEOUT"  # seconds
ENV_CLOSE_TIMEOUT: Final = "KELASTIC_CLOSE_TIMEOUT"  # seconds
ENV_LEASE_TTL: Final = "KELASTIC_LEASE_TTL"  # seconds, integer
ENV_STOP_GRACE: Final = "KELASTIC_STOP_GRACE"  # seconds between SIGTERM and SIGKILL
ENV_HTTP_PORT: Final = "KELASTIC_HTTP_PORT"
ENV_HTTP_HOST: Final = "KELASTIC_HTTP_HOST"
#: Who may write the timer FIFO and connect to the control socket: "owner" (the
#: sidecar's user), "group" (and its group), "pod" (any user that sees the run volume,
#: which only the Pod's containers mount). Default: "pod" on Kubernetes (the trainer's
#: user may be unknown to the operator), "owner" elsewhere (local mode).
ENV_IPC_ACCESS: Final = "KELASTIC_IPC_ACCESS"
#: A rank is a straggler when its median step exceeds the other ranks' by this factor.
ENV_STRAGGLER_FACTOR: Final = "KELASTIC_STRAGGLER_FACTOR"
#: Steps a rank needs in its window before it is judged (or judged against).
ENV_STRAGGLER_MIN_STEPS: Final = "KELASTIC_STRAGGLER_MIN_STEPS"
#: The node's preflight check, run by the launcher before its ``hello``: ``{"command":
#: [...], "timeoutSeconds": N}`` (:mod:`kelastic.preflight`), set by the operator from
#: ``spec.preflight`` in the trainer container.
ENV_PREFLIGHT: Final = "KELASTIC_PREFLIGHT"
#: The job's network preflight check (``spec.preflight.network``), in the trainer and the
#: sidecar container: ``{"floors": {...}, "timeoutSeconds": N}``
#: (:func:`kelastic.netcheck.decode_setting`). The sidecar runs it before each round's
#: workers start; the launcher starts its checker ahead when it is set.
ENV_NETCHECK: Final = "KELASTIC_NETCHECK"
#: How the sidecar of a node whose preflight check failed begins its report and the
#: trainer's termination message (``preflight failed on <node>: <why>``); the operator
#: keeps new Pods off that Pod's Node (``status.quarantinedNodes``).
PREFLIGHT_FAILED_PREFIX: Final = "preflight failed on "
#: Seconds a worker may stay stopped (process state ``T``) before its sidecar kills it as
#: hung (the process path; 0: never); see ``kelastic_sidecar.stopped_watch``.
ENV_STOPPED_TIMEOUT: Final = "KELASTIC_STOPPED_TIMEOUT"

#: The sidecar's exit code for a configuration it cannot run with (its env, or a
#: checkpoint volume too small): starting it again cannot help.
SIDECAR_EXIT_CONFIG: Final = 2

DEFAULT_HTTP_PORT: Final = 9400
DEFAULT_STOPPED_TIMEOUT: Final = 60.0
DEFAULT_JOIN_TIMEOUT: Final = 600.0
DEFAULT_LAST_CALL_TIMEOUT: Final = 30.0
DEFAULT_CLOSE_TIMEOUT: Final = 30.0
DEFAULT_LEASE_TTL: Final = 10
DEFAULT_STOP_GRACE: Final = 10.0
DEFAULT_MAX_RESTARTS: Final = 3

# ------------------------------------------------------------------------ etcd keys
ETCD_ROOT: Final = "/kelastic"


def job_prefix(namespace: str, job: str, uid: str) -> str:
    """``/kelastic/<namespace>/<job>/<uid>/``: everything a job stores lives under it.

    The operator deletes this prefix when the job is deleted.
    """
    for part, label in ((namespace, "namespace"), (job, "job"), (uid, "uid")):
        if not part or "/" in part:
            raise ValueError(f"{label} must be non-empty and contain no '/': {part!r}")
    return f"{ETCD_ROOT}/{namespace}/{job}/{uid}/"


class Keys:
    """The etcd key layout of one job (``docs/architecture.md``, "The pod contract").

    Args:
        prefix: the job prefix from :func:`job_prefix` (ends with ``/``).
    """

    def __init__(self, prefix: str) -> None:
        if not prefix.endswith("/"):
            raise ValueError(f"prefix must end with '/': {prefix!r}")
        self.prefix = prefix

    @property
    def rdzv_state(self) -> str:
        """The rendezvous state (JSON, compare-and-set on its mod_revision; codec:
        :mod:`kelastic.etcd_values.rendezvous`)."""
        return self.prefix + "rdzv/state"

    @property
    def alive_prefix(self) -> str:
        """Prefix of the per-node liveness keys, each bound to that node's lease."""
        return self.prefix + "rdzv/alive/"

    def alive(self, node: str) -> str:
        """Liveness key of ``node``: exists while the node's lease lives."""
        return self.alive_prefix + node

    @property
    def departing_prefix(self) -> str:
        """Prefix of departure notices, one per node the operator is removing on purpose."""
        return self.prefix + "rdzv/departing/"

    def departing(self, node: str) -> str:
        """Departure notice of ``node`` (value: the reason, e.g. ``scale_down``), written by
        the operator before it deletes the node's Pod: when the node goes, its peers
        re-rendezvous without spending the restart budget (codec:
        :func:`kelastic.etcd_values.encode_departure`)."""
        return self.departing_prefix + node

    @property
    def joining_prefix(self) -> str:
        """Prefix of join requests, one per node waiting to join the current round."""
        return self.prefix + "rdzv/joining/"

    def joining(self, node: str) -> str:
        """Join request of ``node`` (bound to its lease): whoever writes the rendezvous
        state next admits it in the same transaction, which deletes the request."""
        return self.joining_prefix + node

    def master(self, round_: int) -> str:
        """``{"addr", "port"}`` of the round's c10d store, written by group rank 0 (codec:
        :mod:`kelastic.etcd_values.rounds`)."""
        return f"{self.prefix}rounds/{round_}/master"

    @property
    def checkpoints_prefix(self) -> str:
        """Prefix of the per-node checkpoint records."""
        return self.prefix + "checkpoints/"

    def checkpoint(self, node: str) -> str:
        """``node``'s committed checkpoint steps per global rank, written by its sidecar
        before it joins a round (codec: :mod:`kelastic.etcd_values.checkpoints`)."""
        return self.checkpoints_prefix + node

    @property
    def checkpoint_loads_prefix(self) -> str:
        """Prefix of the per-node records of what the workers loaded."""
        return self.prefix + "checkpoint-loads/"

    def checkpoint_load(self, node: str) -> str:
        """What ``node``'s workers loaded as the current round began and how long it took,
        written by its sidecar once all of them have (codec:
        :mod:`kelastic.etcd_values.loads`)."""
        return self.checkpoint_loads_prefix + node

    @property
    def restarts(self) -> str:
        """The job's global restart budget record (JSON; codec:
        :mod:`kelastic.etcd_values.restarts`)."""
        return self.prefix + "restarts"

    @property
    def reports_prefix(self) -> str:
        """Prefix of per-node final reports."""
        return self.prefix + "reports/"

    def report(self, node: str) -> str:
        """Final report of ``node`` (JSON: outcome, root cause; codec:
        :mod:`kelastic.etcd_values.reports`)."""
        return self.reports_prefix + node

    @property
    def hangs_prefix(self) -> str:
        """Prefix of the nodes' hang evidence."""
        return self.prefix + "hangs/"

    def hang(self, node: str) -> str:
        """Where each worker of ``node`` was as the latest hung round ended (JSON; codec:
        :mod:`kelastic.etcd_values.hangs`), overwritten at each hang; read by the operator,
        which summarises every node's for the job's status."""
        return self.hangs_prefix + node

    def fenced(self, pod_uid: str) -> str:
        """A Pod incarnation the operator declared lost (its Node not Ready past the job's
        ``nodeLostSeconds``; value: the reason, the departure codec's), written before it
        force-deletes the Pod and creates another of the same name. The lost Pod's
        sidecar, should its Node come back, reads it before it joins a round and stops
        instead (:mod:`kelastic_sidecar.rendezvous`): two sidecars of one name never both
        join. Kept until the job's keys go."""
        return f"{self.prefix}fenced/{pod_uid}"

    @property
    def stragglers_prefix(self) -> str:
        """Prefix of the nodes' straggler verdicts."""
        return self.prefix + "stragglers/"

    def straggler(self, node: str) -> str:
        """``node``'s stragglers now (JSON; codec: :mod:`kelastic.etcd_values.stragglers`),
        written by its sidecar when an episode begins or ends; read by the operator
        (``status.stragglers``, ``spec.stragglers.action``)."""
        return self.stragglers_prefix + node

    @property
    def inprocess_iteration(self) -> str:
        """The in-process restart record (JSON: iteration, round, restarts, cause, node,
        rank), compare-and-set on its mod_revision: the iteration number is the fencing
        token of every in-process restart of the job."""
        return self.prefix + "inprocess/iteration"

    def inprocess_ready_prefix(self, iteration: int) -> str:
        """Prefix of the termination-barrier keys of ``iteration``."""
        return f"{self.prefix}inprocess/ready/{iteration}/"

    def inprocess_ready(self, iteration: int, node: str) -> str:
        """``node`` passed the termination barrier of ``iteration`` (all its local ranks
        aborted and healthy; JSON with the port its group rank 0 would serve the store
        on). Bound to the node's lease."""
        return self.inprocess_ready_prefix(iteration) + node

    @property
    def inprocess_go_prefix(self) -> str:
        """Prefix of the termination barrier's ``go`` keys (one per iteration)."""
        return f"{self.prefix}inprocess/go/"

    def inprocess_go(self, iteration: int) -> str:
        """Every node of the round passed the termination barrier of ``iteration``:
        written once by the round's group rank 0 when it has seen every ready key (the
        value is its own ready key's: the iteration's ``MASTER_ADDR``/``PORT``); the
        other nodes watch this key, not each other's ready keys. Bound to that node's
        lease."""
        return f"{self.inprocess_go_prefix}{iteration}"


# ------------------------------------------------------------- control socket (JSON lines)
# launcher -> supervisor
MSG_HELLO: Final = "hello"  # {"type", "pid", "nproc"}
MSG_STARTED: Final = "started"  # {"type", "attempt", "pids": {local_rank: pid}, "warm": n}
#                                  warm: how many of them a warm-start zygote forked
MSG_EXITED: Final = "exited"  # {"type", "attempt", "local_rank", "pid", "exitcode",
#                                  "signal", "error", "tail"}
MSG_STOPPED: Final = "stopped"  # {"type", "attempt"}: all workers of attempt are gone
#: {"type", "round", "verdict" | "error"}: the network check of ``round`` ended (the
#: checker's verdict line, :mod:`kelastic.netcheck`), or why it gave none
MSG_CHECKED: Final = "checked"
# supervisor -> launcher
MSG_ASSIGN: Final = "assign"  # {"type", "attempt", "round", "workers": [{"local_rank", "env"}]}
MSG_STOP: Final = "stop"  # {"type", "attempt", "reason"}
MSG_SHUTDOWN: Final = "shutdown"  # {"type", "exitcode", "summary"}
MSG_RESPAWN: Final = "respawn"  # {"type", "attempt", "local_rank", "env"}: start it again
#: {"type", "attempt", "spare_slot", "local_rank", "pid"}: the waiting spare (pid) in that
#: slot is now the (dead) worker of local_rank; start a new spare in the slot
MSG_PROMOTE: Final = "promote"
#: {"type", "round", "params", "timeout"}: run the network check of ``round`` (``params``:
#: the checker's params line, :mod:`kelastic.netcheck`), killed past ``timeout`` seconds
MSG_CHECK: Final = "check"

# ------------------------------------------------- in-process socket (JSON lines)
# Typed in kelastic.inprocess_messages. wrapped worker -> sidecar coordinator:
IP_HELLO: Final = "hello"  # {"type", "pid", "local_rank", "rank", "iteration", "spare"}
IP_FAULT: Final = "fault"  # {"type", "iteration", "local_rank", "cause", "message"}
IP_READY: Final = "ready"  # {"type", "iteration", "local_rank"}: aborted, healthy
IP_PROGRESS: Final = "progress"  # {"type", "iteration", "local_rank"}: stepping (first ping)
IP_DONE: Final = "done"  # {"type", "iteration", "local_rank"}: the function returned
IP_BEAT: Final = "beat"  # {"type", "local_rank"}: the worker's monitor thread runs
# sidecar coordinator -> wrapped worker:
IP_ABORT: Final = "abort"  # {"type", "iteration", "reason"}: leave, next is iteration
IP_GO: Final = "go"  # {"type", "iteration", "env"}: enter iteration with this env
IP_GIVE_UP: Final = "give_up"  # {"type", "reason"}: no in-process restart; exit

#: A termination message or node report that starts with this says the whole job failed
#: (restart budget spent or rendezvous closed); the operator marks the job Failed on it.
JOB_FAILED_PREFIX: Final = "job failed"
#: Departure reason of a node removed by a scale-down (see :meth:`Keys.departing`).
DEPARTURE_SCALE_DOWN: Final = "scale_down"
#: Departure reason of a node whose Pod a disruption takes (its ``DisruptionTarget``
#: condition: the eviction API, as ``kubectl drain`` uses it, a preemption, the taint
#: manager, the kubelet's node-pressure eviction): a maintenance, not a fault of the job,
#: so no restart is charged, as a Kubernetes Job's ``podFailurePolicy`` ignores them.
DEPARTURE_DISRUPTION: Final = "disruption"
#: Departures the operator posts that end a round without a charge.
OPERATOR_DEPARTURES: Final = frozenset({DEPARTURE_SCALE_DOWN, DEPARTURE_DISRUPTION})
#: Seconds a sidecar whose Pod is terminating (its trainer's ``preStop`` hook) waits for
#: the operator's departure notice before it leaves the rendezvous without one.
PRESTOP_NOTICE_SECONDS: Final = 5.0
#: Seconds the ``preStop`` hook waits for the sidecar to have left the rendezvous: the
#: notice's wait and a leave riding out a short etcd outage, within the 30 s grace.
PRESTOP_TIMEOUT_SECONDS: Final = 15.0

#: Largest control message accepted, bytes (a line longer than this is a protocol error).
CONTROL_MAX_LINE: Final = 1 << 20
