"""What the in-process restart machine and its rungs know of each other: the machine as
its parts see it (:class:`Node`) and the rungs' callbacks. Types only (a leaf), so that
the machine and the rungs import no module of one another.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # annotations only
    from kelastic import contract
    from kelastic_etcd import EtcdClient

    from ..config import InProcessSettings
    from ..ipc import DropReason
    from ..metrics import SidecarMetrics
    from .history import RestartHistory
    from .phase import Phase
    from .record import IterationRecord, ReadyRecord, RestartCause
    from .round import RoundContext
    from .server import Session

__all__ = [
    "Node",
    "OnKill",
    "OnPromote",
    "OnRespawn",
    "Phase",
    "no_kill",
    "no_promote",
    "no_respawn",
]

log = logging.getLogger("kelastic_sidecar.inprocess")


#: ``(round, local_rank, env)``: start that dead local rank of the round again with
#: ``env`` on top of its attempt's (the supervisor sends the launcher a ``respawn``).
OnRespawn = Callable[[int, int, dict[str, str]], None]

#: ``(round, spare_slot, local_rank, pid)``: the spare ``pid`` (its ``hello``'s: the
#: launcher's view) waiting in that slot was sent the ``go`` of that dead local rank (the
#: supervisor sends the launcher a ``promote``).
OnPromote = Callable[[int, int, int, int], None]

#: ``(pid, why)``: the hard timeout is about to SIGKILL that worker (the supervisor
#: queues it as a reap: its monitor holds every hang, the timer server's and these).
OnKill = Callable[[int, str], None]


def no_respawn(round_: int, local_rank: int, env: dict[str, str]) -> None:
    """The :data:`OnRespawn` of a machine nobody listens to: logged."""
    log.error("no one to start local rank %d again (round %d)", local_rank, round_)


def no_kill(pid: int, why: str) -> None:
    """The :data:`OnKill` of a machine nobody listens to: the kill is logged anyway."""


def no_promote(round_: int, slot: int, local_rank: int, pid: int) -> None:
    """The :data:`OnPromote` of a machine nobody listens to: logged."""
    log.error("no one to tell that spare slot %d is local rank %d (round %d)", slot, local_rank,
              round_)  # fmt: skip


class Node(Protocol):
    """The :class:`~.machine.RestartMachine` as a rung sees it: the node's state (see the
    machine's attributes) and the operations a rung may ask for."""

    settings: InProcessSettings
    store: EtcdClient
    keys: contract.Keys
    node: str
    metrics: SidecarMetrics
    clock: Callable[[], float]
    drop: Callable[[Session, DropReason | None], None]
    ctx: RoundContext | None
    phase: Phase
    iteration: int
    base: int
    restarts: int
    sessions: dict[int, Session]
    offset: dict[int, int]
    ready: set[int]
    barrier_until: float | None
    history: RestartHistory
    on_respawn: OnRespawn
    on_promote: OnPromote

    def advance(
        self,
        cause: RestartCause,
        *,
        rank: int,
        message: str,
        now: float,
        why: str,
        charge: bool = True,
        faulted: int | None = None,
        take_over: bool = False,
    ) -> tuple[IterationRecord | None, str]:
        """Compare-and-set the record to the next iteration and apply it."""

    def apply(self, record: IterationRecord) -> None:
        """Abort into ``record``'s iteration when it is new."""

    def forget(self, local_rank: int) -> None:
        """Drop a dead rank's session."""

    def give_up_all(self, reason: str) -> None:
        """No in-process restart in this round any more."""

    def ready_if_all(self) -> None:
        """Write our ready key when every local rank is ready."""

    def go(self, ctx: RoundContext, master: ReadyRecord) -> None:
        """Every node is ready: ``go`` to every local rank."""
