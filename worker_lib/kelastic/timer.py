"""Expiration timers for worker code: ``with expires(after=60): train_step()``.

Semantics from ``torch.distributed.elastic.timer`` (``configure``, ``expires``,
``FileTimerClient``): entering :func:`expires` acquires a countdown timer that expires
``after`` seconds from now; leaving it (normally or by an exception) releases it. If the
timer expires first, the worker becomes eligible to be reaped: the kelastic sidecar's
timer server sends it the client's signal (SIGKILL by default).

Requests travel over a FIFO as torch's ``FileTimerClient`` JSON lines, so torch's client
works against the kelastic server and this client against torch's wire format::

    {"version": 1, "pid": <int>, "scope_id": <str>, "expiration_time": <float>, "signal": <int>}

``expiration_time`` is in seconds since the epoch (``time.time()``); a negative value
means "release" (sent with ``signal`` 0). Each line, newline included, is at most
``select.PIPE_BUF`` bytes so that the kernel writes it atomically. In a kelastic worker
this client also sends ``"token"``: the worker's ``$KELASTIC_TIMER_TOKEN``, which lets
the sidecar refuse requests naming the worker's pid from writers that do not have it
(torch's server ignores the extra field; torch's client, which sends no token, still
works with the kelastic server: see ``kelastic_sidecar.timer``).

Unlike torch's client, :class:`FifoTimerClient` keeps the FIFO open across requests
(one ``open`` per process instead of one per request), reopens it once when the server
was restarted, and is thread- and fork-safe. Because the FIFO stays open, torch's own
``FileTimerServer`` (which blocks in ``readline`` while any writer holds the FIFO) is
not a good partner for it; the kelastic sidecar's server is.

This module is stdlib only. Over ~400 lines because the client, the process-wide
configuration and :func:`expires` (with the timers it holds, which ``kelastic.inprocess``
reads) are one thing: the worker's half of the timer wire, sharing the fork handling.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import signal as _signal
import stat
import sys
import threading
import time
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Final, Protocol

from kelastic.contract import KELASTIC_TIMER_TOKEN, TORCHELASTIC_TIMER_FILE

__all__ = [
    "MAX_LINE_BYTES",
    "MAX_SCOPE_LEN",
    "WIRE_VERSION",
    "WRITE_TIMEOUT",
    "FifoTimerClient",
    "TimerClient",
    "configure",
    "expired_timer",
    "expires",
    "forget_default_client",
    "held_scopes",
    "release_since",
    "set_progress_hook",
]

#: Wire format version (torch's ``FileTimerRequest.version``).
WIRE_VERSION: Final = 1
#: Largest request line, newline included, in bytes: writes up to this size are atomic.
MAX_LINE_BYTES: Final = select.PIPE_BUF
#: Longest ``scope_id`` in characters (the kelastic server drops longer ones).
MAX_SCOPE_LEN: Final = 1024
#: Seconds a request waits for room in a full FIFO before it fails (``TimeoutError``): a
#: flood of other writers fills the pipe for fractions of a second while the server
#: drains it; a server that stopped reading leaves it full.
WRITE_TIMEOUT: Final = 10.0


class TimerClient(Protocol):
    """What :func:`expires` needs from a client (torch's ``TimerClient`` also fits)."""

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        """Start (or replace) the timer ``scope_id`` of this process."""

    def release(self, scope_id: str) -> None:
        """Cancel the timer ``scope_id`` of this process."""


class FifoTimerClient:
    """Client of the kelastic timer server (and of torch's ``FileTimerServer`` wire format).

    Semantics from ``torch.distributed.elastic.timer.FileTimerClient``: requests are keyed
    by ``(os.getpid(), scope_id)``; an expired timer makes the server send ``signal`` to
    this process.

    The FIFO is opened lazily on the first request with ``O_WRONLY | O_NONBLOCK`` (so a
    missing server fails at once instead of blocking) and kept open, non-blocking. A
    write that finds the pipe full (``EAGAIN``: other writers, torch's unthrottled
    clients say, filled it faster than the server drains) waits until the pipe is
    writable and writes again, for at most ``write_timeout`` seconds, so that neither a
    flood (torch's client fails with ``BlockingIOError`` there) nor a server that stopped
    reading (a blocking write would wait for ever) decides the request's fate without a
    bound. On ``EPIPE`` (the server restarted: the old FIFO has no reader) it is reopened
    once. A forked child never writes through its parent's descriptor: it reopens its
    own.

    Note: writing to a FIFO without a reader raises ``SIGPIPE``; Python ignores that
    signal by default, turning it into :class:`BrokenPipeError`. A program that restores
    the default ``SIGPIPE`` action would be killed instead when the server is gone.

    Args:
        file_path: path of the FIFO created by the timer server
            (``$TORCHELASTIC_TIMER_FILE`` in a kelastic worker).
        signal: signal number the server sends when a timer of this client expires;
            0 means "expire without killing". Must be in ``0..64``.
        token: sent with each request (at most 128 characters); default
            ``$KELASTIC_TIMER_TOKEN`` as set when the client is made, none if unset.
        write_timeout: seconds a request waits for room in a full FIFO (positive,
            finite); default :data:`WRITE_TIMEOUT`.

    Raises:
        ValueError: ``signal`` is outside ``0..64``, ``token`` is too long, or
            ``write_timeout`` is not a positive finite number.
    """

    def __init__(
        self,
        file_path: str | os.PathLike[str],
        signal: int = _signal.SIGKILL,
        token: str | None = None,
        write_timeout: float = WRITE_TIMEOUT,
    ) -> None:
        signal = int(signal)
        if not (math.isfinite(write_timeout) and write_timeout > 0):
            raise ValueError(f"write_timeout must be a positive number of seconds, got "
                             f"{write_timeout}")  # fmt: skip
        if not 0 <= signal <= 64:
            raise ValueError(f"signal must be in 0..64 (0: expire without kill), got {signal}")
        if token is None:
            token = os.environ.get(KELASTIC_TIMER_TOKEN) or None
        if token is not None and len(token) > 128:
            raise ValueError(f"token of {len(token)} characters exceeds 128")
        self.file_path: Final = os.fspath(file_path)
        self.signal: Final = signal
        self.token: Final = token
        self.write_timeout: Final = float(write_timeout)
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._fd_pid = 0
        _CLIENTS.add(self)

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        """Start or replace the timer ``scope_id`` of this process.

        Args:
            scope_id: names the timer within this process; at most
                :data:`MAX_SCOPE_LEN` characters.
            expiration_time: absolute deadline in seconds since the epoch
                (``time.time()`` clock); must be finite and >= 0.

        Raises:
            ValueError: bad ``expiration_time``, ``scope_id`` too long, or the request
                line exceeds ``select.PIPE_BUF`` bytes.
            BrokenPipeError: no timer server is reading the FIFO (a
                :class:`ConnectionError`).
            TimeoutError: the FIFO stayed full for ``write_timeout`` seconds (the server
                stopped reading); the request was not delivered.
        """
        if not isinstance(expiration_time, (int, float)) or isinstance(expiration_time, bool):
            raise ValueError(f"expiration_time must be a number, got {expiration_time!r}")
        if not math.isfinite(expiration_time) or expiration_time < 0:
            raise ValueError(f"expiration_time must be finite and >= 0, got {expiration_time}")
        self._send(scope_id, expiration_time, self.signal)

    def release(self, scope_id: str) -> None:
        """Cancel the timer ``scope_id`` of this process (no-op on the server if unknown).

        Sent as ``expiration_time=-1, signal=0``, like torch.

        Raises:
            ValueError: ``scope_id`` too long or the request line exceeds
                ``select.PIPE_BUF`` bytes.
            BrokenPipeError: no timer server is reading the FIFO.
            TimeoutError: the FIFO stayed full for ``write_timeout`` seconds.
        """
        self._send(scope_id, -1, 0)

    def close(self) -> None:
        """Close the FIFO descriptor. Idempotent; a later request opens it again."""
        with self._lock:
            self._close_fd()

    def __del__(self) -> None:
        # A client made per call (torch's habit) must not leak its descriptor.
        with contextlib.suppress(Exception):
            self._close_fd()

    def _send(self, scope_id: str, expiration_time: float, signal: int) -> None:
        if not isinstance(scope_id, str):
            raise ValueError(f"scope_id must be a str, got {type(scope_id).__name__}")
        if len(scope_id) > MAX_SCOPE_LEN:
            raise ValueError(f"scope_id of {len(scope_id)} characters exceeds {MAX_SCOPE_LEN}")
        line = _encode(os.getpid(), scope_id, expiration_time, signal, self.token)
        with self._lock:
            if self._fd is not None and self._fd_pid != os.getpid():
                self._close_fd()  # inherited from the parent over fork(): not ours
            for attempt in range(2):
                if self._fd is None:
                    self._fd = self._open()
                    self._fd_pid = os.getpid()
                try:
                    written = self._write(self._fd, line)
                except BrokenPipeError as exc:
                    self._close_fd()
                    if attempt == 1:
                        raise BrokenPipeError(
                            f"timer server stopped reading {self.file_path} (request not delivered)"
                        ) from exc
                    continue  # the server restarted: reopen the (new) FIFO once
                if written != len(line):  # impossible for a pipe write <= PIPE_BUF
                    raise OSError(f"short write to {self.file_path}: {written}/{len(line)}")
                return

    def _open(self) -> int:
        try:
            fd = os.open(self.file_path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            raise BrokenPipeError(
                f"timer server not available: cannot open FIFO {self.file_path} "
                f"for writing ({exc.strerror}); is the kelastic sidecar running?"
            ) from exc
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                raise BrokenPipeError(f"timer server not available: {self.file_path} is not a FIFO")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _write(self, fd: int, line: bytes) -> int:
        """Write ``line`` (at most ``PIPE_BUF`` bytes: all or nothing) to the non-blocking
        ``fd``, waiting for room while the pipe is full, for ``write_timeout`` seconds."""
        deadline = time.monotonic() + self.write_timeout
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        while True:
            try:
                return os.write(fd, line)
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"timer server not reading: {self.file_path} stayed full for "
                        f"{self.write_timeout:g} s (request not delivered)"
                    ) from None
                # POLLOUT says a page is free; a line may still not fit (other writers
                # race for it): the write says, and the wait repeats. At most 50 ms per
                # wait, so the bound holds whatever poll reports.
                poller.poll(min(50, max(1, int(left * 1000))))

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _after_fork_in_child(self) -> None:
        # Another thread may have held the lock at fork(); in the child it would stay held.
        self._lock = threading.Lock()
        self._close_fd()


def _encode(
    pid: int, scope_id: str, expiration_time: float, signal: int, token: str | None = None
) -> bytes:
    """One request line, in torch's ``FileTimerRequest.to_json()`` layout (plus
    ``token`` when given) and a newline."""
    request: dict[str, object] = {
        "version": WIRE_VERSION,
        "pid": pid,
        "scope_id": scope_id,
        "expiration_time": expiration_time,
        "signal": signal,
    }
    if token is not None:
        request["token"] = token
    line = (json.dumps(request) + "\n").encode()
    if len(line) > MAX_LINE_BYTES:
        raise ValueError(
            f"timer request of {len(line)} bytes exceeds select.PIPE_BUF={MAX_LINE_BYTES} "
            "(scope_id too long once JSON-encoded)"
        )
    return line


_CLIENTS: weakref.WeakSet[FifoTimerClient] = weakref.WeakSet()
_progress_hook: Callable[[], None] | None = None


def set_progress_hook(hook: Callable[[], None] | None) -> Callable[[], None] | None:
    """Install ``hook`` (None: remove it), called after each :func:`expires` acquire;
    return the previous one. ``kelastic.inprocess`` counts a timed step as progress this
    way. The hook must be cheap and must not raise."""
    global _progress_hook
    previous, _progress_hook = _progress_hook, hook
    return previous


_configure_lock = threading.Lock()
_client: FifoTimerClient | None = None


#: This process's timers held through :func:`expires`: scope -> (deadline, ``time.time()``
#: seconds, and the client it was acquired with), as the server has them (the same scope
#: replaces, a release removes).
_held: dict[str, tuple[float, TimerClient]] = {}
_held_lock = threading.Lock()


def expired_timer(now: float | None = None) -> tuple[str, float] | None:
    """The scope and deadline of the earliest :func:`expires` timer of this process whose
    deadline has passed and which is still held, or None. ``kelastic.inprocess`` reports
    such a timer as a soft timeout at once (before the server reaps the worker).

    Args:
        now: seconds since the epoch; default ``time.time()``.
    """
    now = time.time() if now is None else now
    with _held_lock:
        due = [(deadline, scope) for scope, (deadline, _) in _held.items() if deadline <= now]
    if not due:
        return None
    deadline, scope = min(due)
    return scope, deadline


def _forget(scope: str) -> None:
    with _held_lock:
        _held.pop(scope, None)


def held_scopes() -> frozenset[str]:
    """The scopes of this process's :func:`expires` timers held now."""
    with _held_lock:
        return frozenset(_held)


def release_since(before: frozenset[str]) -> list[str]:
    """Release this process's :func:`expires` timers held now but not in ``before`` (a
    :func:`held_scopes` snapshot) and return their scopes. ``kelastic.inprocess`` calls
    it as an aborted iteration is left: the abort, an exception raised asynchronously,
    may land inside a block's ``__enter__`` after its acquire, and that block's
    ``__exit__`` never runs (found in a loaded run: a rank waiting at the termination
    barrier was reaped 7 s later by its leaked timer). A release that cannot be sent
    (no server reading) is skipped: the timer server forgets the pid's timers anyway
    when its worker goes.
    """
    with _held_lock:
        leaked = [(scope, client) for scope, (_, client) in _held.items() if scope not in before]
    for scope, client in leaked:
        with contextlib.suppress(OSError, TimeoutError):
            client.release(scope)
        _forget(scope)
    return [scope for scope, _ in leaked]


def _reinit_after_fork() -> None:
    global _configure_lock, _held_lock
    _configure_lock = threading.Lock()
    _held_lock = threading.Lock()
    _held.clear()  # the parent's timers: the server keys them by its pid, not ours
    for client in list(_CLIENTS):
        client._after_fork_in_child()


if sys.platform != "win32":
    os.register_at_fork(after_in_child=_reinit_after_fork)


def configure(
    file_path: str | os.PathLike[str] | None = None, signal: int = _signal.SIGKILL
) -> None:
    """Set the process-wide client used by :func:`expires`.

    Semantics from ``torch.distributed.elastic.timer.configure``, taking a path instead
    of a client object. The FIFO is opened lazily, on the first request.

    Args:
        file_path: the timer FIFO; default ``$TORCHELASTIC_TIMER_FILE`` (set by the
            kelastic launcher for each worker).
        signal: signal sent to this process when one of its timers expires
            (default SIGKILL; 0: expire without kill).

    Raises:
        RuntimeError: neither ``file_path`` nor ``$TORCHELASTIC_TIMER_FILE`` is given.
        ValueError: ``signal`` outside ``0..64``.
    """
    global _client
    if file_path is None:
        file_path = os.environ.get(TORCHELASTIC_TIMER_FILE) or None
    if file_path is None:
        raise RuntimeError(
            f"kelastic.timer.configure(): no timer FIFO; pass file_path or set "
            f"${TORCHELASTIC_TIMER_FILE} (the kelastic launcher sets it for workers)"
        )
    new = FifoTimerClient(file_path, signal)
    with _configure_lock:
        old, _client = _client, new
    if old is not None:
        old.close()


def forget_default_client() -> None:
    """Drop the process-wide client :func:`expires` uses (closing its FIFO descriptor):
    the next :func:`expires` makes one from the environment as it is then. A spare worker
    promoted to a rank (``kelastic.inprocess``) calls it: its ``$KELASTIC_TIMER_TOKEN``
    changed. Never raises."""
    global _client
    with _configure_lock:
        old, _client = _client, None
    if old is not None:
        old.close()


def _default_client() -> FifoTimerClient:
    with _configure_lock:
        client = _client
    if client is None:
        if not os.environ.get(TORCHELASTIC_TIMER_FILE):
            raise RuntimeError(
                "kelastic.timer.expires(): timer client not configured; call "
                f"kelastic.timer.configure(file_path) or set ${TORCHELASTIC_TIMER_FILE}"
            )
        configure()
        with _configure_lock:
            client = _client
        assert client is not None
    return client


class _Expires:
    """The context manager returned by :func:`expires`."""

    def __init__(self, after: float, scope: str, client: TimerClient) -> None:
        self._after = after
        self._scope = scope
        self._client = client

    def __enter__(self) -> None:
        deadline = time.time() + self._after
        # held before it is acquired, released before it is forgotten: an exception raised
        # asynchronously inside __enter__ or __exit__ (an in-process abort) skips the
        # other, and the Wrapper releases what the aborted iteration still holds
        # (:func:`release_since`)
        with _held_lock:
            _held[self._scope] = (deadline, self._client)
        try:
            self._client.acquire(self._scope, deadline)
        except Exception:  # not sent (no server, a full FIFO): not held
            _forget(self._scope)
            raise
        hook = _progress_hook
        if hook is not None:
            hook()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self._client.release(self._scope)
        except Exception:  # not sent (no server): nothing is held any more
            _forget(self._scope)
            raise
        _forget(self._scope)  # an abort inside the release skips this: the Wrapper releases


def expires(after: float, scope: str | None = None, client: TimerClient | None = None) -> _Expires:
    """Context manager: a countdown timer of ``after`` seconds around a code block.

    Semantics from ``torch.distributed.elastic.timer.expires``: on entry it acquires
    a timer with ``expiration_time = time.time() + after`` (seconds since the epoch);
    on exit, normal or by an exception, it releases it. If the block outlives the
    deadline, the worker is eligible to be reaped; the server decides when (shortly
    after the deadline, not exactly at it).

    Args:
        after: seconds from entry until the timer expires (finite).
        scope: timer name within this process; default ``"<file>#<line>"`` of the
            caller (like torch, but the real caller: torch's decorator makes it point
            into contextlib). Nested or concurrent blocks in one process need distinct
            scopes: the same scope replaces the timer.
        client: default the client set by :func:`configure`; if none was, one is
            configured from ``$TORCHELASTIC_TIMER_FILE``.

    Raises:
        RuntimeError: no client given or configured and ``$TORCHELASTIC_TIMER_FILE``
            unset.
        ValueError: ``after`` is not finite.
        BrokenPipeError: (on entry or exit) no timer server is reading the FIFO.
        TimeoutError: (on entry or exit) the FIFO stayed full for the client's
            ``write_timeout`` seconds (the server stopped reading).
    """
    if not math.isfinite(after):
        raise ValueError(f"after must be a finite number of seconds, got {after}")
    if scope is None:
        caller = sys._getframe(1)
        scope = f"{caller.f_code.co_filename}#{caller.f_lineno}"
    return _Expires(after, scope, client if client is not None else _default_client())
