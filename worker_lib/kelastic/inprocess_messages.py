"""The in-process restart protocol's messages, both directions: types, decoders, encoder.

A worker wrapped by :class:`kelastic.inprocess.Wrapper` and its node's sidecar
(``kelastic_sidecar.inprocess``) speak JSON lines over ``inprocess.sock`` on the shared
volume (:func:`kelastic.contract.inprocess_socket_path`), one connection per worker
process, one object per line of at most :data:`MAX_LINE` bytes.

The vocabulary follows NVIDIA's in-process restart (``nvidia_resiliency_ext.inprocess``):
an *iteration* is
one call of the wrapped function on every rank; a *fault* in iteration ``n`` makes the
coordinators agree on iteration ``n + 1`` (the fencing token); every rank *aborts*
(leaves the function, tears down its process groups), passes the *termination barrier*
(``ready``), and re-enters the function on ``go`` with that iteration's env.

- Upward (worker -> sidecar): :class:`Hello`, :class:`Fault`, :class:`Progress`,
  :class:`Ready`, :class:`Done`, :class:`Beat`; decoded by :func:`parse_worker_message`.
- Downward (sidecar -> worker): :class:`Abort`, :class:`Go`, :class:`GiveUp`; decoded by
  :func:`parse_coordinator_message`.

Unknown types decode as :class:`Unknown` (version skew). Both decoders are bounded
(:func:`kelastic._safejson.loads_bounded`) and raise :class:`ProtocolError` and nothing
else, whatever the line holds. Stdlib only, no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

from kelastic import contract
from kelastic._safejson import BadEnvError, UnsafeJSONError, env_map, is_int, loads_bounded

__all__ = [
    "CAUSES",
    "MAX_LINE",
    "Abort",
    "Beat",
    "CoordinatorMessage",
    "Done",
    "Fault",
    "GiveUp",
    "Go",
    "Hello",
    "Progress",
    "ProtocolError",
    "Ready",
    "Unknown",
    "WorkerMessage",
    "beat_interval",
    "encode",
    "parse_coordinator_message",
    "parse_worker_message",
]

#: Largest message accepted, bytes including the newline (a ``go`` carries an env).
MAX_LINE: Final = 256 * 1024
#: Iterations, ranks and pids are at most this (2**53: exact as a float).
MAX_COUNTER: Final = 2**53
#: Longest fault message or reason kept, characters (longer ones are cut, not refused).
MAX_TEXT: Final = 8 * 1024

#: Why a rank left an iteration: the wrapped function raised; no progress within the soft
#: timeout; its health check failed after an abort; its abort failed.
CAUSE_EXCEPTION: Final = "exception"
CAUSE_SOFT_TIMEOUT: Final = "soft_timeout"
CAUSE_HEALTH_CHECK: Final = "health_check"
CAUSE_ABORT_FAILED: Final = "abort_failed"
CAUSES: Final = frozenset({CAUSE_EXCEPTION, CAUSE_SOFT_TIMEOUT, CAUSE_HEALTH_CHECK,
                           CAUSE_ABORT_FAILED})  # fmt: skip


class ProtocolError(ValueError):
    """A line of the in-process protocol is malformed (the message says how, quoting it)."""


def _excerpt(line: bytes, limit: int = 200) -> str:
    text = line[:limit].decode("utf-8", errors="replace")
    return repr(text) + ("..." if len(line) > limit else "")


# ------------------------------------------------------------------------- upward


@dataclass(frozen=True)
class Hello:
    """First line of every worker connection.

    Attributes:
        pid: the worker's process id.
        local_rank: ``LOCAL_RANK`` of the worker (0..4095).
        rank: ``RANK`` (global rank) of the worker.
        iteration: the iteration the worker is about to enter (0 at a process start; a
            rank started again for a running job says the iteration it was started for).
        spare: a spare worker (``$KELASTIC_INPROCESS_SPARE``): ``local_rank`` is its spare
            slot, ``rank`` its placeholder; it waits for a ``go`` that names the rank it
            replaces (or ``give_up``: it exits 0).
    """

    pid: int
    local_rank: int
    rank: int
    iteration: int
    spare: bool = False
    type: ClassVar[str] = contract.IP_HELLO


@dataclass(frozen=True)
class Fault:
    """The rank left ``iteration`` because of ``cause`` (one of :data:`CAUSES`).

    Attributes:
        message: the exception's one-line summary, or what timed out (at most
            :data:`MAX_TEXT` characters).
    """

    iteration: int
    local_rank: int
    cause: str
    message: str = ""
    type: ClassVar[str] = contract.IP_FAULT


@dataclass(frozen=True)
class Progress:
    """The rank is stepping in ``iteration`` (sent once per iteration, at its first ``ping``
    or timed step): how the sidecar measures a restart's end."""

    iteration: int
    local_rank: int
    type: ClassVar[str] = contract.IP_PROGRESS


