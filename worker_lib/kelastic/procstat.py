"""``/proc/<pid>/stat`` read once for the project: a process's state letter and its start
time (proc(5)), read by the sidecar's timer server (a hung worker's state, a reused pid
told apart) and its hang evidence (a stopped worker is not asked for its flight record).
Stdlib only, in the worker library so that any package may read it without a cycle."""

from __future__ import annotations

__all__ = ["process_stat"]


def process_stat(pid: int | str) -> tuple[str, int] | None:
    """``(state, start time in clock ticks since boot)`` of ``pid`` from
    ``/proc/<pid>/stat`` (proc(5): fields 3 and 22, counted after the name, which may hold
    spaces and parentheses); None when gone or unreadable. The start time tells a reused
    pid from the process first seen under it. ``pid`` may be ``"self"``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fp:
            stat = fp.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return fields[0].decode(errors="replace"), int(fields[19])
    except (IndexError, ValueError):
        return None
