"""Run dirs of ``kelastic run``: who owns one, and cleaning those a killed run left.

Each run dir holds ``owner.json``: the pid of the ``kelastic run`` process and that
process's start time (``/proc/<pid>/stat`` field 22, clock ticks since boot), so a pid
reused by another process is not mistaken for the owner. A run that ends (succeeded,
failed or interrupted) removes its embedded etcd's data and marks the dir ``ended``; a run
killed with SIGKILL cannot, and the next ``kelastic run`` with the same parent folder
removes the etcd data of every dir whose owner is gone (:func:`clean_stale`). Logs stay.
A dir whose owner still runs is never touched.

Processes started by a run are tied to it (``die_with_parent`` of
:func:`~kelastic_operator.local.containers.start_process` and
:class:`~kelastic_operator.local.etcd.EmbeddedEtcd`: ``PR_SET_PDEATHSIG=SIGKILL``), so
nothing of a killed run trains on.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

#: The ownership record in each run dir.
OWNER_FILE = "owner.json"
#: The embedded etcd's data dir inside a run dir.
ETCD_DATA_DIR = "etcd"


def process_start_time(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot; None when it is gone.

    Linux only (``/proc``); returns None elsewhere.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its ")".
    fields = stat.rpartition(")")[2].split()
    try:
        return int(fields[19])  # field 22 of the whole line
    except (IndexError, ValueError):
        return None


def write_owner(run_dir: Path, pid: int | None = None) -> None:
    """Mark ``run_dir`` as owned by the live process ``pid`` (default: this one).

    Raises:
        OSError: the file cannot be written.
    """
    pid = os.getpid() if pid is None else pid
    doc = {"pid": pid, "start_time": process_start_time(pid), "ended": False}
    tmp = run_dir / f".{OWNER_FILE}.tmp"
    tmp.write_text(json.dumps(doc))
    tmp.replace(run_dir / OWNER_FILE)


def mark_ended(run_dir: Path) -> None:
    """Record that the run owning ``run_dir`` ended and cleaned up (best effort)."""
    with contextlib.suppress(OSError, ValueError):
        doc = json.loads((run_dir / OWNER_FILE).read_text())
        doc["ended"] = True
        (run_dir / OWNER_FILE).write_text(json.dumps(doc))


def is_stale(run_dir: Path) -> bool:
    """True when ``run_dir`` has an owner record, did not end, and its owner is gone
    (no such pid, or a pid now used by a process started at another time)."""
    try:
        doc = json.loads((run_dir / OWNER_FILE).read_text())
        pid, started, ended = int(doc["pid"]), doc.get("start_time"), bool(doc.get("ended"))
    except (OSError, ValueError, KeyError, TypeError):
        return False  # not ours, or unreadable: leave it alone
    if ended:
        return False
    now = process_start_time(pid)
    return now is None or (started is not None and now != started)


@dataclass(frozen=True)
class Cleaned:
    """One stale run dir cleaned by :func:`clean_stale`.

    Attributes:
        run_dir: the run dir (its logs are kept).
        freed_bytes: bytes of etcd data removed.
    """

    run_dir: Path
    freed_bytes: int


def _size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += (Path(root) / name).lstat().st_size
    return total


def clean_stale(parent: Path) -> list[Cleaned]:
    """Remove the etcd data of the run dirs under ``parent`` whose owner is gone.

    Only direct subfolders with an :data:`OWNER_FILE` are considered; each cleaned dir
    is marked ended. Errors on one dir do not stop the others.

    Returns:
        What was cleaned, in name order.
    """
    cleaned: list[Cleaned] = []
    with contextlib.suppress(OSError):
        candidates = sorted(p for p in parent.iterdir() if p.is_dir())
        for run_dir in candidates:
            if not is_stale(run_dir):
                continue
            data = run_dir / ETCD_DATA_DIR
            freed = _size(data) if data.exists() else 0
            shutil.rmtree(data, ignore_errors=True)
            mark_ended(run_dir)
            cleaned.append(Cleaned(run_dir, freed))
    return cleaned
