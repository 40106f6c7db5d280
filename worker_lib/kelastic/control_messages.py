"""The control protocol's messages, both directions, defined once: types, decoders, encoder.

The launcher (:mod:`kelastic.launch`, in the trainer container) and the sidecar's
control server (``kelastic_sidecar.control``) speak JSON lines over ``control.sock``:
one object per line (UTF-8, ``\\n``-terminated, at most
:data:`kelastic.contract.CONTROL_MAX_LINE` bytes including the newline).

- Downward (sidecar -> launcher): :class:`Assign`, :class:`Stop`, :class:`Shutdown`,
  :class:`Respawn`, :class:`Promote`,
  decoded by :func:`parse_message`.
- Upward (launcher -> sidecar): :class:`Hello`, :class:`Started`, :class:`Exited`,
  :class:`Stopped`, decoded by :func:`parse_launcher_message`.

A message of a type this version does not know decodes as :class:`Unknown` (version
skew). Every message has ``type`` and :meth:`as_dict` (its wire form). Both decoders are
bounded (:func:`kelastic._safejson.loads_bounded`) and range-check every field, raising
:class:`ProtocolError` and nothing else whatever the line holds. Stdlib only.

Over ~400 lines because it is one cohesive thing: the protocol's whole vocabulary and
its two validating decoders, kept side by side so that a field is typed and bounded in
one place. It does no I/O (framing is :class:`kelastic._control.LineBuffer`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

from kelastic import contract
from kelastic._safejson import BadEnvError, UnsafeJSONError, env_map, is_int, loads_bounded
from kelastic.preflight import MAX_ERROR_CHARS

__all__ = [
    "MAX_CHECK_LINE",
    "MAX_CHECK_TIMEOUT",
    "MAX_COUNTER",
    "MAX_LOCAL_RANK",
    "MAX_NPROC",
    "MAX_PID",
    "Assign",
    "Check",
    "Checked",
    "Exited",
    "Hello",
    "LauncherMessage",
    "Message",
    "Promote",
    "ProtocolError",
    "Respawn",
    "Shutdown",
    "Started",
    "Stop",
    "Stopped",
    "Unknown",
    "WorkerAssignment",
    "encode_message",
    "parse_launcher_message",
    "parse_message",
]


#: Bounds of decoded fields: attempts and rounds (2**53: exact as a float), local ranks.
MAX_COUNTER: Final = 2**53
MAX_LOCAL_RANK: Final = 4095


class ProtocolError(ValueError):
    """A control message could not be framed, decoded or validated.

    ``str(error)`` names the problem and quotes (a prefix of) the offending line.
    """


# ---------------------------------------------------------------- downward messages


@dataclass(frozen=True)
class WorkerAssignment:
    """One worker of an ``assign``: its local rank and the env the supervisor set."""

    local_rank: int
    env: dict[str, str]


@dataclass(frozen=True)
class Assign:
    """``{"type": "assign", "attempt", "round", "workers": [{"local_rank", "env"}],
    "spares"}``: ``spares`` (0 when absent) spare workers wait beside the workers, warm,
    to replace a dead one without a process start (in-process restart's spare ranks)."""

    type: ClassVar[str] = contract.MSG_ASSIGN
    attempt: int
    round: int
    workers: tuple[WorkerAssignment, ...]
    spares: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The wire form (see :func:`encode_message`); ``spares`` only when not 0."""
        out: dict[str, Any] = {
            "type": self.type,
            "attempt": self.attempt,
            "round": self.round,
            "workers": [{"local_rank": w.local_rank, "env": w.env} for w in self.workers],
        }
        if self.spares:
            out["spares"] = self.spares
        return out


@dataclass(frozen=True)
class Stop:
    """``{"type": "stop", "attempt", "reason"}``: stop every worker of ``attempt``."""

    type: ClassVar[str] = contract.MSG_STOP
    attempt: int
    reason: str

    def as_dict(self) -> dict[str, Any]:
        """The wire form."""
        return {"type": self.type, "attempt": self.attempt, "reason": self.reason}


@dataclass(frozen=True)
class Shutdown:
    """``{"type": "shutdown", "exitcode", "summary"}``: stop, write summary, exit."""

    type: ClassVar[str] = contract.MSG_SHUTDOWN
    exitcode: int
    summary: str

    def as_dict(self) -> dict[str, Any]:
        """The wire form."""
        return {"type": self.type, "exitcode": self.exitcode, "summary": self.summary}


@dataclass(frozen=True)
class Respawn:
    """``{"type": "respawn", "attempt", "local_rank", "env"}``: start the worker of
    ``local_rank`` of ``attempt`` again (it exited; its peers restart in process), with
    the attempt's env for it updated by ``env``. The launcher answers ``started`` with
    the new pid (a rung of in-process restart: only the dead rank becomes a process)."""

    type: ClassVar[str] = contract.MSG_RESPAWN
    attempt: int
    local_rank: int
    env: dict[str, str]

    def as_dict(self) -> dict[str, Any]:
        """The wire form."""
        return {
            "type": self.type,
            "attempt": self.attempt,
            "local_rank": self.local_rank,
            "env": self.env,
        }


@dataclass(frozen=True)
class Promote:
    """``{"type": "promote", "attempt", "spare_slot", "local_rank", "pid"}``: the spare
    worker ``pid`` waiting in ``spare_slot`` of ``attempt`` was told to take the place of
    the dead worker of ``local_rank`` (its peers restart in process): from now on the
    launcher reports that process as ``local_rank`` (``started`` with its pid, then its
    exit; its exit at once when it died meanwhile), and starts a new spare in the slot."""

    type: ClassVar[str] = contract.MSG_PROMOTE
    attempt: int
    spare_slot: int
    local_rank: int
    pid: int

    def as_dict(self) -> dict[str, Any]:
        """The wire form."""
        return {
            "type": self.type,
            "attempt": self.attempt,
            "spare_slot": self.spare_slot,
            "local_rank": self.local_rank,
            "pid": self.pid,
        }


@dataclass(frozen=True)
class Check:
    """``{"type": "check", "round", "params", "timeout"}``: run the network check of
    ``round`` (:mod:`kelastic.netcheck`): ``params`` is the checker's params line, passed
    to it unread (its codec checks it), ``timeout`` the seconds after which the checker
    is killed (1..:data:`MAX_CHECK_TIMEOUT`). Answered by ``checked``."""

    type: ClassVar[str] = contract.MSG_CHECK
    round: int
    params: str
    timeout: float

    def as_dict(self) -> dict[str, Any]:
        """The wire form."""
        return {"type": self.type, "round": self.round, "params": self.params,
                "timeout": self.timeout}  # fmt: skip


@dataclass(frozen=True)
class Unknown:
    """A well-formed message of a type this launcher does not know (version skew)."""

    type: str

    def as_dict(self) -> dict[str, Any]:
        """The wire form."""
        return {"type": self.type}


Message = Assign | Stop | Shutdown | Respawn | Promote | Check | Unknown

#: Longest network check the sidecar may ask for, seconds.
MAX_CHECK_TIMEOUT: Final = 3600
#: Longest params line of a ``check`` and verdict line of a ``checked``, bytes (UTF-8).
MAX_CHECK_LINE: Final = 256 * 1024


def excerpt(line: bytes, limit: int = 200) -> str:
    """A quotable prefix of ``line`` for an error message."""
    text = line[:limit].decode("utf-8", errors="replace")
    return repr(text) + ("..." if len(line) > limit else "")


def _int_field(obj: dict[str, Any], name: str, line: bytes, minimum: int | None = None) -> int:
    value = obj.get(name)
    if not is_int(value, -MAX_COUNTER, MAX_COUNTER):
        raise ProtocolError(
            f"{obj.get('type')!r} message needs an integer {name!r}, got {value!r}: "
            + excerpt(line)
        )
    if minimum is not None and value < minimum:
        raise ProtocolError(
            f"{obj.get('type')!r} message has {name}={value}, below {minimum}: " + excerpt(line)
        )
    return value


def _str_field(obj: dict[str, Any], name: str, line: bytes) -> str:
    value = obj.get(name, "")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ProtocolError(
            f"{obj.get('type')!r} message needs a string {name!r}, got {value!r}: " + excerpt(line)
        )
    return value


def _env(value: object, where: str, line: bytes) -> dict[str, str]:
    try:  # integers are accepted for convenience (RANK: 0), as strings
        return env_map(value, f"{where}.env", ints=True)
    except BadEnvError as exc:
        raise ProtocolError(f"{exc}: " + excerpt(line)) from None


def _parse_assign(obj: dict[str, Any], line: bytes) -> Assign:
    attempt = _int_field(obj, "attempt", line, minimum=0)
    round_ = _int_field(obj, "round", line, minimum=0)
    raw_workers = obj.get("workers")
    if not isinstance(raw_workers, list):
        raise ProtocolError("assign message needs a list 'workers': " + excerpt(line))
    workers: list[WorkerAssignment] = []
    seen: set[int] = set()
    for i, entry in enumerate(raw_workers):
        if not isinstance(entry, dict):
            raise ProtocolError(f"assign workers[{i}] must be an object: " + excerpt(line))
        local_rank = entry.get("local_rank")
        if (
            not isinstance(local_rank, int)
            or isinstance(local_rank, bool)
            or not 0 <= local_rank <= MAX_LOCAL_RANK
        ):
            raise ProtocolError(
                f"assign workers[{i}].local_rank must be an integer in 0..{MAX_LOCAL_RANK}, "
                f"got {local_rank!r}: " + excerpt(line)
            )
        if local_rank in seen:
            raise ProtocolError(
                f"assign workers[{i}] repeats local_rank {local_rank}: " + excerpt(line)
            )
        seen.add(local_rank)
        workers.append(
            WorkerAssignment(local_rank, _env(entry.get("env", {}), f"assign workers[{i}]", line))
        )
    spares = obj.get("spares", 0)
    if (
        not isinstance(spares, int)
        or isinstance(spares, bool)
        or not 0 <= spares <= contract.MAX_INPROCESS_SPARES
        or max(seen, default=-1) + spares > MAX_LOCAL_RANK
    ):
        raise ProtocolError(
            f"assign spares must be an integer in 0..{contract.MAX_INPROCESS_SPARES} (local "
            f"ranks of spares at most {MAX_LOCAL_RANK}), got {spares!r}: " + excerpt(line)
        )
    return Assign(attempt=attempt, round=round_, workers=tuple(workers), spares=spares)


def _local_rank_field(obj: dict[str, Any], name: str, line: bytes) -> int:
    value = _int_field(obj, name, line, minimum=0)
    if value > MAX_LOCAL_RANK:
        raise ProtocolError(
            f"{obj.get('type')} {name} {value} is above {MAX_LOCAL_RANK}: " + excerpt(line)
        )
    return value


def _parse_promote(obj: dict[str, Any], line: bytes) -> Promote:
    slot = _local_rank_field(obj, "spare_slot", line)
    local_rank = _local_rank_field(obj, "local_rank", line)
    if slot == local_rank:
        raise ProtocolError(f"promote spare_slot equals local_rank {slot}: " + excerpt(line))
    pid = _int_field(obj, "pid", line, minimum=1)
    if pid > MAX_PID:
        raise ProtocolError(f"promote pid {pid} is above {MAX_PID}: " + excerpt(line))
    return Promote(
        attempt=_int_field(obj, "attempt", line, minimum=0), spare_slot=slot,
        local_rank=local_rank, pid=pid,
    )  # fmt: skip


def _parse_check(obj: dict[str, Any], line: bytes) -> Check:
    params, timeout = obj.get("params"), obj.get("timeout")
    if not isinstance(params, str) or not 0 < len(params.encode()) <= MAX_CHECK_LINE:
        raise ProtocolError(f"check params must be a string of 1..{MAX_CHECK_LINE} bytes: "
                            + excerpt(line))  # fmt: skip
    if "\n" in params:
        raise ProtocolError("check params must be one line: " + excerpt(line))
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not 1 <= timeout <= MAX_CHECK_TIMEOUT
    ):
        raise ProtocolError(f"check timeout must be 1..{MAX_CHECK_TIMEOUT} seconds, got "
                            f"{timeout!r:.40}: " + excerpt(line))  # fmt: skip
    return Check(round=_int_field(obj, "round", line, minimum=0), params=params,
                 timeout=float(timeout))  # fmt: skip


def parse_message(line: bytes) -> Message:
    """Decode and validate one line from the sidecar.

    Args:
        line: one line without its trailing newline.

    Returns:
        :class:`Assign`, :class:`Stop`, :class:`Shutdown`, :class:`Respawn`,
        :class:`Promote`, :class:`Check`, or :class:`Unknown` for a
        JSON object whose ``type`` is a string this version does not know (extra fields
        of known types are ignored, for forward compatibility).

    Hostile input is bounded (:func:`kelastic._safejson.loads_bounded`): at most
    ``contract.CONTROL_MAX_LINE`` bytes nested at most 32 deep, integers of at most 19
    digits, finite numbers; attempts and rounds at most :data:`MAX_COUNTER`, local
    ranks at most :data:`MAX_LOCAL_RANK`.

    Raises:
        ProtocolError: not UTF-8, not JSON, over a bound, not an object, no string
            ``type``, or a known type with missing or mistyped fields. Never another
            exception, whatever ``line`` holds.
    """
    try:
        obj = loads_bounded(line, max_bytes=contract.CONTROL_MAX_LINE)
    except UnsafeJSONError as e:
        raise ProtocolError(f"control message is not JSON ({e}): " + excerpt(line)) from None
    if not isinstance(obj, dict):
        raise ProtocolError("control message is not a JSON object: " + excerpt(line))
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("control message has no string 'type': " + excerpt(line))
    if kind == contract.MSG_ASSIGN:
        return _parse_assign(obj, line)
    if kind == contract.MSG_STOP:
        return Stop(
            attempt=_int_field(obj, "attempt", line), reason=_str_field(obj, "reason", line)
        )
    if kind == contract.MSG_RESPAWN:
        local_rank = _int_field(obj, "local_rank", line, minimum=0)
        if local_rank > MAX_LOCAL_RANK:
            raise ProtocolError(
                f"respawn local_rank {local_rank} is above {MAX_LOCAL_RANK}: " + excerpt(line)
            )
        return Respawn(
            attempt=_int_field(obj, "attempt", line, minimum=0),
            local_rank=local_rank,
            env=_env(obj.get("env", {}), "respawn", line),
        )
    if kind == contract.MSG_PROMOTE:
        return _parse_promote(obj, line)
    if kind == contract.MSG_CHECK:
        return _parse_check(obj, line)
    if kind == contract.MSG_SHUTDOWN:
        exitcode = _int_field(obj, "exitcode", line, minimum=0)
        if exitcode > 255:
            raise ProtocolError(f"shutdown exitcode {exitcode} is above 255: " + excerpt(line))
        return Shutdown(exitcode=exitcode, summary=_str_field(obj, "summary", line))
    return Unknown(type=kind)


def encode_message(obj: dict[str, Any]) -> bytes:
    """Encode one message as a compact UTF-8 JSON line (with the trailing newline).

    Raises:
        ValueError: the encoded line is longer than ``contract.CONTROL_MAX_LINE`` bytes,
            or ``obj`` is not JSON-serializable.
    """
    data = (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
    if len(data) > contract.CONTROL_MAX_LINE:
        raise ValueError(
            f"{obj.get('type')!r} message is {len(data)} bytes, above the "
            f"{contract.CONTROL_MAX_LINE}-byte control line limit"
        )
    return data


# ------------------------------------------------------------------ upward messages

#: Bounds of launcher messages: workers per node, pids, message type length.
MAX_NPROC: Final = 4096
MAX_PID: Final = 2**31 - 1
_MAX_TYPE_LEN: Final = 64


@dataclass(frozen=True)
class Hello:
    """``{"type": "hello", "pid", "nproc", "preflight_error", "netcheck"}``: the launcher
    connected (each may be null). ``preflight_error``: how the node's preflight check
    failed (:mod:`kelastic.preflight`; at most :data:`MAX_ERROR_CHARS` characters); null
    when it passed or there is none (an older launcher sends no such key). ``netcheck``:
    the launcher answers ``check`` (:mod:`kelastic.netcheck`); absent (false) from an
    older one, which the sidecar then never asks."""

    type: ClassVar[str] = contract.MSG_HELLO
    pid: int | None = None
    nproc: int | None = None
    preflight_error: str | None = None
    netcheck: bool = False

    def as_dict(self) -> dict[str, Any]:
        """The wire form."""
        doc: dict[str, Any] = {"type": self.type, "pid": self.pid, "nproc": self.nproc}
        if self.preflight_error is not None:  # a check failed (an older sidecar: no key)
            doc["preflight_error"] = self.preflight_error
        if self.netcheck:
            doc["netcheck"] = True
        return doc


@dataclass(frozen=True)
class Started:
    """``{"type": "started", "attempt", "pids": {"<local rank>": pid}, "warm"}``.

    ``warm``: how many of the workers a warm-start zygote forked (0 when absent).
    """

    type: ClassVar[str] = contract.MSG_STARTED
    attempt: int
    pids: dict[int, int] = field(default_factory=dict)
    warm: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The wire form (local ranks as string keys)."""
        return {
            "type": self.type,
            "attempt": self.attempt,
            "pids": {str(r): p for r, p in self.pids.items()},
            "warm": self.warm,
        }


@dataclass(frozen=True)
class Exited:
    """``{"type": "exited", "attempt", "local_rank", "pid", "exitcode", "signal", "error",
    "tail", "oom"}``: one worker ended. ``pid`` is None when it could not even be started;
    ``error`` is its error file (:data:`kelastic.errors.ErrorInfo`) or None; ``oom``: the
    kernel's OOM killer took it (its ``SIGKILL`` while the container's memory cgroup counted
    an OOM kill; absent from an older launcher: false)."""

    type: ClassVar[str] = contract.MSG_EXITED
    attempt: int
    local_rank: int
    pid: int | None = None
    exitcode: int | None = None
    signal: int | None = None
    error: dict[str, Any] | None = None
    tail: tuple[str, ...] = ()
    oom: bool = False

    def as_dict(self) -> dict[str, Any]:
        """The wire form."""
        return {
            "type": self.type,
            "attempt": self.attempt,
            "local_rank": self.local_rank,
            "pid": self.pid,
            "exitcode": self.exitcode,
            "signal": self.signal,
            "error": self.error,
            "tail": list(self.tail),
            "oom": self.oom,
        }


@dataclass(frozen=True)
class Stopped:
    """``{"type": "stopped", "attempt"}``: every worker of ``attempt`` is gone."""

    type: ClassVar[str] = contract.MSG_STOPPED
    attempt: int

    def as_dict(self) -> dict[str, Any]:
        """The wire form."""
        return {"type": self.type, "attempt": self.attempt}


@dataclass(frozen=True)
class Checked:
    """``{"type": "checked", "round", "verdict"}`` or ``{..., "error"}``: the network
    check of ``round`` ended: ``verdict`` is the checker's verdict line (decoded by the
    sidecar with :func:`kelastic.netcheck.decode_verdict`), ``error`` why there is none
    (the checker timed out, died, or could not start; at most :data:`MAX_ERROR_CHARS`
    characters). Exactly one of the two."""

    type: ClassVar[str] = contract.MSG_CHECKED
    round: int
    verdict: str | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The wire form (the one of ``verdict`` and ``error`` that is set)."""
        doc: dict[str, Any] = {"type": self.type, "round": self.round}
        if self.verdict is not None:
            doc["verdict"] = self.verdict
        else:
            doc["error"] = self.error or "no verdict"
        return doc


LauncherMessage = Hello | Started | Exited | Stopped | Checked | Unknown


def _up_int(
    msg: dict[str, Any], name: str, low: int, high: int, *, optional: bool = False
) -> int | None:
    value = msg.get(name)
    if optional and value is None:
        return None
    if type(value) is not int or not low <= value <= high:  # bool is not an int here
        raise ProtocolError(
            f"{msg['type']!r} message needs {name!r} in {low}..{high}, got {value!r:.40}"
        )
    return value


def _up_attempt(msg: dict[str, Any]) -> int:
    value = _up_int(msg, "attempt", 0, MAX_COUNTER)
    assert value is not None
    return value


def _parse_started(msg: dict[str, Any]) -> Started:
    attempt = _up_attempt(msg)
    pids = msg.get("pids")
    if not isinstance(pids, dict) or len(pids) > MAX_NPROC:
        raise ProtocolError("'started' message needs a 'pids' object")
    decoded: dict[int, int] = {}
    for rank, pid in pids.items():
        if not (rank.isascii() and rank.isdigit() and len(rank) <= 5 and int(rank) < MAX_NPROC):
            raise ProtocolError(f"'started' pids has a bad local rank {rank!r:.40}")
        if type(pid) is not int or not 1 <= pid <= MAX_PID:
            raise ProtocolError(f"'started' pids has a bad pid {pid!r:.40}")
        decoded[int(rank)] = pid
    warm = _up_int(msg, "warm", 0, MAX_NPROC, optional=True)
    return Started(attempt=attempt, pids=decoded, warm=warm or 0)


def _parse_exited(msg: dict[str, Any]) -> Exited:
    attempt = _up_attempt(msg)
    local_rank = _up_int(msg, "local_rank", 0, MAX_NPROC - 1)
    assert local_rank is not None
    pid = _up_int(msg, "pid", 1, MAX_PID, optional=True)
    exitcode = _up_int(msg, "exitcode", -(2**31), 2**31 - 1, optional=True)
    sig = _up_int(msg, "signal", 1, 64, optional=True)
    error, tail = msg.get("error"), msg.get("tail")
    if error is not None and not isinstance(error, dict):
        raise ProtocolError("'exited' message: 'error' must be an object or null")
    if tail is not None and not (isinstance(tail, list) and all(isinstance(t, str) for t in tail)):
        raise ProtocolError("'exited' message: 'tail' must be a list of strings or null")
    oom = msg.get("oom", False)
    if type(oom) is not bool:
        raise ProtocolError(f"'exited' message: 'oom' must be true or false, got {oom!r:.40}")
    return Exited(
        attempt=attempt,
        local_rank=local_rank,
        pid=pid,
        exitcode=exitcode,
        signal=sig,
        error=error,
        tail=tuple(tail or ()),
        oom=oom,
    )


def _parse_checked(msg: dict[str, Any]) -> Checked:
    round_ = _up_int(msg, "round", 0, MAX_COUNTER)
    assert round_ is not None
    verdict, error = msg.get("verdict"), msg.get("error")
    if (verdict is None) == (error is None):
        raise ProtocolError("'checked' message needs exactly one of 'verdict' and 'error'")
    if verdict is not None and not (
        isinstance(verdict, str) and 0 < len(verdict.encode()) <= MAX_CHECK_LINE
    ):
        raise ProtocolError(f"'checked' message: 'verdict' must be 1..{MAX_CHECK_LINE} bytes")
    if error is not None and not (isinstance(error, str) and 0 < len(error) <= MAX_ERROR_CHARS):
        raise ProtocolError(f"'checked' message: 'error' must be 1..{MAX_ERROR_CHARS} characters")
    return Checked(round=round_, verdict=verdict, error=error)


def parse_launcher_message(line: bytes) -> LauncherMessage:
    """Decode and validate one line from the launcher (newline excluded).

    The line is decoded by :func:`kelastic._safejson.loads_bounded` (at most
    :data:`kelastic.contract.CONTROL_MAX_LINE` bytes, nested at most 32 deep, integers
    of at most 19 digits, finite numbers). Known types are checked: ``hello`` (``pid``,
    ``nproc`` in 1..:data:`MAX_NPROC`, ``preflight_error`` text, ``netcheck`` bool), ``started``
    (``attempt``, ``pids`` mapping local ranks to pids, ``warm``), ``exited``
    (``attempt``, ``local_rank``, ``pid``, ``exitcode``, ``signal`` in 1..64, ``error``
    object, ``tail`` strings, ``oom`` bool),
    ``stopped`` (``attempt``), ``checked`` (``round``, one of ``verdict`` text and
    ``error`` text). Other types decode as :class:`Unknown` (a string
    ``type`` of 1..64 characters).

    Raises:
        ProtocolError: not bounded JSON, not an object, or a bad field; never another
            exception, whatever ``line`` holds.
    """
    try:
        msg = loads_bounded(line, max_bytes=contract.CONTROL_MAX_LINE)
    except UnsafeJSONError as exc:
        raise ProtocolError(str(exc)) from None
    if not isinstance(msg, dict):
        raise ProtocolError("not a JSON object")
    kind = msg.get("type")
    if not isinstance(kind, str) or not 0 < len(kind) <= _MAX_TYPE_LEN:
        raise ProtocolError("no string 'type'")
    if kind == contract.MSG_HELLO:
        pid = _up_int(msg, "pid", 1, MAX_PID, optional=True)
        error = msg.get("preflight_error")
        if error is not None and not (isinstance(error, str) and 0 < len(error) <= MAX_ERROR_CHARS):
            raise ProtocolError(
                f"'hello' message: 'preflight_error' must be 1..{MAX_ERROR_CHARS} characters"
            )
        nproc = _up_int(msg, "nproc", 1, MAX_NPROC, optional=True)
        netcheck = msg.get("netcheck", False)
        if type(netcheck) is not bool:
            raise ProtocolError(f"'hello' message: 'netcheck' must be true or false, got "
                                f"{netcheck!r:.40}")  # fmt: skip
        return Hello(pid=pid, nproc=nproc, preflight_error=error, netcheck=netcheck)
    if kind == contract.MSG_STARTED:
        return _parse_started(msg)
    if kind == contract.MSG_EXITED:
        return _parse_exited(msg)
    if kind == contract.MSG_STOPPED:
        return Stopped(attempt=_up_attempt(msg))
    if kind == contract.MSG_CHECKED:
        return _parse_checked(msg)
    return Unknown(type=kind)
