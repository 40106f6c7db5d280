"""Reading ``py-spy dump``'s text: the threads, their frames, and the one-line summary of
where a hung rank's main thread was (plain functions, no processes).

The format is py-spy 0.4's ``dump`` output (``src/dump.rs``), read leniently: a header
(``Process <pid>: <cmdline>``, ``Python v3.x (<exe>)``), then per thread a line
``Thread <id> (<status>): "<name>"`` (the name part optional) followed by its frames,
innermost first, each indented ``<function> (<file>:<line>)`` (``<file>`` alone when
the line is unknown). Anything else (``--locals`` blocks, native frames' oddities, error
text) is skipped, never an error: a dump that does not parse gives no summary.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Frame",
    "ThreadStack",
    "innermost_user_frame",
    "is_library_file",
    "main_thread",
    "parse_dump",
    "summary",
    "truncate",
]

_THREAD = re.compile(r'^Thread\s+(?P<id>\S+)\s+\((?P<status>[^)]*)\)(?::\s*"(?P<name>.*)")?\s*$')
_FRAME = re.compile(r"^\s+(?P<func>\S.*?)\s+\((?P<file>[^()]*?)(?::(?P<line>\d+))?\)\s*$")
#: Paths of the interpreter's and installed packages' files.
_LIBRARY = re.compile(r"(/(site|dist)-packages/|/lib/python\d+(\.\d+)?t?/|^<)")


@dataclass(frozen=True)
class Frame:
    """One Python frame: ``function`` in ``file`` at ``line`` (None when py-spy did not
    know it)."""

    function: str
    file: str
    line: int | None

    def where(self) -> str:
        """``file:line in function`` (``file in function`` without a line)."""
        at = self.file if self.line is None else f"{self.file}:{self.line}"
        return f"{at} in {self.function}"


@dataclass(frozen=True)
class ThreadStack:
    """One thread of a dump: py-spy's thread id (the native id, e.g. ``2106``, or a
    hex address), its status (``idle``, ``active``, ``active+gil``...), its name
    (``""`` when none) and its frames, innermost first."""

    thread_id: str
    status: str
    name: str
    frames: tuple[Frame, ...]


def parse_dump(text: str) -> list[ThreadStack]:
    """The threads of ``py-spy dump``'s output ``text``, in its order (see the module
    doc); lines that are no thread header or frame are skipped."""
    threads: list[ThreadStack] = []
    header: re.Match[str] | None = None
    frames: list[Frame] = []

    def close() -> None:
        if header is not None:
            threads.append(
                ThreadStack(header["id"], header["status"], header["name"] or "", tuple(frames))
            )

    for raw in text.splitlines():
        line = raw.rstrip("\r")
        thread = _THREAD.match(line)
        if thread is not None:
            close()
            header, frames = thread, []
            continue
        frame = _FRAME.match(line)
        if frame is not None and header is not None:
            number = frame["line"]
            frames.append(Frame(frame["func"], frame["file"], int(number) if number else None))
    close()
    return threads


def main_thread(threads: Sequence[ThreadStack], pid: int) -> ThreadStack | None:
    """The main thread of the process ``pid``: the one named ``MainThread``, else the
    one whose id is the pid (Linux: the main thread's native id), else the first; None
    when there are no threads."""
    for thread in threads:
        if thread.name == "MainThread":
            return thread
    for thread in threads:
        if thread.thread_id == str(pid):
            return thread
    return threads[0] if threads else None


def is_library_file(path: str, library_dirs: Sequence[str] = ()) -> bool:
    """Whether ``path`` is the interpreter's or an installed package's (``site-packages``,
    ``dist-packages``, ``lib/pythonX.Y``, ``<frozen ...>``), or under one of
    ``library_dirs`` (e.g. kelastic's own worker library), rather than the user's."""
    if _LIBRARY.search(path):
        return True
    return any(path.startswith(d.rstrip("/") + "/") for d in library_dirs if d)


def innermost_user_frame(thread: ThreadStack, library_dirs: Sequence[str] = ()) -> Frame | None:
    """The innermost frame of ``thread`` in the user's code (:func:`is_library_file`
    false), else its innermost frame; None when it has no frames."""
    for frame in thread.frames:
        if not is_library_file(frame.file, library_dirs):
            return frame
    return thread.frames[0] if thread.frames else None


def summary(text: str, pid: int, library_dirs: Sequence[str] = ()) -> str | None:
    """One line naming where ``pid``'s main thread was in the dump ``text``: ``main
    thread at <file>:<line> in <function>`` (its innermost user frame); None when the
    dump holds no frame of it."""
    thread = main_thread(parse_dump(text), pid)
    frame = innermost_user_frame(thread, library_dirs) if thread is not None else None
    if frame is None:
        return None
    return f"main thread at {_one_line(frame.where())}"


#: Appended to a text cut by :func:`truncate`.
TRUNCATED = "\n[... truncated by kelastic: the dump was longer than {limit} bytes]\n"


def truncate(text: str, limit: int) -> str:
    """``text`` cut so that its UTF-8 encoding, marker included, is at most ``limit``
    bytes (a marker saying so at the end); ``text`` itself when it fits.

    Raises:
        ValueError: ``limit`` leaves no room for the marker.
    """
    marker = TRUNCATED.format(limit=limit)
    room = limit - len(marker.encode())
    if room < 0:
        raise ValueError(f"limit {limit} bytes is smaller than the truncation marker")
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[:room].decode(errors="ignore") + marker


def _one_line(text: str) -> str:
    return " ".join(text.split())
