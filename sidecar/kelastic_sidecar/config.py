"""Sidecar configuration from the environment the operator (or local mode) sets.

The names are :mod:`kelastic.contract`'s; every problem is reported at once, naming the
variable, so a misconfigured Pod fails fast with a readable message.

Over ~400 lines because it is the one reader of every variable the sidecar takes (each
part's settings beside the others, all checked in one pass so that every problem is told
at once); each part's settings are a small frozen dataclass of their own.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from kelastic import contract, failure_policy
from kelastic.etcd_values.checkpoints import is_domain
from kelastic.netcheck import NetcheckError, Setting, decode_setting

from .hang_evidence import DEFAULT_BUDGET, ENV_BUDGET
from .steptime import (
    DEFAULT_FACTOR,
    DEFAULT_MIN_STEPS,
    ENV_STRAGGLER_FACTOR,
    ENV_STRAGGLER_MIN_STEPS,
    StragglerSettings,
)

if TYPE_CHECKING:
    from kelastic_etcd import EtcdClient

    from .rendezvous import RendezvousSettings

T = TypeVar("T")


class ConfigError(ValueError):
    """The sidecar's environment is incomplete or invalid; the message lists each problem."""


_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class InProcessSettings:
    """In-process restarts (``spec.inProcess``; coordinated by
    :mod:`~kelastic_sidecar.inprocess.coordinator`; the knobs of NVIDIA's in-process
    restart wrapper, ``nvidia_resiliency_ext.inprocess.Wrapper``).

    Attributes:
        enabled: ``$KELASTIC_INPROCESS`` is ``1`` (or ``true``/``yes``/``on``).
        max_restarts: in-process restarts the whole job may spend (>= 0), counted in the
            etcd iteration record; a fault beyond it restarts the worker processes.
        soft_timeout: seconds without progress before a rank is aborted (the worker's
            Wrapper enforces it; here for validation and ``/status``).
        hard_timeout: seconds after an abort before a rank that has not passed the
            termination barrier is killed (SIGKILL by the sidecar); > ``soft_timeout``.
        spare_ranks: spare worker processes per node (``$KELASTIC_INPROCESS_SPARES``,
            0..64): they wait warm in the Wrapper and replace a dead local rank without a
            process start (:mod:`~kelastic_sidecar.inprocess.spares`).
    """

    enabled: bool = False
    max_restarts: int = contract.DEFAULT_INPROCESS_MAX_RESTARTS
    soft_timeout: float = contract.DEFAULT_INPROCESS_SOFT_TIMEOUT
    hard_timeout: float = contract.DEFAULT_INPROCESS_HARD_TIMEOUT
    spare_ranks: int = 0

    @property
    def barrier_timeout(self) -> float:
        """Seconds after the first abort of a restart before a node whose termination
        barrier is not complete gives up (its ranks fall back to the process restart):
        ``soft_timeout + hard_timeout``, above the hard timeout as NVIDIA's wrapper
        requires (``soft < hard < barrier``)."""
        return self.soft_timeout + self.hard_timeout

    @property
    def timer_grace(self) -> float:
        """Seconds the timer server waits past an expired timer's deadline before it reaps
        the worker: ``hard_timeout - soft_timeout`` when enabled, else 0 (reaped at
        expiry). NVIDIA's semantics: soft and hard timeouts both count from the last
        progress; an expired ``expires()`` timer is the soft timeout (the rank's wrapper
        reports it and leaves in process), the reap the hard one. So the ranks blocked in
        a collective on a hung peer, whose timers expire too, leave before they could be
        reaped, and only the hung rank is."""
        return max(0.0, self.hard_timeout - self.soft_timeout) if self.enabled else 0.0

    def problems(self) -> list[str]:
        """What is wrong with these settings (empty when valid)."""
        out = []
        if self.max_restarts < 0:
            out.append(f"{contract.ENV_INPROCESS_MAX_RESTARTS} must be >= 0")
        if not 0 <= self.spare_ranks <= contract.MAX_INPROCESS_SPARES:
            out.append(f"{contract.ENV_INPROCESS_SPARES} must be in "
                       f"0..{contract.MAX_INPROCESS_SPARES}")  # fmt: skip
        if not 0 < self.soft_timeout < math.inf:
            out.append(f"{contract.ENV_INPROCESS_SOFT_TIMEOUT} must be > 0 seconds")
        if not self.soft_timeout < self.hard_timeout < math.inf:
            out.append(
                f"{contract.ENV_INPROCESS_HARD_TIMEOUT} ({self.hard_timeout}) must be above "
                f"{contract.ENV_INPROCESS_SOFT_TIMEOUT} ({self.soft_timeout})"
            )
        return out


