"""A rank that cannot leave an aborted iteration because it is connecting to a host that
does not answer: killed at once, not at the hard timeout. A part of the
:class:`~.machine.RestartMachine` (loop thread only).

The case: the node that served the aborted iteration's c10d store (its group rank 0) is
gone, and a rank of another node was in ``init_process_group`` for that iteration. Its
``TCPStore`` client is in C++ connecting to the gone address; a connect that is refused
or reset, or interrupted by a signal, is retried by torch until the store's timeout
(``init_process_group``'s, 30 minutes by default; measured with torch 2.13: a signal
ends one try, ``TCPStore.cpp`` logs "retrying" and tries again). No abort reaches it:
the connection shutdown finds no connection (the socket is not connected), and the
asynchronous exception waits for a bytecode that never runs. The only way out is the
process's end, and the hard timeout (90 s by default) was the only one to bring it.

The evidence is the kernel's: while a rank has not said ``ready`` after its ``abort``,
every :data:`LOOK_EVERY` seconds its process's TCP sockets are read from
``/proc/<pid>/net/tcp{,6}`` (the Pod's network namespace, which the sidecar shares); a
socket in ``SYN_SENT`` whose SYN was sent again (``retrnsmt`` > 0: unanswered for the
initial retransmission timeout, 1 s) is a connection to a host that does not answer.
Such a rank is killed like one past its hard timeout
(:meth:`~.hard_timeout.HardTimeouts.kill`: told to the supervisor as a reap first); the
hybrid rung then starts it again, with its peers in process. A host that answers (a
refusal, a reset) leaves no such socket: that rank waits for the hard timeout as before.
Reading another process's ``fd`` links takes ptrace's read access: the sidecar has it
when it runs as the trainer's user (what the operator sets when the Pod template names
that user, and ``kelastic run``); a trainer running as root with capabilities the
sidecar lacks (it keeps only CAP_KILL) cannot be read, and its ranks wait for the hard
timeout as before.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Final

from .hard_timeout import victim_pid
from .phase import Phase

if TYPE_CHECKING:  # annotations only
    from .hard_timeout import HardTimeouts
    from .parts import Node

__all__ = ["LOOK_EVERY", "UnansweredConnects", "socket_inodes", "unanswered"]

log = logging.getLogger("kelastic_sidecar.inprocess")

#: Seconds between two looks at the sockets of the ranks that have not left.
LOOK_EVERY: Final = 0.5
_SYN_SENT: Final = "02"
#: Most lines of one ``/proc/<pid>/net/tcp`` file read (a hostile or huge table).
_MAX_LINES: Final = 65536


def _address(field: str) -> tuple[str, int] | None:
    """``/proc/net/tcp``'s ``HEXADDR:HEXPORT`` as ``(address, port)`` (IPv4: one
    little-endian word; IPv6: four, an IPv4-mapped one said as its IPv4); None when
    malformed."""
    addr, _, port = field.partition(":")
    try:
        number = int(port, 16)
        raw = bytes.fromhex(addr)
    except ValueError:
        return None
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1])), number
    if len(raw) == 16:
        v6 = ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
        return str(v6.ipv4_mapped or v6), number  # torch's store client: a mapped IPv4
    return None


def unanswered(lines: Iterable[str], inodes: Collection[int]) -> list[tuple[str, int]]:
    """The remote ``(address, port)`` of each socket among ``inodes`` that is connecting
    (``SYN_SENT``) and has sent its SYN again, from the lines of ``/proc/<pid>/net/tcp``
    or ``tcp6`` (the header and malformed lines are skipped; nothing raises)."""
    found: list[tuple[str, int]] = []
    for line in lines:
        fields = line.split()
        if len(fields) < 10 or fields[3] != _SYN_SENT:
            continue
        try:
            retransmits, inode = int(fields[6]), int(fields[9])
        except ValueError:
            continue
        remote = _address(fields[2])
        if retransmits > 0 and inode in inodes and remote is not None:
            found.append(remote)
    return found


def socket_inodes(pid: int, proc: Path = Path("/proc")) -> set[int]:
    """The inodes of ``pid``'s sockets (from its ``fd`` links); empty when they cannot
    be read (gone, or not ours to read)."""
    out: set[int] = set()
    try:
        names = os.listdir(proc / str(pid) / "fd")
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(proc / str(pid) / "fd" / name)
        except OSError:
            continue
        if target.startswith("socket:[") and target.endswith("]"):
            try:
                out.add(int(target[len("socket:[") : -1]))
            except ValueError:
                continue
    return out


def connecting_nowhere(pid: int, proc: Path = Path("/proc")) -> list[tuple[str, int]]:
    """Where ``pid`` is connecting without an answer (see :func:`unanswered`); empty
    when its sockets or tables cannot be read."""
    inodes = socket_inodes(pid, proc)
    if not inodes:
        return []
    found: list[tuple[str, int]] = []
    for table in ("tcp", "tcp6"):
        try:
            with open(proc / str(pid) / "net" / table, encoding="ascii", errors="replace") as f:
                lines = [line for _, line in zip(range(_MAX_LINES), f, strict=False)]
        except OSError:
            continue
        found.extend(unanswered(lines, inodes))
    return found


class UnansweredConnects:
    """Kills the ranks of an abort in flight that are connecting to a host that does not
    answer (see the module doc).

    Args:
        hard: the hard timeout's part, whose kill this is (the same report and signal).
        look: where a rank's pid is connecting without an answer
            (:func:`connecting_nowhere`; tests may replace it).
    """

    def __init__(
        self,
        hard: HardTimeouts,
        look: Callable[[int], list[tuple[str, int]]] = connecting_nowhere,
    ) -> None:
        self._hard = hard
        self._look = look
        self._next: float | None = None
        self._killed: set[int] = set()  # pids killed in this abort

    def deadlines(self, m: Node) -> list[float]:
        """When to look next: every :data:`LOOK_EVERY` s while an abort waits for ranks."""
        if not self._waiting(m):
            self._next = None
            self._killed.clear()
            return []
        if self._next is None:
            self._next = m.clock() + LOOK_EVERY
        return [self._next]

    def check(self, m: Node, now: float) -> None:
        """Look at the sockets of each rank that has not left, when due; kill those
        connecting nowhere."""
        if self._next is None or now < self._next:
            return
        self._next = now + LOOK_EVERY
        for local_rank in self._waiting(m):
            session = m.sessions[local_rank]
            pid = victim_pid(session)
            where = self._look(pid) if pid is not None and pid not in self._killed else []
            if not where or pid is None:
                continue
            addr, port = where[0]
            why = (f"connecting to {addr}:{port}, which has not answered for over a second "
                   f"(its host gone?): it cannot leave for iteration {m.iteration}")  # fmt: skip
            self._killed.add(pid)
            self._hard.cancel(local_rank)
            self._hard.kill(session, m.iteration, why=why)

    @staticmethod
    def _waiting(m: Node) -> list[int]:
        """The connected local ranks that have not said ``ready`` in the abort in flight."""
        if m.phase != Phase.ABORTING:
            return []
        return sorted(lr for lr, s in m.sessions.items() if lr not in m.ready and s.hello)
