"""Warm start, launcher side: which commands can start warm, and the zygote client.

``python -m kelastic.launch --warm-start -- python train.py`` starts one zygote
process (:mod:`kelastic._zygote`) next to the launcher; it imports the preload modules
(torch and the lazy imports of DDP by default) while the node joins the rendezvous,
and then forks every worker of every attempt, so a restart skips the interpreter start
and ``import torch``. The launcher stays the parent of the workers (the zygote
double-forks and the launcher is a child subreaper), so reaping, stopping and logs are
the same as for cold workers (:mod:`kelastic._workers`).

Warm start is best effort: a command the zygote cannot run (not a Python interpreter,
an interpreter option other than ``-u``/``-B``), a preload import that fails, a zygote
that dies or does not answer — each is logged once as a warning and the workers start
cold, never fail. Stdlib only; Linux.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kelastic import contract
from kelastic._workers import child_preexec
from kelastic._zygote import ENV_PAD, recv_message, send_message

__all__ = [
    "DEFAULT_PRELOAD",
    "PythonCommand",
    "Zygote",
    "ZygoteError",
    "parse_python_command",
]

logger = logging.getLogger("kelastic.launch")

#: Modules the zygote imports by default (see :data:`kelastic.contract.DEFAULT_PRELOAD`).
DEFAULT_PRELOAD = contract.DEFAULT_PRELOAD
#: Seconds to wait for the zygote's answer to one spawn request.
SPAWN_TIMEOUT = 30.0
#: Empty arguments and padding bytes added to the zygote's command line and environment:
#: room for a worker's ``/proc/<pid>/cmdline`` and ``environ`` (see
#: :func:`kelastic._zygote.show_as`).
ARGV_PAD = 4096
ENV_PAD_BYTES = 32 * 1024

_PYTHON_NAME = re.compile(r"python(\d+(\.\d+)*)?$")


class ZygoteError(Exception):
    """The zygote failed (import error, died, malformed or missing answer)."""


@dataclass(frozen=True)
class PythonCommand:
    """A worker command the zygote can run.

    Attributes:
        interpreter: absolute path of the Python interpreter (also runs the zygote).
        kind: ``"script"``, ``"module"`` (``-m``) or ``"code"`` (``-c``).
        target: the script path, module name or code.
        argv: the program's arguments (``sys.argv[1:]``).
        unbuffered: ``-u`` was given.
        dont_write_bytecode: ``-B`` was given.
    """

    interpreter: str
    kind: str
    target: str
    argv: tuple[str, ...]
    unbuffered: bool = False
    dont_write_bytecode: bool = False


def parse_python_command(cmd: Sequence[str], path: str | None = None) -> PythonCommand:
    """Recognise ``python [-u] [-B] (script | -m module | -c code) [args...]``.

    Args:
        cmd: the worker command line.
        path: the ``PATH`` to resolve a bare interpreter name with (default: ours).

    Returns:
        The parsed command.

    Raises:
        ValueError: with the reason the command cannot start warm (not a Python
            interpreter, an unsupported interpreter option, no program).
    """
    if not cmd:
        raise ValueError("empty command")
    program = cmd[0]
    resolved = program if os.sep in program else shutil.which(program, path=path)
    if resolved is None or not os.access(resolved, os.X_OK):
        raise ValueError(f"{program!r} is not an executable on PATH")
    same = os.path.realpath(resolved) == os.path.realpath(sys.executable)
    if not same and not _PYTHON_NAME.match(os.path.basename(resolved)):
        raise ValueError(f"{program!r} is not a Python interpreter")
    flags = {"u": False, "B": False}
    i = 1
    while i < len(cmd) and cmd[i].startswith("-") and cmd[i] != "-":
        arg = cmd[i]
        for j, letter in enumerate(arg[1:], start=1):
            if letter in flags:
                flags[letter] = True
            elif letter in "mc":
                if j + 1 < len(arg):
                    value, rest = arg[j + 1 :], i + 1
                elif i + 1 < len(cmd):
                    value, rest = cmd[i + 1], i + 2
                else:
                    raise ValueError(f"interpreter option -{letter} needs an argument")
                return PythonCommand(
                    os.path.abspath(resolved),
                    "module" if letter == "m" else "code",
                    value,
                    tuple(cmd[rest:]),
                    flags["u"],
                    flags["B"],
                )
            else:
                raise ValueError(
                    f"interpreter option {arg!r} is not supported with warm start "
                    "(only -u, -B, -m and -c are)"
                )
        i += 1
    if i >= len(cmd) or cmd[i] == "-":
        raise ValueError("no script to run (an interactive or stdin program cannot start warm)")
    return PythonCommand(
        os.path.abspath(resolved), "script", cmd[i], tuple(cmd[i + 1 :]), flags["u"], flags["B"]
    )


class Zygote:
    """The launcher's handle on one zygote process (see :mod:`kelastic._zygote`).

    Args:
        command: the worker command; its interpreter runs the zygote.
        preload: modules to import before forking.
        env: the zygote's environment (the launcher's).
        title: the worker command line as given (what ``ps`` shows for a worker).
    """

    def __init__(
        self,
        command: PythonCommand,
        preload: Sequence[str],
        env: Mapping[str, str],
        title: Sequence[str] = (),
    ) -> None:
        self.command = command
        #: The command line the workers show in ``/proc/<pid>/cmdline``.
        self.title = tuple(title)
        self.preload = tuple(preload)
        self._env = dict(env)
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.ready = False
        #: Seconds the preload took in the zygote (once ready).
        self.preload_seconds: float | None = None

    @property
    def pid(self) -> int | None:
        """The zygote's pid once started."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Start the zygote process; it preloads in the background.

        Raises:
            ZygoteError: it could not be started.
        """
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [
                    self.command.interpreter,
                    "-c",
                    "from kelastic._zygote import main; main()",
                    str(theirs.fileno()),
                    *self.preload,
                    *[""] * ARGV_PAD,
                ],
                env={**self._env, ENV_PAD: "-" * ENV_PAD_BYTES},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
                preexec_fn=functools.partial(child_preexec, os.getpid()),
            )
        except OSError as e:
            ours.close()
            raise ZygoteError(f"cannot start the zygote: {e}") from e
        finally:
            theirs.close()
        self._sock = ours
        logger.info(
            "warm start: zygote pid %d preloading %s", self._proc.pid, ", ".join(self.preload)
        )

    def wait_ready(self, timeout: float, wake_fd: int) -> bool:
        """Wait for the zygote's ``ready``, or until ``wake_fd`` is readable.

        Args:
            timeout: seconds to wait in all.
            wake_fd: return ``False`` as soon as this fd is readable (the launcher's
                signal pipe), so the caller can handle signals and call again.

        Returns:
            ``True`` once ready; ``False`` if woken by ``wake_fd`` or after ``timeout``.

        Raises:
            ZygoteError: the zygote failed to preload, exited or misbehaved.
        """
        if self.ready:
            return True
        sock = self._require()
        ready, _, _ = select.select([sock.fileno(), wake_fd], [], [], max(0.0, timeout))
        if sock.fileno() not in ready:
            return False
        msg = self._recv()
        if msg.get("type") == "failed":
            raise ZygoteError(f"the zygote could not preload: {msg.get('error')}")
        if msg.get("type") != "ready":
            raise ZygoteError(f"unexpected message from the zygote: {msg!r}")
        self.ready = True
        seconds = msg.get("seconds")
        self.preload_seconds = float(seconds) if isinstance(seconds, int | float) else None
        logger.info(
            "warm start: zygote ready (preloaded in %.1fs)", self.preload_seconds or float("nan")
        )
        return True

    def spawn(self, env: Mapping[str, str], cwd: str, stdout_fd: int, stderr_fd: int) -> int:
        """Fork one worker running :attr:`command` with ``env`` in ``cwd``.

        The zygote must be ready. The worker is a child of the launcher (reparented),
        its own session and process group leader, with ``stdout_fd``/``stderr_fd`` (the
        caller keeps and closes its copies) on fds 1 and 2 and ``/dev/null`` on 0.

        Returns:
            The worker's pid.

        Raises:
            ZygoteError: the zygote refused, died or did not answer within
                :data:`SPAWN_TIMEOUT` seconds.
        """
        sock = self._require()
        if not self.ready:
            raise ZygoteError("the zygote is not ready")
        command = self.command
        request = {
            "type": "spawn",
            "kind": command.kind,
            "target": command.target,
            "argv": list(command.argv),
            "env": dict(env),
            "cwd": cwd,
            "unbuffered": command.unbuffered or bool(env.get("PYTHONUNBUFFERED")),
            "dont_write_bytecode": command.dont_write_bytecode,
            "title": list(self.title),
        }
        try:
            send_message(sock, request, (stdout_fd, stderr_fd))
        except (OSError, ValueError) as e:
            raise ZygoteError(f"cannot send the spawn request to the zygote: {e}") from e
        ready, _, _ = select.select([sock], [], [], SPAWN_TIMEOUT)
        if not ready:
            raise ZygoteError(f"the zygote did not answer a spawn within {SPAWN_TIMEOUT:g}s")
        msg = self._recv()
        pid = msg.get("pid")
        if msg.get("type") != "spawned" or not isinstance(pid, int) or pid <= 0:
            raise ZygoteError(f"the zygote could not fork a worker: {msg.get('error', msg)!r}")
        return pid

    def close(self, reap: bool = False) -> None:
        """Stop the zygote with SIGKILL. Idempotent.

        Args:
            reap: also wait for it to exit (``waitpid`` on its pid; SIGKILL makes this
                short); otherwise the launcher's ``waitpid(-1)`` reaps it later.
        """
        proc = self._proc
        if proc is not None and proc.returncode is None:
            # killed before its socket closes: a zygote that saw the socket close first
            # could print a traceback (a send to a closed peer) before the kill lands
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if proc is not None and proc.returncode is None and reap:
            with contextlib.suppress(ChildProcessError):
                _, status = os.waitpid(proc.pid, 0)
                proc.returncode = os.waitstatus_to_exitcode(status)

    def set_reaped(self, returncode: int) -> None:
        """Record that the launcher reaped the zygote (``returncode`` as in subprocess)."""
        if self._proc is not None:
            self._proc.returncode = returncode

    def _require(self) -> socket.socket:
        if self._sock is None or (self._proc is not None and self._proc.returncode is not None):
            raise ZygoteError("the zygote is not running")
        return self._sock

    def _recv(self) -> dict[str, object]:
        sock = self._require()
        try:
            got = recv_message(sock)
        except (OSError, ValueError) as e:
            raise ZygoteError(f"bad answer from the zygote: {e}") from e
        if got is None:
            raise ZygoteError("the zygote exited")
        msg, fds = got
        for fd in fds:
            os.close(fd)
        return msg
