"""The supervisor's parts and the events they send it, built in one place.

:func:`build_parts` constructs what one node's :class:`~kelastic_sidecar.supervisor.Supervisor`
runs with (etcd store, timer server, control server, ``/metrics`` HTTP server,
restart budget, metrics, in-process restart coordinator) and connects their callbacks
to the supervisor's event queue as typed events (:class:`WorkerReaped`, :class:`FromLauncher`,
:class:`RendezvousChanged`, :class:`RespawnDue`), so that the supervisor holds no construction code.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kelastic import contract

from .config import SidecarConfig
from .control import ControlServer, Message
from .etcd_store import EtcdStore, EtcdUnavailableError
from .http import SidecarHttpServer
from .inprocess_coordinator import InProcessCoordinator
from .metrics import SidecarMetrics
from .restart_budget import RestartBudget
from .timer_server import ReapEvent, TimerServer

__all__ = [
    "EtcdHealth",
    "Event",
    "FromLauncher",
    "Hooks",
    "Parts",
    "RendezvousChanged",
    "RespawnDue",
    "WorkerReaped",
    "build_parts",
]


@dataclass(frozen=True)
class WorkerReaped:
    """The timer server signalled a hung worker."""

    reap: ReapEvent


@dataclass(frozen=True)
class FromLauncher:
    """A message from the launcher, or its disconnection."""

    message: Message


@dataclass(frozen=True)
class RespawnDue:
    """The in-process coordinator wants a dead local rank started again (the hybrid
    rung): ``env`` on top of its attempt's, for the round ``round``."""

    round: int
    local_rank: int
    env: dict[str, str]
    #: Not None: the spare waiting in this slot took the dead rank's place (spare
    #: ranks): the launcher gets a ``promote`` instead, and starts no process for it.
    spare: int | None = None
    #: That spare's pid (its ``hello``'s), which the ``promote`` names.
    spare_pid: int = 0


@dataclass(frozen=True)
class RendezvousChanged:
    """The rendezvous may have changed: check the round (at most one waits queued)."""


#: What the supervisor's main thread takes off its queue.
Event = WorkerReaped | FromLauncher | RendezvousChanged | RespawnDue


class EtcdHealth:
    """Whether etcd answers, for ``/status``: every failed call of the store counts (the
    lease keep-alive's and the watches' included)."""

    def __init__(self, store: EtcdStore, metrics: SidecarMetrics) -> None:
        self._store = store
        self._metrics = metrics
        self._error: tuple[float, str] | None = None  # (monotonic time, message)

    def on_error(self, exc: EtcdUnavailableError) -> None:
        """The store's ``on_error``."""
        self._metrics.etcd_errors.inc()
        self._error = (time.monotonic(), str(exc))

    def outage(self) -> str | None:
        """The last etcd error (it names the endpoint) while no call has succeeded since;
        None while etcd answers. The store keeps retrying meanwhile."""
        err = self._error
        if err is None or self._store.last_success > err[0]:
            return None
        return err[1]


@dataclass(frozen=True)
class Hooks:
    """What the parts call back into the supervisor for."""

    healthy: Callable[[], bool]
    ready: Callable[[], bool]
    status: Callable[[], dict[str, Any]]


@dataclass
class Parts:
    """One node's servers and clients (see :func:`build_parts`)."""

    store: EtcdStore
    keys: contract.Keys
    events: queue.Queue[Event]
    timer: TimerServer
    metrics: SidecarMetrics
    control: ControlServer
    http: SidecarHttpServer
    budget: RestartBudget
    etcd_health: EtcdHealth
    inprocess: InProcessCoordinator


def build_parts(config: SidecarConfig, store: EtcdStore | None, hooks: Hooks) -> Parts:
    """Construct the supervisor's parts; nothing is started (``Supervisor.run`` does).

    Args:
        config: the node's configuration.
        store: an etcd store; built from the config (endpoints, TLS, user and password)
            when None.
        hooks: the supervisor's callbacks.
    """
    keys = contract.Keys(config.prefix)
    store = store or config.etcd_client()  # endpoints, TLS, user and password
    events: queue.Queue[Event] = queue.Queue()
    timer = TimerServer(
        contract.timer_fifo_path(config.run_dir),
        on_reap=lambda ev: events.put(WorkerReaped(ev)),
        grace=config.inprocess.timer_grace,
    )
    metrics = SidecarMetrics(timer.stats)
    # Every failed etcd call counts, the lease keep-alive's and the watches' included.
    etcd_health = EtcdHealth(store, metrics)
    store.on_error = etcd_health.on_error
    metrics.budget_max.set(config.max_restarts)
    control = ControlServer(
        contract.control_socket_path(config.run_dir),
        on_message=lambda msg: events.put(FromLauncher(msg)),
    )
    http = SidecarHttpServer(
        config.http_host,
        config.http_port,
        metrics.registry,
        healthy=hooks.healthy,
        ready=hooks.ready,
        status=hooks.status,
    )
    budget = RestartBudget(
        store,
        keys,
        config.max_restarts,
        on_repair=metrics.corrupt_values.labels(source="restart_record").inc,
    )
    inprocess = InProcessCoordinator(
        config.inprocess, store, keys, config.node, metrics, config.run_dir, config.pod_ip,
        on_respawn=lambda round_, local_rank, env: events.put(RespawnDue(round_, local_rank, env)),
        on_promote=lambda round_, slot, local_rank, pid: events.put(
            RespawnDue(round_, local_rank, {}, spare=slot, spare_pid=pid)
        ),
    )  # fmt: skip
    return Parts(store, keys, events, timer, metrics, control, http, budget, etcd_health, inprocess)