@dataclass(frozen=True)
class Ready:
    """Termination barrier: the rank aborted, finalized and passed its health check, and
    waits to enter ``iteration`` (the next one)."""

    iteration: int
    local_rank: int
    type: ClassVar[str] = contract.IP_READY


@dataclass(frozen=True)
class Done:
    """The wrapped function returned on this rank in ``iteration`` (completion)."""

    iteration: int
    local_rank: int
    type: ClassVar[str] = contract.IP_DONE


@dataclass(frozen=True)
class Beat:
    """The worker's monitor thread is running (sent every :func:`beat_interval` seconds,
    in every phase, from ``hello`` to the end of the connection): the sidecar's proof
    that the process is not stopped and its interpreter runs. A worker whose beats stop
    for the soft timeout is hung where it cannot say so itself (SIGSTOP, a C call holding
    the GIL): its sidecar faults it on its behalf (NVIDIA's monitor process reads a
    shared progress timestamp for the same reason). Older workers send none: the
    sidecar watches only a session that has beaten once."""

    local_rank: int
    type: ClassVar[str] = contract.IP_BEAT


def beat_interval(soft_timeout: float) -> float:
    """Seconds between a worker's beats for a soft timeout of ``soft_timeout`` seconds:
    a quarter of it, at most 1 s, at least 10 ms (four beats lost before a silence)."""
    return max(0.01, min(1.0, soft_timeout / 4))


# ----------------------------------------------------------------------- downward


@dataclass(frozen=True)
class Abort:
    """Leave the current iteration now; the next one is ``iteration``.

    Attributes:
        reason: what happened, for logs (e.g. ``rank 1: exception: ValueError: ...``).
    """

    iteration: int
    reason: str = ""
    type: ClassVar[str] = contract.IP_ABORT


@dataclass(frozen=True)
class Go:
    """Enter ``iteration`` with ``env`` applied to ``os.environ`` (torch's names: ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` ..., and
    ``KELASTIC_INPROCESS_ITERATION``)."""

    iteration: int
    env: dict[str, str] = field(default_factory=dict)
    type: ClassVar[str] = contract.IP_GO


@dataclass(frozen=True)
class GiveUp:
    """No in-process restart for this fault (budget spent, health check failed, a new
    rendezvous round): the worker re-raises its fault and exits, so the process rung
    takes over."""

    reason: str = ""
    type: ClassVar[str] = contract.IP_GIVE_UP


@dataclass(frozen=True)
class Unknown:
    """A message of a type this version does not know (ignored by receivers)."""

    type: str


WorkerMessage = Hello | Fault | Progress | Ready | Done | Beat | Unknown
CoordinatorMessage = Abort | Go | GiveUp | Unknown


def encode(msg: WorkerMessage | CoordinatorMessage) -> bytes:
    """Wire form of ``msg``: one JSON object and ``\\n``.

    Raises:
        ProtocolError: the encoded line would exceed :data:`MAX_LINE` bytes.
    """
    body: dict[str, Any] = {"type": msg.type}
    for name in getattr(msg, "__dataclass_fields__", {}):
        if name != "type":
            body[name] = getattr(msg, name)
    raw = json.dumps(body, separators=(",", ":"), allow_nan=False).encode() + b"\n"
    if len(raw) > MAX_LINE:
        raise ProtocolError(f"{msg.type} message of {len(raw)} bytes exceeds {MAX_LINE}")
    return raw


# ------------------------------------------------------------------------ decoding


