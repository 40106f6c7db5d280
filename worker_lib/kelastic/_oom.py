"""Was a worker taken by the OOM killer? The launcher asks when a worker dies of SIGKILL.

The kernel counts, per memory cgroup, the processes its OOM killer took (cgroup v2:
``oom_kill`` in ``memory.events``; v1: ``oom_kill`` in ``memory.oom_control``, kernel
>= 4.13), for a container's memory limit and for the whole machine running out alike. The
launcher reads its own cgroup's counter (its container's, on Kubernetes: the trainer's)
and the limit (``memory.max`` / ``memory.limit_in_bytes``), so that a worker SIGKILLed
while the counter grew is reported as OOM-killed with the limit, not as a bare SIGKILL.

Where the files are: ``/proc/self/cgroup`` names the launcher's cgroup; inside a container
whose cgroup is mounted at the hierarchy's root (runc on cgroup v1, or a cgroup namespace
on v2) that path does not exist under the mount, and the mount's root is the container's
own cgroup. No file (another OS, no memory controller): nothing is ever reported.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path

from kelastic.errors import ErrorInfo

#: cgroup v1 writes this (page-aligned LONG_MAX) for "no limit"; v2 writes "max".
_V1_UNLIMITED = 1 << 62
MAX_FILE_BYTES = 4096


def _read(path: Path) -> str | None:
    try:
        with path.open("rb") as fp:
            return fp.read(MAX_FILE_BYTES).decode("ascii", "replace")
    except OSError:
        return None


@dataclass(frozen=True)
class MemoryCgroup:
    """The files of one memory cgroup: ``events`` holds the ``oom_kill`` counter,
    ``limit`` the memory limit in bytes."""

    events: Path
    limit: Path

    def oom_kills(self) -> int | None:
        """The ``oom_kill`` counter, or None when unreadable."""
        text = _read(self.events)
        for line in (text or "").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit() and len(value.strip()) < 20:
                return int(value)
        return None

    def limit_bytes(self) -> int | None:
        """The memory limit in bytes; None when there is none or it is unreadable."""
        text = (_read(self.limit) or "").strip()
        if not text.isdigit() or len(text) > 19:
            return None
        value = int(text)
        return None if value >= _V1_UNLIMITED else value


def find_memory_cgroup(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> MemoryCgroup | None:
    """The memory cgroup this process is in (see the module docstring), or None."""
    v1: str | None = None
    v2: str | None = None
    for line in (_read(proc_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    candidates: list[MemoryCgroup] = []
    if v1 is not None:
        base = root / "memory"
        for folder in (base / v1.lstrip("/"), base):
            candidates.append(
                MemoryCgroup(folder / "memory.oom_control", folder / "memory.limit_in_bytes")
            )
    if v2 is not None:
        for folder in (root / v2.lstrip("/"), root):
            candidates.append(MemoryCgroup(folder / "memory.events", folder / "memory.max"))
    for cgroup in candidates:
        if cgroup.oom_kills() is not None:
            return cgroup
    return None


class OomWatch:
    """Counts the OOM kills of one memory cgroup since the last look.

    Args:
        cgroup: the cgroup; :func:`find_memory_cgroup` by default. None: never reports.
    """

    def __init__(self, cgroup: MemoryCgroup | None = None, *, find: bool = True) -> None:
        self.cgroup = cgroup if cgroup is not None or not find else find_memory_cgroup()
        self._seen = self._count()

    def _count(self) -> int:
        if self.cgroup is None:
            return 0
        return self.cgroup.oom_kills() or 0

    def new_kills(self) -> int:
        """How many processes the OOM killer took since the last call (0 or more)."""
        now = self._count()
        new, self._seen = max(0, now - self._seen), max(now, self._seen)
        return new

    def error_for(self, sig: int | None) -> ErrorInfo | None:
        """What to report for a worker that died of signal ``sig`` (None: it exited) when
        nothing better is known: the OOM killer, with the limit, if it was its SIGKILL (the
        counter grew since the last look); else None."""
        if sig != signal.SIGKILL or not self.new_kills():
            return None
        return {"message": self.describe(), "traceback": None, "timestamp": int(time.time())}

    def describe(self) -> str:
        """The cause to report: the OOM killer, with the limit when there is one."""
        limit = self.cgroup.limit_bytes() if self.cgroup is not None else None
        if limit is None:
            return "killed by the OOM killer (out of memory; no memory limit on its container)"
        return f"killed by the OOM killer: its container's memory limit is {_mib(limit)}"


def _mib(n: int) -> str:
    return f"{n / (1 << 30):g} GiB" if n % (1 << 30) == 0 else f"{n / (1 << 20):.0f} MiB"
