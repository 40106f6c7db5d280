"""``/proc/<pid>/stat`` read once for the project: a process's state letter and its start
time (proc(5)), shared by the sidecar (a hung worker's state, a reused pid told apart) and
the workers (the flight recorder's armed marker names its process by its start time)."""

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