@dataclass(frozen=True)
class PersistSettings:
    """Persistence of the checkpoint slots (``spec.checkpoint.persist``;
    :mod:`kelastic_sidecar.persister`).

    Attributes:
        directory: the job's persistence folder (``$KELASTIC_CHECKPOINT_PERSIST_DIR``).
        every_steps: persist each step that is a multiple of it (0: only at stop).
        on_stop: persist what the slots hold when the sidecar is stopped.
        keep: complete steps kept; older ones are removed.
    """

    directory: Path
    every_steps: int = 0
    on_stop: bool = True
    keep: int = contract.DEFAULT_PERSIST_KEEP


def _persist_settings(
    env: Mapping[str, str],
    num: Callable[[str, Callable[[str], int], int], int],
    problems: list[str],
) -> PersistSettings | None:
    """:class:`PersistSettings` from ``env`` (None: no persistence folder set); a bad
    value is added to ``problems``."""
    raw = env.get(contract.ENV_CHECKPOINT_PERSIST_DIR, "")
    if not raw:
        return None
    if not raw.startswith("/"):
        problems.append(f"{contract.ENV_CHECKPOINT_PERSIST_DIR} must be an absolute path")
    settings = PersistSettings(
        directory=Path(raw),
        every_steps=num(contract.ENV_CHECKPOINT_PERSIST_EVERY, int, 0),
        on_stop=env.get(contract.ENV_CHECKPOINT_PERSIST_ON_STOP, "1").strip().lower() in _TRUE,
        keep=num(contract.ENV_CHECKPOINT_PERSIST_KEEP, int, contract.DEFAULT_PERSIST_KEEP),
    )
    if not 0 <= settings.every_steps <= contract.MAX_PERSIST_EVERY:
        problems.append(
            f"{contract.ENV_CHECKPOINT_PERSIST_EVERY} must be 0..{contract.MAX_PERSIST_EVERY}"
        )
    if not 1 <= settings.keep <= contract.MAX_PERSIST_KEEP:
        problems.append(
            f"{contract.ENV_CHECKPOINT_PERSIST_KEEP} must be 1..{contract.MAX_PERSIST_KEEP}"
        )
    return settings


@dataclass(frozen=True)
class ReplicationSettings:
    """Replication of the checkpoint slots to peer nodes (``spec.checkpoint.replicas``;
    :mod:`kelastic_sidecar.replication`).

    Attributes:
        replicas: peer nodes holding each rank's due steps (1; 0: none, the slots only
            served, for a replicated state's joining nodes:
            :attr:`SidecarConfig.layout`).
        every: replicate the steps that are multiples of it.
        rate: bytes per second sent at most (0: no limit).
        port: the TCP port served (0: any free one).
        max_slot_bytes: the largest replica received, bytes (the checkpoint volume's size,
            ``$KELASTIC_CHECKPOINT_MEMORY``; 2**40 without one).
    """

    replicas: int = 1
    every: int = contract.DEFAULT_REPLICATE_EVERY
    rate: int = contract.DEFAULT_REPLICATION_RATE
    port: int = contract.DEFAULT_REPLICA_PORT
    max_slot_bytes: int = 2**40


