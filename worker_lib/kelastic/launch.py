"""``python -m kelastic.launch [options] -- cmd args...``: the in-container worker launcher.

The launcher wraps the trainer container's command. It connects to the sidecar's
control socket (``contract.control_socket_path``), says ``hello``, and then does what
the sidecar's supervisor asks:

- ``assign``: start one process per assigned local rank, with the supervisor's env plus
  ``TORCHELASTIC_ERROR_FILE``/``TORCHELASTIC_TIMER_FILE``, logs under
  ``logs/attempt_<n>/<local_rank>/`` teed to the launcher's stdout/stderr; reply
  ``started`` with the pids, then one ``exited`` per worker that ends on its own;
- ``stop``: SIGTERM the workers' process groups, SIGKILL after the grace period, reap,
  reply ``stopped``;
- ``shutdown``: stop, write the summary to the termination log, exit with the code given.

With ``--warm-start`` the workers are forked by a zygote process that imported torch
(and DDP's lazy imports) while the node joined the rendezvous, instead of starting a
new interpreter each attempt; see :mod:`kelastic._warm`. Anything that keeps a command
from starting warm is logged and the workers start cold. Cold and warm starts are two
strategies of one interface (:mod:`kelastic._starters`).

If the sidecar goes away or sends a malformed message, or the launcher gets
SIGTERM/SIGINT/SIGHUP/SIGQUIT, it stops the workers, writes a summary to the termination
log and exits (1, or 128+signum). Worker semantics follow torch elastic's
``SubprocessContext`` (``torch/distributed/elastic/multiprocessing/api.py``); see
:mod:`kelastic._workers`. The control messages, both directions, are typed and
defined once in :mod:`kelastic.control_messages`. Stdlib only; Linux.

Over ~400 lines as one cohesive thing: the public entry point (CLI, :class:`LaunchConfig`,
:func:`main`) and the :class:`Launcher` control loop it runs; the parts that stand on
their own live in ``_control``, ``_starters``, ``_workers`` and ``_warm``.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import select
import selectors
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from kelastic import contract
from kelastic._checker import Checker
from kelastic._control import LineBuffer
from kelastic._oom import OomWatch
from kelastic._spares import SpareKeeper
from kelastic._starters import ColdStart, WorkerStarter, make_starter
from kelastic._warm import DEFAULT_PRELOAD
from kelastic._workers import (
    Worker,
    WorkerGroup,
    WorkerSpec,
    become_subreaper,
    reap_children,
)
from kelastic.control_messages import (
    Assign,
    Check,
    Exited,
    Hello,
    LauncherMessage,
    Message,
    Promote,
    ProtocolError,
    Respawn,
    Shutdown,
    Started,
    Stop,
    Stopped,
    encode_message,
    parse_message,
)
from kelastic.errors import ErrorInfo, read_error_file
from kelastic.preflight import Preflight, PreflightError, check_node, decode_preflight
from kelastic.sockaddr import unix_address

__all__ = ["LaunchConfig", "Launcher", "main", "write_termination_log"]

logger = logging.getLogger("kelastic.launch")

#: Signals that make the launcher stop its workers and exit with 128+signum (torch's
#: agent handles the same set by default: ``TORCHELASTIC_SIGNALS_TO_HANDLE``).
TERMINATE_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
#: Seconds a send to the sidecar may block before the sidecar is considered gone.
SEND_TIMEOUT = 30.0
#: Seconds to wait for a finished worker's pipes to drain before reporting its exit.
OUTPUT_DRAIN_TIMEOUT = 2.0
#: Caps on the error text forwarded in an ``exited`` message (characters).
MAX_ERROR_MESSAGE_CHARS = 8 * 1024
MAX_TRACEBACK_CHARS = 64 * 1024


class _Exit(Exception):
    """Unwind to :meth:`Launcher.run`: stop the workers, write ``summary``, exit ``code``."""

    def __init__(
        self, code: int, summary: str, level: int = logging.ERROR, log: str | None = None
    ) -> None:
        super().__init__(summary)
        self.code = code
        self.summary = summary
        self.level = level
        #: What to log (default: the summary's first line; "" logs nothing).
        self.log = summary.split("\n", 1)[0] if log is None else log


class _SignalPipe:
    """Turns signals into bytes on a pipe (``signal.set_wakeup_fd``) for ``select``.

    The Python-level handlers do nothing: the C handler writes the signal number to the
    pipe, and the main loop reads it. Must be used from the main thread.
    """

    HANDLED = (signal.SIGCHLD, *TERMINATE_SIGNALS)

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._old_fd = -1
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _SignalPipe:
        self._old_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        for sig in self.HANDLED:
            self._old[sig] = signal.signal(sig, self._noop)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._old_fd)
        os.close(self._r)
        os.close(self._w)

    @staticmethod
    def _noop(signum: int, frame: FrameType | None) -> None:
        pass

    def fileno(self) -> int:
        """The read end, readable when a signal arrived."""
        return self._r

    def drain(self) -> list[int]:
        """The numbers of the signals received since the last call, in order."""
        out: list[int] = []
        while True:
            try:
                data = os.read(self._r, 512)
            except BlockingIOError:
                return out
            if not data:
                return out
            out.extend(data)


def _truncate_utf8(text: str, max_bytes: int) -> bytes:
    data = text.encode("utf-8", errors="replace")
    if len(data) <= max_bytes:
        return data
    # Cut, then drop a multi-byte character the cut split.
    return data[:max_bytes].decode("utf-8", errors="ignore").encode("utf-8")


def write_termination_log(summary: str) -> None:
    """Write ``summary`` to the container's termination message file.

    The path is :func:`kelastic.contract.termination_log_path`. The text is cut to
    ``contract.TERMINATION_MESSAGE_MAX_BYTES`` bytes without splitting a UTF-8
    character (Kubernetes truncates at 4096 bytes). When ``$KELASTIC_TERMINATION_LOG``
    is unset and the default ``/dev/termination-log`` does not exist (not in a Pod),
    nothing is written. Never raises: an unwritable path is logged as a warning.
    """
    path = contract.termination_log_path()
    if contract.ENV_TERMINATION_LOG not in os.environ and not path.exists():
        logger.debug("no termination log at %s (not in a Pod?): not written", path)
        return
    try:
        path.write_bytes(_truncate_utf8(summary, contract.TERMINATION_MESSAGE_MAX_BYTES))
    except OSError as e:
        logger.warning("cannot write the termination message to %s: %s", path, e)


@dataclass
class LaunchConfig:
    """The launcher's settings (see ``python -m kelastic.launch --help``).

    Attributes:
        cmd: the worker command line (program and arguments).
        nproc: workers per node, announced in ``hello``.
        run_dir: the shared run directory (control socket, logs, timer FIFO).
        stop_grace: seconds between SIGTERM and SIGKILL when stopping workers.
        connect_timeout: seconds to keep retrying the connection to the sidecar.
        warm_start: fork the workers from a zygote that preloaded ``preload``.
        preload: modules the zygote imports (warm start).
        warm_start_timeout: seconds an assignment waits for the zygote's preload before
            its workers start cold.
        preflight: the node's check, run before ``hello`` (``$KELASTIC_PREFLIGHT``,
            :mod:`kelastic.preflight`); None: none.
    """

    cmd: list[str]
    nproc: int
    run_dir: Path
    stop_grace: float
    connect_timeout: float
    warm_start: bool = False
    preload: tuple[str, ...] = DEFAULT_PRELOAD
    warm_start_timeout: float = 600.0
    preflight: Preflight | None = None


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _describe_exit(worker: Worker) -> str:
    if worker.signal is not None:
        return f"was killed by {_signal_name(worker.signal)} ({worker.signal})"
    return f"exited with code {worker.exitcode}"


def _describe_failure(attempt: int, worker: Worker, error: ErrorInfo | None) -> str:
    """A failed worker for the termination log: who, how it ended, its error, its last
    stderr lines."""
    spec = worker.spec
    lines = [
        f"rank {spec.label} (local_rank {spec.local_rank}, pid {worker.pid}, "
        f"attempt {attempt}) {_describe_exit(worker)}"
    ]
    if error is not None:
        lines.append(error["message"])
    tail = list(worker.tail)[-10:]
    if tail:
        lines.append("last stderr lines:")
        lines.extend(tail)
    return "\n".join(lines)


def _cap_error(error: ErrorInfo | None) -> ErrorInfo | None:
    if error is None:
        return None
    message = error["message"]
    if len(message) > MAX_ERROR_MESSAGE_CHARS:
        message = message[:MAX_ERROR_MESSAGE_CHARS] + "...[truncated]"
    tb = error["traceback"]
    if tb is not None and len(tb) > MAX_TRACEBACK_CHARS:
        tb = "[truncated]..." + tb[-MAX_TRACEBACK_CHARS:]
    capped: ErrorInfo = {"message": message, "traceback": tb, "timestamp": error["timestamp"]}
    if "fault_time" in error:
        capped["fault_time"] = error["fault_time"]
    return capped


def connect_to_sidecar(
    run_dir: Path, timeout: float, wait: Callable[[float], None]
) -> socket.socket:
    """Connect to the sidecar's control socket in ``run_dir``, trying again (with backoff,
    at most 0.5 s apart, calling ``wait(seconds)`` in between) for up to ``timeout``
    seconds; the socket returned has the send timeout set.

    Raises:
        _Exit: the path is too long for a Unix socket, or no connection within
            ``timeout`` (the message says what to check); whatever ``wait`` raises.
    """
    path = contract.control_socket_path(run_dir)
    deadline = time.monotonic() + timeout
    delay = 0.05
    last_error = "no socket"
    logger.info("connecting to the sidecar at %s", path)
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # A full listen backlog makes connect() block: bound each try.
        sock.settimeout(min(5.0, max(0.1, deadline - time.monotonic())))
        try:
            with unix_address(path) as address:
                sock.connect(address)
        except OSError as e:
            sock.close()
            if e.errno == errno.ENAMETOOLONG or "too long" in str(e):
                raise _Exit(
                    1, f"kelastic launcher: cannot use control socket path {path}: {e}"
                ) from None
            last_error = f"{type(e).__name__}: {e}"
        else:
            sock.settimeout(SEND_TIMEOUT)
            logger.info("connected to the sidecar")
            return sock
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Exit(
                1,
                f"kelastic launcher: the sidecar's control socket {path} did not accept a "
                f"connection within {timeout:g}s (last error: {last_error}). Is the kelastic "
                f"sidecar running in this pod and sharing the {contract.RUN_VOLUME_NAME} "
                f"volume at {run_dir}?",
            )
        wait(min(delay, left))
        delay = min(delay * 2, 0.5)


class Launcher:
    """The control loop: one connection to the sidecar, one worker group at a time.

    Args:
        config: the settings.
    """

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self._sock: socket.socket | None = None
        self._signals = _SignalPipe()
        self._oom = OomWatch()
        self._group: WorkerGroup | None = None
        self._term_signal: int | None = None
        self._hurry = False
        #: One-paragraph description of the first failure of the latest failed attempt.
        self._root_cause: str | None = None
        self._root_cause_attempt: int | None = None
        #: How workers start (cold, or warm from a zygote): set by :meth:`run`.
        self._starter: WorkerStarter = ColdStart()
        self._spares = SpareKeeper(config.cmd)  # in-process restart's spare ranks
        #: the round's network check (kelastic.netcheck), started ahead when the job has one
        self._checker = Checker(bool(os.environ.get(contract.ENV_NETCHECK)))

    # ------------------------------------------------------------------ entry point
    def run(self) -> int:
        """Connect, serve the sidecar until told to exit, and return the exit code.

        Never raises (an internal error stops the workers and returns 1).
        """
        with self._signals:
            subreaper = become_subreaper()
            self._starter = make_starter(
                self.config.warm_start,
                subreaper,
                self.config.cmd,
                self.config.preload,
                os.environ,
                self.config.warm_start_timeout,
            )
            try:
                try:
                    failed = check_node(self.config.preflight)  # before the node joins a round
                    self._connect()
                    self._send(Hello(os.getpid(), self.config.nproc, failed, netcheck=True))
                    self._checker.prestart(os.environ)  # its import overlaps the rendezvous
                    self._loop()
                except _Exit as e:
                    return self._finish(e)
                except Exception as e:
                    logger.exception("launcher internal error")
                    crash = f"kelastic launcher crashed: {type(e).__name__}: {e}"
                    return self._finish(_Exit(1, self._summary(crash)))
            finally:
                if self._sock is not None:
                    self._sock.close()
        raise AssertionError("unreachable")  # pragma: no cover

    def _finish(self, exit_: _Exit) -> int:
        if exit_.log:
            logger.log(exit_.level, "%s", exit_.log)
        group = self._group
        if group is not None and not group.stopped:
            self._reap()
            group.terminate(self.config.stop_grace, self._wait_during_stop)
        self._checker.close()
        self._starter.close()
        self._reap()
        write_termination_log(exit_.summary)
        logger.info("exiting with code %d", exit_.code)
        return exit_.code

    # --------------------------------------------------------------------- connect
    def _connect(self) -> None:
        def wait(seconds: float) -> None:  # signals and reaping go on meanwhile
            select.select([self._signals], [], [], seconds)
            self._on_wake()

        self._sock = connect_to_sidecar(self.config.run_dir, self.config.connect_timeout, wait)

    # ------------------------------------------------------------------ main loop
    def _loop(self) -> None:
        assert self._sock is not None
        sock = self._sock
        lines = LineBuffer()
        with selectors.DefaultSelector() as sel:
            sel.register(self._signals, selectors.EVENT_READ)
            sel.register(sock, selectors.EVENT_READ)
            while True:
                self._checker.watch(sel)  # its output, while a network check runs
                events = sel.select(timeout=1.0)
                self._on_signals(self._signals.drain())
                self._reap()
                self._report_exits()
                self._spares.tend(self._group, self._starter.spawner())
                if self._term_signal is not None:
                    raise self._signal_exit()
                ready = {key.fileobj for key, _ in events}
                if (checked := self._checker.answer(ready)) is not None:
                    self._send(checked)
                if sock not in ready:
                    continue
                try:
                    data = sock.recv(65536)
                except OSError as e:
                    raise _Exit(
                        1,
                        self._summary(
                            f"kelastic launcher: lost the connection to the sidecar: {e}; "
                            "workers stopped"
                        ),
                    ) from None
                if not data:
                    if lines.pending:
                        logger.warning(
                            "the sidecar closed the connection in the middle of a message"
                        )
                    raise _Exit(
                        1,
                        self._summary(
                            "kelastic launcher: the sidecar closed the control connection "
                            "(sidecar died?); workers stopped"
                        ),
                    )
                try:
                    for line in lines.feed(data):
                        self._dispatch(parse_message(line))
                except ProtocolError as e:
                    raise _Exit(
                        1,
                        self._summary(
                            f"kelastic launcher: malformed control message from the sidecar: {e}; "
                            "workers stopped"
                        ),
                    ) from None
                if self._term_signal is not None:
                    raise self._signal_exit()

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, Assign):
            self._on_assign(msg)
        elif isinstance(msg, Stop):
            self._on_stop(msg)
            self._checker.prestart(os.environ)  # for the next round's check
        elif isinstance(msg, Check):
            answer = self._checker.begin(msg, os.environ)
            if answer is not None:
                self._send(answer)
        elif isinstance(msg, Respawn):
            self._on_respawn(msg)
        elif isinstance(msg, Promote):
            self._reap()
            self._report_exits()  # the dead worker's exit goes out first
            self._spares.promote(self._group, msg, self._send, self._starter.spawner())
            self._report_exits()  # a spare that died since its go: the rank's exit
        elif isinstance(msg, Shutdown):
            summary = msg.summary or self._summary(
                f"kelastic launcher: shutdown by the sidecar with exit code {msg.exitcode}"
            )
            raise _Exit(
                msg.exitcode,
                summary,
                level=logging.INFO,
                log=f"shutdown requested by the sidecar (exit code {msg.exitcode})",
            )
        else:
            logger.warning("ignoring control message of unknown type %r (newer sidecar?)", msg.type)

    # ------------------------------------------------------------------- messages
    def _on_assign(self, msg: Assign) -> None:
        old = self._group
        if old is not None and not old.stopped:
            self._report_exits()
            was_running = old.any_running
            if was_running:
                logger.warning(
                    "assign for attempt %d while attempt %d is running: stopping it first",
                    msg.attempt,
                    old.attempt,
                )
            old.terminate(self.config.stop_grace, self._wait_during_stop)
            if was_running:
                self._send(Stopped(attempt=old.attempt))
        logger.info(
            "attempt %d (round %d): starting %d workers", msg.attempt, msg.round, len(msg.workers)
        )
        if len(msg.workers) != self.config.nproc:
            logger.warning(
                "assign has %d workers, nproc is %d", len(msg.workers), self.config.nproc
            )
        base = dict(os.environ)
        timer_file = str(contract.timer_fifo_path(self.config.run_dir))
        specs = []
        for entry in msg.workers:
            log_dir = contract.worker_log_dir(msg.attempt, entry.local_rank, self.config.run_dir)
            env = {
                **base,
                contract.LOCAL_RANK: str(entry.local_rank),
                contract.TORCHELASTIC_ERROR_FILE: str(log_dir / contract.ERROR_FILE_NAME),
                contract.TORCHELASTIC_TIMER_FILE: timer_file,
                contract.KELASTIC_ROUND: str(msg.round),
                **entry.env,
            }
            label = entry.env.get(contract.RANK) or str(entry.local_rank)
            specs.append(WorkerSpec(entry.local_rank, label, env, log_dir))
        self._starter.prepare(self._signals.fileno(), self._on_wake)
        group = WorkerGroup(msg.attempt, specs, self._starter.keep())
        self._group = group
        group.start(self.config.cmd, self._starter.spawner())
        self._send(
            Started(
                attempt=msg.attempt,
                pids=dict(group.pids),
                warm=sum(1 for w in group.workers.values() if w.warm),
            )
        )
        self._report_exits()  # workers that failed to start
        self._spares.start(group, msg.spares, specs, self._starter.spawner())

    def _on_respawn(self, msg: Respawn) -> None:
        """Start one exited worker of the running attempt again (its peers restart in
        process); answered by ``started`` with its pid, or ``exited`` if it cannot start."""
        group = self._group
        if group is None or group.attempt != msg.attempt or group.stopping or group.stopped:
            logger.warning("respawn of local_rank %d for attempt %d ignored: not running",
                           msg.local_rank, msg.attempt)  # fmt: skip
            return
        self._report_exits()  # the dead worker's exit goes out first
        old = group.workers.get(msg.local_rank)
        if old is None or old.running:
            logger.warning("respawn of local_rank %d ignored: %s", msg.local_rank,
                           "no such worker" if old is None else "it still runs")  # fmt: skip
            return
        spec = WorkerSpec(
            old.spec.local_rank, msg.env.get(contract.RANK) or old.spec.label,
            {**old.spec.env, **msg.env}, old.spec.log_dir,
        )  # fmt: skip
        self._starter.prepare(self._signals.fileno(), self._on_wake)
        worker = group.respawn(spec, self.config.cmd, self._starter.spawner())
        if worker.pid is not None:
            self._send(Started(attempt=group.attempt, pids={spec.local_rank: worker.pid},
                               warm=1 if worker.warm else 0))  # fmt: skip
        self._report_exits()  # it could not start

    def _on_stop(self, msg: Stop) -> None:
        group = self._group
        if group is None or group.attempt != msg.attempt:
            if group is not None and group.any_running:
                logger.warning(
                    "stop for attempt %d but attempt %d is running: ignored",
                    msg.attempt,
                    group.attempt,
                )
            self._send(Stopped(attempt=msg.attempt))
            return
        if not group.stopped:
            self._report_exits()  # exits that happened before the stop are real failures
            logger.info("attempt %d: stop requested: %s", msg.attempt, msg.reason or "(no reason)")
            group.terminate(self.config.stop_grace, self._wait_during_stop)
            logger.info("attempt %d: all workers stopped", msg.attempt)
        self._send(Stopped(attempt=msg.attempt))

    def _report_exits(self) -> None:
        group = self._group
        if group is None:
            return
        for worker in group.unreported_exits():
            worker.wait_output(OUTPUT_DRAIN_TIMEOUT)
            if worker.spawn_error is not None:
                error: ErrorInfo | None = {
                    "message": worker.spawn_error,
                    "traceback": None,
                    "timestamp": int(time.time()),
                }
            else:
                error = _cap_error(read_error_file(worker.spec.error_file))
            oom = self._oom.error_for(worker.signal) if error is None else None
            error = error or oom
            spec = worker.spec
            failed = worker.returncode != 0
            logger.log(
                logging.ERROR if failed else logging.INFO,
                "attempt %d: local_rank %d (rank %s, pid %s) %s%s",
                group.attempt,
                spec.local_rank,
                spec.label,
                worker.pid,
                _describe_exit(worker),
                f": {error['message']}" if error else "",
            )
            if failed and self._root_cause_attempt != group.attempt:
                self._root_cause_attempt = group.attempt
                self._root_cause = _describe_failure(group.attempt, worker, error)
            message = Exited(
                attempt=group.attempt,
                local_rank=spec.local_rank,
                pid=worker.pid,
                exitcode=worker.exitcode,
                signal=worker.signal,
                error=dict(error) if error is not None else None,
                tail=tuple(worker.tail),
                oom=oom is not None,
            )
            worker.reported = True
            self._send(message)

    def _summary(self, headline: str) -> str:
        if self._root_cause is None:
            return headline
        return f"{headline}\nfirst worker failure: {self._root_cause}"

    # -------------------------------------------------------------------- helpers
    def _send(self, msg: LauncherMessage) -> None:
        assert self._sock is not None
        obj = msg.as_dict()
        try:
            data = encode_message(obj)
        except ValueError as e:  # too long: drop the bulky parts
            logger.warning("%s", e)
            obj = {**obj, "tail": []}
            if obj.get("error"):
                obj["error"] = {**obj["error"], "traceback": None}
            data = encode_message(obj)
        try:
            self._sock.sendall(data)
        except OSError as e:
            raise _Exit(
                1,
                self._summary(
                    "kelastic launcher: lost the connection to the sidecar while sending "
                    f"{obj.get('type')!r}: {e}; workers stopped"
                ),
            ) from None

    def _reap(self) -> None:
        group = self._group
        for pid, returncode in reap_children():
            worker = group.by_pid(pid) if group is not None else None
            if worker is not None:
                worker.set_reaped(returncode)
            elif self._checker.on_reaped(pid, returncode):
                continue
            elif not self._starter.on_reaped(pid, returncode):
                logger.debug("reaped descendant %d (returncode %d)", pid, returncode)

    def _on_signals(self, signums: Sequence[int]) -> None:
        for num in signums:
            if num == signal.SIGCHLD:
                continue
            if self._term_signal is None:
                self._term_signal = num
                logger.warning("received %s: stopping the workers and exiting", _signal_name(num))
            elif not self._hurry:
                self._hurry = True
                logger.warning("received %s again: killing the workers now", _signal_name(num))

    def _on_wake(self) -> None:
        """Handle signals and reap while waiting for the starter; raise to stop."""
        self._on_signals(self._signals.drain())
        self._reap()
        if self._term_signal is not None:
            raise self._signal_exit()

    def _wait_during_stop(self, timeout: float) -> bool:
        select.select([self._signals], [], [], timeout)
        self._on_signals(self._signals.drain())
        self._reap()
        return self._hurry

    def _signal_exit(self) -> _Exit:
        assert self._term_signal is not None
        name = _signal_name(self._term_signal)
        group = self._group
        what = f"; stopped the workers of attempt {group.attempt}" if group is not None else ""
        return _Exit(
            128 + self._term_signal,
            self._summary(f"kelastic launcher: received {name}{what}"),
            log="",  # already logged when the signal arrived
        )


# ------------------------------------------------------------------------- CLI
def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0: {text!r}")
    return value


def _pos_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return value


def _module_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    for name in names:
        if not re.match(contract.MODULE_NAME_PATTERN, name):
            raise argparse.ArgumentTypeError(f"not a module name: {name!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m kelastic.launch`` (options before ``--``)."""
    parser = argparse.ArgumentParser(
        prog="python -m kelastic.launch",
        usage="%(prog)s [options] -- cmd [args ...]",
        description=(
            "Start and supervise this node's training workers for the kelastic sidecar. "
            "Connects to the sidecar's control socket, starts one `cmd args...` process per "
            "assigned local rank with torch elastic's env (RANK, WORLD_SIZE, MASTER_ADDR, "
            "..., TORCHELASTIC_ERROR_FILE), writes their output to "
            "logs/attempt_<n>/<local_rank>/{stdout,stderr}.log in the run dir and to this "
            "process's stdout/stderr prefixed with '[<rank>]: ', reports exits to the "
            "sidecar and stops the workers when asked."
        ),
        epilog=(
            "Exit status: the code the sidecar's shutdown gives; 1 if the sidecar never "
            "answers, goes away or misbehaves; 128+N after signal N (SIGTERM, SIGINT, SIGHUP, "
            "SIGQUIT), which stops the workers first. A summary of the root cause goes to "
            f"${contract.ENV_TERMINATION_LOG} (default {contract.DEFAULT_TERMINATION_LOG})."
        ),
    )
    env_nproc = os.environ.get(contract.ENV_NPROC_PER_NODE)
    env_grace = os.environ.get(contract.ENV_STOP_GRACE)
    parser.add_argument(
        "--nproc-per-node",
        type=_pos_int,
        default=env_nproc or "1",
        metavar="N",
        help="workers on this node, announced to the sidecar "
        f"(default ${contract.ENV_NPROC_PER_NODE} or 1)",
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="the shared run directory "
        f"(default ${contract.ENV_RUN_DIR} or {contract.DEFAULT_RUN_DIR})",
    )
    parser.add_argument(
        "--stop-grace",
        type=_nonneg_float,
        default=env_grace or str(contract.DEFAULT_STOP_GRACE),
        metavar="SECONDS",
        help="seconds between SIGTERM and SIGKILL when stopping workers "
        f"(default ${contract.ENV_STOP_GRACE} or {contract.DEFAULT_STOP_GRACE:g})",
    )
    parser.add_argument(
        "--connect-timeout",
        type=_nonneg_float,
        default="300",
        metavar="SECONDS",
        help="how long to wait for the sidecar's control socket (default 300)",
    )
    parser.add_argument(
        "--warm-start",
        action=argparse.BooleanOptionalAction,
        default=os.environ.get(contract.ENV_WARM_START, "").lower() in ("1", "true", "yes"),
        help="fork the workers from a zygote process that imported the --preload modules "
        "once, instead of starting a new interpreter each attempt (restarts skip `import "
        "torch`); the command must be `python [-u] [-B] script|-m module|-c code ...`, "
        "else the workers start cold (default $" + contract.ENV_WARM_START + " or off)",
    )
    parser.add_argument(
        "--preload",
        type=_module_list,
        default=os.environ.get(contract.ENV_PRELOAD) or ",".join(DEFAULT_PRELOAD),
        metavar="MOD[,MOD...]",
        help="modules the warm-start zygote imports before forking workers (default $"
        + contract.ENV_PRELOAD
        + " or "
        + ",".join(DEFAULT_PRELOAD)
        + ")",
    )
    parser.add_argument(
        "--warm-start-timeout",
        type=_nonneg_float,
        default="600",
        metavar="SECONDS",
        help="how long the first workers wait for the zygote's preload before they start "
        "cold (default 600)",
    )
    parser.add_argument(
        "--log-level",
        default=os.environ.get("KELASTIC_LOG_LEVEL", "INFO").upper(),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="the launcher's own log level (default $KELASTIC_LOG_LEVEL or INFO)",
    )
    return parser


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, LaunchConfig]:
    """Parse ``[options] -- cmd args...``.

    Raises:
        SystemExit: on ``--help`` (0) or a usage error (2), via argparse.
    """
    parser = build_parser()
    argv = list(argv)
    split = argv.index("--") if "--" in argv else None
    if split is None:
        _, extra = parser.parse_known_args(argv)  # --help still works without "--"
        got = f" (got: {' '.join(extra)})" if extra else ""
        parser.error(f"missing '--' before the worker command, e.g. `-- python train.py`{got}")
    args = parser.parse_args(argv[:split])
    cmd = argv[split + 1 :]
    if not cmd:
        parser.error("no worker command after '--'")
    preflight = None
    if os.environ.get(contract.ENV_PREFLIGHT):
        try:
            preflight = decode_preflight(os.environ[contract.ENV_PREFLIGHT])
        except PreflightError as exc:
            parser.error(f"${contract.ENV_PREFLIGHT}: {exc}")
    config = LaunchConfig(
        cmd=cmd,
        nproc=args.nproc_per_node,
        run_dir=args.run_dir if args.run_dir is not None else contract.run_dir(),
        stop_grace=args.stop_grace,
        connect_timeout=args.connect_timeout,
        warm_start=args.warm_start,
        preload=args.preload,
        warm_start_timeout=args.warm_start_timeout,
        preflight=preflight,
    )
    return args, config


def main(argv: Sequence[str] | None = None) -> int:
    """Run the launcher; returns the process exit status (see ``--help``)."""
    args, config = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    return Launcher(config).run()


if __name__ == "__main__":
    sys.exit(main())