def _load(line: bytes) -> tuple[dict[str, Any], str]:
    try:
        obj = loads_bounded(line, max_bytes=MAX_LINE)
    except UnsafeJSONError as e:
        raise ProtocolError(f"in-process message is not JSON ({e}): " + _excerpt(line)) from None
    if not isinstance(obj, dict):
        raise ProtocolError("in-process message is not a JSON object: " + _excerpt(line))
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("in-process message has no string 'type': " + _excerpt(line))
    return obj, kind


def _int(obj: dict[str, Any], name: str, line: bytes, maximum: int = MAX_COUNTER) -> int:
    value = obj.get(name)
    if not is_int(value, 0, maximum):
        raise ProtocolError(
            f"{obj.get('type')!r} message needs an integer {name!r} in 0..{maximum}, "
            f"got {value!r}: " + _excerpt(line)
        )
    return value


def _text(obj: dict[str, Any], name: str, line: bytes) -> str:
    value = obj.get(name, "")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ProtocolError(
            f"{obj.get('type')!r} message needs a string {name!r}, got {value!r}: " + _excerpt(line)
        )
    return value[:MAX_TEXT]


def _local_rank(obj: dict[str, Any], line: bytes) -> int:
    return _int(obj, "local_rank", line, maximum=4095)


def parse_worker_message(line: bytes) -> WorkerMessage:
    """Decode one line a wrapped worker sent (without its newline).

    Returns:
        :class:`Hello`, :class:`Fault`, :class:`Progress`, :class:`Ready`, :class:`Done`,
        :class:`Beat`, or :class:`Unknown`.

    Raises:
        ProtocolError: not UTF-8 JSON within the bounds, not an object, no string
            ``type``, a known type with a missing or mistyped field, a cause not in
            :data:`CAUSES`. Never another exception.
    """
    obj, kind = _load(line)
    if kind == contract.IP_HELLO:
        spare = obj.get("spare", False)
        if not isinstance(spare, bool):
            raise ProtocolError(f"hello 'spare' must be a boolean, got {spare!r}: "
                                + _excerpt(line))  # fmt: skip
        return Hello(
            pid=_int(obj, "pid", line), local_rank=_local_rank(obj, line),
            rank=_int(obj, "rank", line), iteration=_int(obj, "iteration", line), spare=spare,
        )  # fmt: skip
    if kind == contract.IP_FAULT:
        cause = _text(obj, "cause", line)
        if cause not in CAUSES:
            raise ProtocolError(
                f"fault cause must be one of {sorted(CAUSES)}, got {cause!r}: " + _excerpt(line)
            )
        return Fault(
            iteration=_int(obj, "iteration", line), local_rank=_local_rank(obj, line),
            cause=cause, message=_text(obj, "message", line),
        )  # fmt: skip
    if kind == contract.IP_BEAT:
        return Beat(local_rank=_local_rank(obj, line))
    simple: dict[str, type[Progress] | type[Ready] | type[Done]] = {
        contract.IP_PROGRESS: Progress, contract.IP_READY: Ready, contract.IP_DONE: Done,
    }  # fmt: skip
    if kind in simple:
        return simple[kind](
            iteration=_int(obj, "iteration", line), local_rank=_local_rank(obj, line)
        )
    return Unknown(type=kind[:64])


def _env(obj: dict[str, Any], line: bytes) -> dict[str, str]:
    try:
        return env_map(obj.get("env", {}), "go env")  # strings only, no integers
    except BadEnvError as exc:
        raise ProtocolError(f"{exc}: " + _excerpt(line)) from None


def parse_coordinator_message(line: bytes) -> CoordinatorMessage:
    """Decode one line the sidecar's coordinator sent (without its newline).

    Returns:
        :class:`Abort`, :class:`Go`, :class:`GiveUp`, or :class:`Unknown`.

    Raises:
        ProtocolError: as :func:`parse_worker_message`; a ``go`` env must map names
            (non-empty, no ``=`` or NUL) to strings. Never another exception.
    """
    obj, kind = _load(line)
    if kind == contract.IP_ABORT:
        return Abort(iteration=_int(obj, "iteration", line), reason=_text(obj, "reason", line))
    if kind == contract.IP_GO:
        return Go(iteration=_int(obj, "iteration", line), env=_env(obj, line))
    if kind == contract.IP_GIVE_UP:
        return GiveUp(reason=_text(obj, "reason", line))
    return Unknown(type=kind[:64])
