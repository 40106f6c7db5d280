"""The disk a killed test run leaves behind, and its removal by the next run.

A run's nodes remove their containerd roots at stop (~4.5 GB each with the trainer image),
and its etcd servers their data; a run killed before its teardown (SIGKILL, a CI timeout,
a Ctrl-C pressed twice) removes neither. pytest keeps such a run's base temporary folder
(``<root>/pytest-<N>``) for three days, since its ``.lock`` (the run's pid) was never
removed; two dead runs with a node each hold ~9-17 GB, enough to fill the disk under the
next run's second node (CI on 2026-11-27: ``no space left on device`` importing the
trainer into ``kelastic-node-2``).

:func:`sweep_dead_runs` removes, from every sibling base folder whose run is dead, the
parts that weigh: the nodes' containerd roots (``node*/containerd``) and etcd members'
data (``**/member``). Logs and the rest stay for pytest's own retention to remove.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import psutil

#: pytest's numbered base folders: ``pytest-<N>``.
_BASETEMP = re.compile(r"pytest-\d+")
#: How deep below a base folder an etcd member's data lies (``<test>/data/member``, or
#: ``<test>/<node>/data/member`` for a cluster of three).
_MEMBER_DEPTH = 4
#: Linux's largest pid (``/proc/sys/kernel/pid_max`` is at most 2^22).
_PID_MAX = 1 << 22


def run_is_dead(basetemp: Path) -> bool:
    """True when ``basetemp``'s ``.lock`` names a pid that no longer runs. A folder without
    a lock (its run ended and removed it) or with one that is no pid (empty, text, beyond
    Linux's pid range) is not dead: its run either cleaned up or cannot be told apart from
    a live one."""
    try:
        text = (basetemp / ".lock").read_text().strip()
    except (OSError, UnicodeDecodeError):
        return False
    if not text.isdigit() or not 0 < int(text) <= _PID_MAX:
        return False
    return not psutil.pid_exists(int(text))


def _weighty(basetemp: Path) -> list[Path]:
    """The parts of a base folder that weigh: node containerd roots and etcd members."""
    found = [p for p in basetemp.glob("node*/containerd") if p.is_dir()]
    for top, dirs, _files in os.walk(basetemp):
        depth = len(Path(top).relative_to(basetemp).parts)
        if "member" in dirs:
            found.append(Path(top) / "member")
            dirs.remove("member")
        if depth >= _MEMBER_DEPTH - 1:
            dirs.clear()
        dirs[:] = [d for d in dirs if d != "containerd"]
    return found


def sweep_dead_runs(current: Path) -> list[Path]:
    """Remove the weighty parts of every dead run beside ``current`` (this run's base
    folder, ``tmp_path_factory.getbasetemp()``); return what was removed.

    ``current`` itself is never touched, nor a run whose pid is alive. Nothing is raised:
    a part that cannot be removed stays (``rmtree`` errors are ignored).
    """
    removed: list[Path] = []
    for sibling in sorted(current.parent.iterdir()):
        if sibling == current or not _BASETEMP.fullmatch(sibling.name) or sibling.is_symlink():
            continue
        if not sibling.is_dir() or not run_is_dead(sibling):
            continue
        for part in _weighty(sibling):
            shutil.rmtree(part, ignore_errors=True)
            removed.append(part)
    return removed