def _netcheck(env: Mapping[str, str], problems: list[str]) -> Setting | None:
    """``$KELASTIC_NETCHECK`` (:mod:`kelastic.netcheck`): None when unset or empty."""
    raw = env.get(contract.ENV_NETCHECK, "")
    if not raw:
        return None
    try:
        return decode_setting(raw)
    except NetcheckError as exc:
        problems.append(f"{contract.ENV_NETCHECK}: {exc}")
        return None


def _replication_settings(
    env: Mapping[str, str],
    num: Callable[[str, Callable[[str], int], int], int],
    problems: list[str],
    layout: contract.StateLayout,
) -> ReplicationSettings | None:
    """:class:`ReplicationSettings` from ``env`` (None: no replicas asked for, and the
    state (``layout``) not replicated: nothing to serve); a bad value is added to
    ``problems``."""
    replicas = num(contract.ENV_CHECKPOINT_REPLICAS, int, 0)
    if not 0 <= replicas <= contract.MAX_CHECKPOINT_REPLICAS:
        problems.append(f"{contract.ENV_CHECKPOINT_REPLICAS} must be "
                        f"0..{contract.MAX_CHECKPOINT_REPLICAS}")  # fmt: skip
        return None
    if replicas == 0 and layout is not contract.StateLayout.REPLICATED:
        return None
    settings = ReplicationSettings(
        replicas=replicas,
        every=num(contract.ENV_CHECKPOINT_REPLICATE_EVERY, int, contract.DEFAULT_REPLICATE_EVERY),
        rate=num(contract.ENV_CHECKPOINT_REPLICATION_RATE, int, contract.DEFAULT_REPLICATION_RATE),
        port=num(contract.ENV_REPLICA_PORT, int, contract.DEFAULT_REPLICA_PORT),
        max_slot_bytes=num(contract.ENV_CHECKPOINT_MEMORY, int, 2**40) or 2**40,
    )
    if not 1 <= settings.every <= contract.MAX_PERSIST_EVERY:
        problems.append(f"{contract.ENV_CHECKPOINT_REPLICATE_EVERY} must be "
                        f"1..{contract.MAX_PERSIST_EVERY}")  # fmt: skip
    if not 0 <= settings.rate <= 2**40:
        problems.append(f"{contract.ENV_CHECKPOINT_REPLICATION_RATE} must be 0..2**40 bytes/s")
    if not 0 <= settings.port <= 65535:
        problems.append(f"{contract.ENV_REPLICA_PORT} must be 0..65535")
    return settings


def _failure_domain(env: Mapping[str, str], problems: list[str]) -> str:
    """``$KELASTIC_FAILURE_DOMAIN`` (unset: ``""``); a value that is not a label value is
    added to ``problems``."""
    value = env.get(contract.ENV_FAILURE_DOMAIN, "").strip()
    if not is_domain(value):
        problems.append(f"{contract.ENV_FAILURE_DOMAIN}={value!r:.80} is not a label value")
        return ""
    return value


def _layout(env: Mapping[str, str], problems: list[str]) -> contract.StateLayout:
    """``$KELASTIC_CHECKPOINT_LAYOUT`` (unset: sharded); a bad value is added to
    ``problems``."""
    raw = env.get(contract.ENV_CHECKPOINT_LAYOUT, "") or contract.StateLayout.SHARDED
    try:
        return contract.StateLayout(raw)
    except ValueError:
        problems.append(f"{contract.ENV_CHECKPOINT_LAYOUT} must be one of "
                        f"{', '.join(contract.StateLayout)}, not {raw!r:.40}")  # fmt: skip
        return contract.StateLayout.SHARDED


