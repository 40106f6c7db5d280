"""The launcher's network checker: the process that runs a round's network preflight check
(:mod:`kelastic.netcheck`) on this node, a part of :class:`~kelastic.launch.Launcher`.

The checker (``python -m kelastic.netcheck``) imports torch first and then waits for one
params line on its stdin. The launcher starts it ahead of need, when it connects and when
a round ends, so that the import (a second or more) overlaps the rendezvous instead of
adding to the round; a ``check`` then only writes the line. The checker answers with one
verdict line on its stdout and exits; the launcher passes the line up unread in a
``checked`` (the sidecar decodes it: one codec, :func:`kelastic.netcheck.decode_verdict`).
No checker is left idle while the workers train: the next one starts only when the round
ends (a ``stop``) or the next ``check`` comes.

The process runs in a session of its own with the trainer's environment (its python, its
``PYTHONPATH``); past the ``check``'s timeout the session is SIGKILLed and the answer is
an ``error``. The launcher is a subreaper and reaps every child itself, so the checker's
exit status reaches this part through :meth:`Checker.on_reaped`, never ``Popen.wait``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Container, Mapping
from typing import Final

from kelastic.control_messages import MAX_CHECK_LINE, Check, Checked

__all__ = ["Checker"]

log = logging.getLogger("kelastic.launch")

#: The checker's command after the python executable.
CHECKER_ARGS: Final = ("-m", "kelastic.netcheck")
#: Most bytes read from the checker's stdout (its verdict line and a little more).
_MAX_OUTPUT: Final = MAX_CHECK_LINE + 4096


class Checker:
    """The network checker of one launcher: at most one idle (started ahead) and at most
    one running process.

    Args:
        enabled: whether the job runs the network check (``$KELASTIC_NETCHECK`` set); when
            not, :meth:`prestart` starts nothing (a ``check`` still starts one: the
            sidecar decides).
        python: the interpreter that runs ``-m kelastic.netcheck`` (the launcher's own).
    """

    def __init__(self, enabled: bool, python: str = sys.executable) -> None:
        self.enabled = enabled
        self._python = python
        self._proc: subprocess.Popen[bytes] | None = None
        self._running: Check | None = None
        self._deadline = 0.0
        self._output = bytearray()
        self._watched: int | None = None  # the fd registered by watch()

    # ----------------------------------------------------------------- lifecycle
    def prestart(self, env: Mapping[str, str]) -> None:
        """Start a checker ahead of need (when enabled and none is there). A failure to
        start is logged; the ``check`` then tries again and reports it."""
        if self.enabled and self._proc is None:
            with contextlib.suppress(OSError):
                self._spawn(env)

    def begin(self, msg: Check, env: Mapping[str, str]) -> Checked | None:
        """Give ``msg``'s params to the checker (started now if none waits). Returns the
        answer at once when there can be none later (it could not start, or a check is
        already running), else None: the answer comes from :meth:`on_readable` or
        :meth:`poll`."""
        if self._running is not None:
            return Checked(round=msg.round, error=f"round {self._running.round}'s network "
                           "check is still running")  # fmt: skip
        try:
            proc = self._proc or self._spawn(env)
            assert proc.stdin is not None
            proc.stdin.write(msg.params.encode() + b"\n")
            proc.stdin.close()
        except OSError as exc:  # it could not start, or died before reading (EPIPE)
            self.close()
            return Checked(round=msg.round, error=f"the network checker could not run: {exc}")
        self._running, self._deadline = msg, time.monotonic() + msg.timeout
        self._output.clear()
        return None

    def watch(self, sel: selectors.BaseSelector) -> None:
        """Keep the running check's stdout, and nothing of this part else, in ``sel``."""
        fd = self.fileno()
        if fd == self._watched:
            return
        if self._watched is not None:
            with contextlib.suppress(KeyError, ValueError):
                sel.unregister(self._watched)
        if fd is not None:
            sel.register(fd, selectors.EVENT_READ)
        self._watched = fd

    def answer(self, ready: Container[object]) -> Checked | None:
        """The ``checked`` to send, if any, after a select whose ready file objects are
        ``ready``: the checker's output read when it is among them; its answer once its
        output ended or its timeout passed."""
        read = self.on_readable() if self._watched is not None and self._watched in ready else None
        return read or self.poll()

    def fileno(self) -> int | None:
        """The running check's stdout (to select on), or None when no check runs."""
        proc = self._proc
        if self._running is None or proc is None or proc.stdout is None:
            return None
        return proc.stdout.fileno()

    def on_readable(self) -> Checked | None:
        """Read what the running checker wrote; its answer once its stdout ends."""
        fd = self.fileno()
        if fd is None:
            return None
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return None
        except OSError as exc:
            return self._end(error=f"cannot read the network checker's output: {exc}")
        if data:
            if len(self._output) < _MAX_OUTPUT:
                self._output += data[: _MAX_OUTPUT - len(self._output)]
            return None
        lines = [line for line in bytes(self._output).splitlines() if line.strip()]
        if not lines:
            return self._end(error="the network checker ended without a verdict "
                             f"({self._exit_text()})")  # fmt: skip
        line = lines[-1].decode("utf-8", errors="replace")
        if len(line.encode()) > MAX_CHECK_LINE:
            return self._end(error=f"the network checker's verdict is over {MAX_CHECK_LINE} "
                             "bytes")  # fmt: skip
        return self._end(verdict=line)

    def poll(self, now: float | None = None) -> Checked | None:
        """The timeout's answer when the running check is past its deadline (its session
        SIGKILLed), else None."""
        if self._running is None or (time.monotonic() if now is None else now) < self._deadline:
            return None
        timeout = self._running.timeout
        return self._end(error=f"the network check did not end within {timeout:g} s; "
                         "the checker was killed")  # fmt: skip

    def on_reaped(self, pid: int, returncode: int) -> bool:
        """The launcher reaped ``pid``: True when it was the checker (its status kept)."""
        proc = self._proc
        if proc is None or proc.pid != pid:
            return False
        proc.returncode = returncode
        if self._running is None:  # an idle checker died (its import failed?): forget it
            log.warning("the idle network checker exited with %d", returncode)
            self._close_pipes(proc)
            self._proc = None
        return True

    def close(self) -> None:
        """Kill and forget the checker, idle or running (the launcher reaps it)."""
        proc, self._proc, self._running = self._proc, None, None
        if proc is None:
            return
        if proc.returncode is None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
        self._close_pipes(proc)

    # ------------------------------------------------------------------ internal
    def _spawn(self, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [self._python, *CHECKER_ARGS],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=dict(env),
            start_new_session=True,  # killed as a session past the timeout
        )
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        self._proc = proc
        log.info("network checker started ahead (pid %d)", proc.pid)
        return proc

    def _end(self, *, verdict: str | None = None, error: str | None = None) -> Checked:
        assert self._running is not None
        answer = Checked(round=self._running.round, verdict=verdict, error=error)
        self.close()
        return answer

    def _exit_text(self) -> str:
        proc = self._proc
        code = None if proc is None else proc.returncode
        return "its exit status not yet known" if code is None else f"exit status {code}"

    @staticmethod
    def _close_pipes(proc: subprocess.Popen[bytes]) -> None:
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        if proc.returncode is None:
            proc.returncode = -signal.SIGKILL  # reaped by the launcher, not by Popen