@dataclass(frozen=True)
class SidecarConfig:
    """Everything one sidecar needs to supervise its node.

    Attributes:
        job_name, namespace: the ElasticJob's identity.
        job_uid: the run id (``TORCHELASTIC_RUN_ID``); separates reruns of a same-named job.
        node: this node's rendezvous name (the Pod name).
        pod_ip: address workers of other nodes reach this node at (MASTER_ADDR if rank 0).
        pod_uid: the Pod's uid (``$KELASTIC_POD_UID``; ``""`` outside Kubernetes): the
            reports the operator reads name this Pod, not an earlier one of its name.
        failure_domain: the zone of the Node it runs on (``$KELASTIC_FAILURE_DOMAIN``;
            ``""`` unknown): replicas go to a peer in another one where the round allows.
        host_node: the Kubernetes Node it runs on (``$KELASTIC_HOST_NODE``; ``""``
            outside Kubernetes), written into the charges this node makes.
        etcd_endpoints: ``host:port`` list.
        tls_dir: directory with ca.crt, tls.crt, tls.key, or None for plaintext.
        min_nodes, max_nodes: rendezvous bounds; nproc_per_node: workers per node.
        max_restarts: the job's global restart budget.
        join_timeout, last_call_timeout, close_timeout: seconds.
        lease_ttl: seconds (integer) of this node's etcd lease.
        stop_grace: seconds between SIGTERM and SIGKILL when stopping workers.
        http_host, http_port: where /metrics, /healthz, /readyz, /status listen.
        run_dir: the shared volume (FIFO, control socket, logs).
        etcd_user, etcd_password: etcd's user and password when etcd has auth enabled
            (``None``: no auth), beside or without TLS.
        inprocess: in-process restarts (:class:`InProcessSettings`).
        failure_rules: ``spec.failurePolicy.rules`` (``$KELASTIC_FAILURE_POLICY``,
            :mod:`kelastic.failure_policy`'s codec); empty: none.
        netcheck: the network check of each round (``spec.preflight.network``,
            ``$KELASTIC_NETCHECK``, :mod:`kelastic.netcheck`'s setting codec; run by
            :mod:`~kelastic_sidecar.netcheck`); None: none.
        hang_evidence_budget: seconds the sidecar may spend reading a hung worker's
            stacks before killing it (``$KELASTIC_HANG_EVIDENCE_BUDGET``, default 2; 0:
            none read; :mod:`~kelastic_sidecar.hang_evidence`).
        stopped_timeout: seconds a worker may stay stopped (state ``T``) before it is
            killed as hung (``$KELASTIC_STOPPED_TIMEOUT``, default 60; 0: never;
            :mod:`~kelastic_sidecar.stopped_watch`).
        stragglers: the step-time straggler verdict's factor and minimum steps
            (``$KELASTIC_STRAGGLER_FACTOR``, default 1.5; ``$KELASTIC_STRAGGLER_MIN_STEPS``,
            default 20; :mod:`~kelastic_sidecar.steptime`).
        persist: persistence of the checkpoint slots, None without.
        replication: replication of the checkpoint slots to peers, None without.
        layout: how the ranks' checkpoint states relate (``spec.checkpoint.stateLayout``;
            ``$KELASTIC_CHECKPOINT_LAYOUT``): with a replicated one any rank's copy
            restores any rank (:func:`kelastic.etcd_values.checkpoints.restore_of`).
    """

    job_name: str
    namespace: str
    job_uid: str
    node: str
    pod_ip: str
    etcd_endpoints: tuple[str, ...]
    tls_dir: Path | None
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    max_restarts: int
    join_timeout: float
    last_call_timeout: float
    close_timeout: float
    lease_ttl: int
    stop_grace: float
    http_host: str
    http_port: int
    run_dir: Path
    etcd_user: str | None = None
    etcd_password: str = field(default="", repr=False)
    inprocess: InProcessSettings = field(default_factory=InProcessSettings)
    failure_rules: tuple[failure_policy.FailureRule, ...] = ()
    hang_evidence_budget: float = DEFAULT_BUDGET
    stopped_timeout: float = contract.DEFAULT_STOPPED_TIMEOUT
    stragglers: StragglerSettings = field(default_factory=StragglerSettings)
    pod_uid: str = ""
    host_node: str = ""
    failure_domain: str = ""
    persist: PersistSettings | None = None
    replication: ReplicationSettings | None = None
    layout: contract.StateLayout = contract.StateLayout.SHARDED
    netcheck: Setting | None = None

    def rendezvous_settings(self) -> RendezvousSettings:
        """The rendezvous' settings for this node (its Pod uid as its incarnation).

        Raises:
            ValueError: a bound or timeout out of range (:class:`RendezvousSettings`).
        """
        # imported here: the rendezvous needs the etcd client (the sidecar extra), and
        # this module must load without it (``kelastic-sidecar`` names the missing extra)
        from .rendezvous import RendezvousSettings

        return RendezvousSettings(
            run_id=self.job_uid,
            min_nodes=self.min_nodes,
            max_nodes=self.max_nodes,
            join_timeout=self.join_timeout,
            last_call_timeout=self.last_call_timeout,
            close_timeout=self.close_timeout,
            lease_ttl=self.lease_ttl,
            incarnation=self.pod_uid,
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SidecarConfig:
        """Build the config from ``env`` (default ``os.environ``).

        Raises:
            ConfigError: listing every missing or invalid variable.
        """
        env = os.environ if env is None else env
        problems: list[str] = []

        def get(name: str, conv: Callable[[str], T], default: T | None = None) -> T | None:
            """The converted value; None (and a recorded problem) when missing or bad."""
            raw = env.get(name)
            if raw is None or raw == "":
                if default is None:
                    problems.append(f"{name} is required")
                return default
            try:
                return conv(raw)
            except ValueError:
                problems.append(f"{name}={raw!r} is not a valid {getattr(conv, '__name__', conv)}")
                return default

        def text(name: str, default: str | None = None) -> str:
            return get(name, str, default) or ""

        def num(name: str, conv: Callable[[str], T], default: T | None = None) -> T:
            value = get(name, conv, default)
            return value if value is not None else conv("0")

        endpoints = tuple(
            e.strip() for e in text(contract.ENV_ETCD_ENDPOINTS).split(",") if e.strip()
        )
        try:
            rules = failure_policy.decode_rules(env.get(failure_policy.ENV_FAILURE_POLICY, ""))
        except failure_policy.FailurePolicyError as exc:
            problems.append(f"{failure_policy.ENV_FAILURE_POLICY}: {exc}")
            rules = ()
        tls = env.get(contract.ENV_ETCD_TLS_DIR)
        ip_max, ip_soft, ip_hard = (
            contract.ENV_INPROCESS_MAX_RESTARTS,
            contract.ENV_INPROCESS_SOFT_TIMEOUT,
            contract.ENV_INPROCESS_HARD_TIMEOUT,
        )
        layout = _layout(env, problems)
        netcheck = _netcheck(env, problems)
        cfg = cls(
            job_name=text(contract.ENV_JOB_NAME),
            namespace=text(contract.ENV_NAMESPACE, "default"),
            job_uid=text(contract.ENV_JOB_UID),
            node=text(contract.ENV_POD_NAME),
            pod_ip=text(contract.ENV_POD_IP, "127.0.0.1"),
            pod_uid=text(contract.ENV_POD_UID, ""),
            host_node=text(contract.ENV_HOST_NODE, ""),
            failure_domain=_failure_domain(env, problems),
            etcd_endpoints=endpoints,
            tls_dir=Path(tls) if tls else None,
            min_nodes=num(contract.ENV_MIN_NODES, int),
            max_nodes=num(contract.ENV_MAX_NODES, int),
            nproc_per_node=num(contract.ENV_NPROC_PER_NODE, int, 1),
            max_restarts=num(contract.ENV_MAX_RESTARTS, int, contract.DEFAULT_MAX_RESTARTS),
            join_timeout=num(contract.ENV_JOIN_TIMEOUT, float, contract.DEFAULT_JOIN_TIMEOUT),
            last_call_timeout=num(
                contract.ENV_LAST_CALL_TIMEOUT, float, contract.DEFAULT_LAST_CALL_TIMEOUT
            ),
            close_timeout=num(contract.ENV_CLOSE_TIMEOUT, float, contract.DEFAULT_CLOSE_TIMEOUT),
            lease_ttl=num(contract.ENV_LEASE_TTL, int, contract.DEFAULT_LEASE_TTL),
            stop_grace=num(contract.ENV_STOP_GRACE, float, contract.DEFAULT_STOP_GRACE),
            http_host=text(contract.ENV_HTTP_HOST, "0.0.0.0"),
            http_port=num(contract.ENV_HTTP_PORT, int, contract.DEFAULT_HTTP_PORT),
            run_dir=contract.run_dir(),
            etcd_user=env.get(contract.ENV_ETCD_USER) or None,
            etcd_password=env.get(contract.ENV_ETCD_PASSWORD, ""),
            inprocess=InProcessSettings(
                enabled=env.get(contract.ENV_INPROCESS, "").strip().lower() in _TRUE,
                max_restarts=num(ip_max, int, contract.DEFAULT_INPROCESS_MAX_RESTARTS),
                soft_timeout=num(ip_soft, float, contract.DEFAULT_INPROCESS_SOFT_TIMEOUT),
                hard_timeout=num(ip_hard, float, contract.DEFAULT_INPROCESS_HARD_TIMEOUT),
                spare_ranks=num(contract.ENV_INPROCESS_SPARES, int, 0),
            ),
            failure_rules=rules,
            netcheck=netcheck,
            hang_evidence_budget=num(ENV_BUDGET, float, DEFAULT_BUDGET),
            stopped_timeout=num(
                contract.ENV_STOPPED_TIMEOUT, float, contract.DEFAULT_STOPPED_TIMEOUT
            ),
            stragglers=StragglerSettings(
                factor=num(ENV_STRAGGLER_FACTOR, float, DEFAULT_FACTOR),
                min_steps=num(ENV_STRAGGLER_MIN_STEPS, int, DEFAULT_MIN_STEPS),
            ),
            persist=_persist_settings(env, num, problems),
            replication=_replication_settings(env, num, problems, layout),
            layout=layout,
        )
        if contract.ENV_ETCD_ENDPOINTS in env and not endpoints:
            problems.append(f"{contract.ENV_ETCD_ENDPOINTS} lists no endpoint")
        if not problems:
            problems.extend(cfg._range_problems())
        if problems:
            raise ConfigError("invalid sidecar environment:\n  " + "\n  ".join(problems))
        return cfg

    def _range_problems(self) -> list[str]:
        out = []
        if not 1 <= self.min_nodes <= self.max_nodes:
            out.append(f"need 1 <= min_nodes ({self.min_nodes}) <= max_nodes ({self.max_nodes})")
        if self.nproc_per_node < 1:
            out.append(f"nproc_per_node must be >= 1, got {self.nproc_per_node}")
        if self.max_restarts < 0:
            out.append(f"max_restarts must be >= 0, got {self.max_restarts}")
        for name in ("join_timeout", "last_call_timeout", "close_timeout", "stop_grace"):
            if getattr(self, name) <= 0:
                out.append(f"{name} must be > 0 seconds")
        if self.lease_ttl < 1:
            out.append(f"lease_ttl must be >= 1 second, got {self.lease_ttl}")
        if not 0 <= self.hang_evidence_budget < math.inf:
            out.append(f"{ENV_BUDGET} must be >= 0 seconds, got {self.hang_evidence_budget}")
        if not 0 <= self.stopped_timeout <= 86400:  # NaN fails too
            out.append(
                f"{contract.ENV_STOPPED_TIMEOUT} must be 0..86400 seconds, got "
                f"{self.stopped_timeout}"
            )
        if not 0 <= self.http_port <= 65535:
            out.append(f"http_port out of range: {self.http_port}")
        return out + self.inprocess.problems() + self.stragglers.problems()

    def etcd_client(self, timeout: float = 5.0) -> EtcdClient:
        """A client for the configured etcd (endpoints, TLS, user and password)."""
        from kelastic_etcd import EtcdClient

        return EtcdClient(
            self.etcd_endpoints,
            tls_dir=self.tls_dir,
            timeout=timeout,
            user=self.etcd_user,
            password=self.etcd_password,
        )

    @property
    def prefix(self) -> str:
        """The job's etcd key prefix."""
        return contract.job_prefix(self.namespace, self.job_name, self.job_uid)
