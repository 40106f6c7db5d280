"""The rendezvous state at :attr:`kelastic.contract.Keys.rdzv_state` and the departure
notices at :meth:`kelastic.contract.Keys.departing`: bytes <-> document.

The state (``version`` 1; written by the sidecars by compare-and-set, read by them and by
the operator)::

    {"version": 1, "run_id": "u1", "round": 4, "complete": true, "deadline": null,
     "closed": false, "closed_reason": null, "participants": {"j-0": 0, "j-1": 1},
     "wait_list": [], "redundancy_list": [], "departed": {}, "lost": []}

Bounds (every reader and the writer alike): at most :data:`MAX_STATE_BYTES` bytes nested
at most 32 deep, integers of at most 19 digits, finite numbers
(:func:`kelastic._safejson.loads_bounded`); ``round`` in 0..:data:`MAX_ROUND`, ranks in
0..:data:`MAX_RANK`, ``deadline`` null or in 0..:data:`MAX_DEADLINE` seconds since the
epoch, names (``run_id``, nodes) of 1..:data:`MAX_NAME_LEN` characters and departure
reasons of at most that many; no node both participant and waiting (or on both wait
lists), no node twice in a list, distinct ranks in a complete round.

- :func:`encode_state` (the sidecars' writer) is strict: it refuses a document outside
  the bounds (:class:`CorruptValueError`), so nothing written is refused when read back.
- :func:`decode_state` (the sidecars' reader) is strict too: every field, no unknown one,
  this version, and the run asked for (:class:`ForeignValueError` for another version or
  run: a state that is not to be overwritten).
- :func:`decode_state` with ``partial`` (the operator's reader: it reports, the sidecars
  decide) tolerates missing and unknown fields and another version, so that a state of an
  older or newer sidecar still shows its round; each field it finds is held to the same
  bounds, so a value no writer could produce is refused by it too.

The document is :class:`StateDoc`; the sidecar's rendezvous keeps its own state class
and transitions (``kelastic_sidecar.rendezvous.state``) and converts.

A departure notice (written by the operator before it removes a node on purpose, read by
the sidecars) is the reason as UTF-8 text, e.g. ``scale_down``: :func:`encode_departure`
refuses a reason that is no name; :func:`decode_departure` reads any bytes, cut to
:data:`MAX_NAME_LEN` characters (a longer one recorded in the state as the node's
departure would make the state one no reader accepts). Stdlib only, no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final, TypedDict

from kelastic._safejson import is_int, load_object

from ._fields import MAX_NAME_LEN, CorruptValueError, ForeignValueError, is_name, is_time

__all__ = [
    "MAX_DEADLINE",
    "MAX_RANK",
    "MAX_ROUND",
    "MAX_STATE_BYTES",
    "STATE_VERSION",
    "StateDoc",
    "decode_departure",
    "decode_state",
    "encode_departure",
    "encode_state",
]

#: Version of the state this codec reads and writes.
STATE_VERSION: Final = 1
#: Largest state accepted, bytes (etcd's default request limit is 1.5 MiB).
MAX_STATE_BYTES: Final = 2 * 1024 * 1024
#: Highest round number (2**53: exact as a float, so every JSON reader agrees on it).
MAX_ROUND: Final = 2**53
#: Highest rank of a node.
MAX_RANK: Final = 2**20
#: Latest deadline accepted, seconds since the epoch (year 5138).
MAX_DEADLINE: Final = 1e11


class StateDoc(TypedDict, total=False):
    """The state's document (the module doc's layout). :func:`decode_state` returns every
    field (but with ``partial``: those present); :func:`encode_state` needs every field
    but ``version`` (the codec's own)."""

    version: int
    run_id: str
    round: int
    complete: bool
    deadline: float | None
    closed: bool
    closed_reason: dict[str, Any] | None
    participants: dict[str, int]
    wait_list: list[str]
    redundancy_list: list[str]
    departed: dict[str, str]
    lost: list[str]


_FIELDS: Final = tuple(StateDoc.__annotations__)
_LISTS: Final = ("wait_list", "redundancy_list", "lost")


def _names(value: object, name: str, where: str) -> list[str]:
    if not isinstance(value, list) or not all(is_name(n) for n in value):
        raise CorruptValueError(f"{where}: '{name}' must be a list of node names")
    if len(set(value)) != len(value):
        raise CorruptValueError(f"{where}: '{name}' lists a node twice")
    return list(value)


def _deadline(value: object, where: str) -> float | None:
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise CorruptValueError(f"{where}: 'deadline' must be a number or null")
    if not is_time(value) or value > MAX_DEADLINE:
        raise CorruptValueError(f"{where}: 'deadline' {value!r} is out of range")
    return float(value)


def _version(doc: Mapping[str, Any], where: str, partial: bool) -> None:
    if partial and "version" not in doc:
        return
    version = doc.get("version")
    if not is_int(version, 1):
        raise CorruptValueError(f"{where}: no state version: {str(doc)[:80]}")
    if version != STATE_VERSION and not partial:
        raise ForeignValueError(
            f"{where}: state version {version}, this kelastic reads {STATE_VERSION}"
        )


def _field(name: str, value: object, where: str) -> Any:
    if name == "version":
        return value
    if name == "run_id":
        if not is_name(value):
            raise CorruptValueError(f"{where}: 'run_id' must be a non-empty string")
        return value
    if name == "round":
        if not is_int(value, 0, MAX_ROUND):
            raise CorruptValueError(f"{where}: 'round' must be an integer in 0..{MAX_ROUND}")
        return value
    if name in ("complete", "closed"):
        if not isinstance(value, bool):
            raise CorruptValueError(f"{where}: '{name}' must be true or false")
        return value
    if name == "deadline":
        return _deadline(value, where)
    if name == "closed_reason":
        if value is not None and not isinstance(value, dict):
            raise CorruptValueError(f"{where}: 'closed_reason' must be an object or null")
        return value
    if name == "participants":
        if not isinstance(value, dict) or not all(
            is_name(n) and is_int(r, 0, MAX_RANK) for n, r in value.items()
        ):
            raise CorruptValueError(
                f"{where}: 'participants' must map node names to ranks in 0..{MAX_RANK}"
            )
        return dict(value)
    if name == "departed":
        if not isinstance(value, dict) or not all(
            is_name(n) and isinstance(r, str) and len(r) <= MAX_NAME_LEN for n, r in value.items()
        ):
            raise CorruptValueError(f"{where}: 'departed' must map node names to reasons")
        return dict(value)
    return _names(value, name, where)


def _consistent(doc: StateDoc, where: str) -> None:
    members = set(doc.get("participants", {}))
    wait, spare = set(doc.get("wait_list", ())), set(doc.get("redundancy_list", ()))
    if members & wait or members & spare or wait & spare:
        raise CorruptValueError(f"{where}: a node is listed both as participant and waiting")
    ranks = list(doc.get("participants", {}).values())
    if doc.get("complete") and len(set(ranks)) != len(ranks):
        raise CorruptValueError(f"{where}: ranks of a complete round must be distinct")


def check_state(
    doc: Mapping[str, Any], where: str, *, run_id: str | None = None, partial: bool = False
) -> StateDoc:
    """Validate a decoded state document (the module doc's bounds); see :func:`decode_state`.

    Raises:
        CorruptValueError, ForeignValueError: as :func:`decode_state`.
    """
    _version(doc, where, partial)
    missing, unknown = set(_FIELDS) - doc.keys(), doc.keys() - set(_FIELDS)
    if (missing or unknown) and not partial:
        raise CorruptValueError(
            f"{where}: missing fields {sorted(missing)}, unknown fields {sorted(unknown)[:10]}"
        )
    checked: dict[str, Any] = {}
    for name in _FIELDS:
        if name in doc:
            checked[name] = _field(name, doc[name], where)
        if name == "run_id" and run_id is not None and doc.get(name, run_id) != run_id:
            raise ForeignValueError(
                f"{where}: belongs to run {doc['run_id']!r}, not {run_id!r} (stale or shared key?)"
            )
    state: StateDoc = checked  # type: ignore[assignment]  # each field checked above
    _consistent(state, where)
    return state


def decode_state(
    raw: bytes, *, run_id: str | None = None, where: str = "state", partial: bool = False
) -> StateDoc:
    """Parse and validate a state written by :func:`encode_state`.

    Args:
        raw: the bytes read from etcd.
        run_id: when given, the state must belong to this run.
        where: the etcd key, for error messages.
        partial: the tolerant reader (the module doc): only the fields present, each
            checked; unknown fields and another version are let through.

    Returns:
        The document (every field of :class:`StateDoc`; with ``partial``, those present).

    Raises:
        CorruptValueError: not bounded JSON, not an object, a missing/unknown/ill-typed
            field (those present, with ``partial``), a bound broken, inconsistent lists.
        ForeignValueError: another version (not with ``partial``), or another run (when
            ``run_id`` is given). Never another exception, whatever ``raw`` holds.
    """
    doc = load_object(raw, where, max_bytes=MAX_STATE_BYTES, error=CorruptValueError)
    return check_state(doc, where, run_id=run_id, partial=partial)


def encode_state(doc: StateDoc) -> bytes:
    """Serialize a state document (deterministic: maps and lists sorted), with this
    codec's :data:`STATE_VERSION`.

    Raises:
        CorruptValueError: a field missing or outside the module doc's bounds, or a
            ``closed_reason`` that is no JSON (strict: what is written is never refused
            when read).
    """
    where = "rendezvous state to write"
    full: dict[str, Any] = dict(check_state({**doc, "version": STATE_VERSION}, where))
    ordered = {name: full[name] for name in _FIELDS}
    for name in ("participants", "departed"):
        ordered[name] = dict(sorted(ordered[name].items()))
    for name in _LISTS:
        ordered[name] = sorted(ordered[name])
    try:
        raw = json.dumps(ordered, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:  # a closed_reason that is no JSON
        raise CorruptValueError(f"{where}: not JSON: {exc}") from None
    decode_state(raw, where=where)  # bounds of the whole (size, depth)
    return raw


def encode_departure(reason: str) -> bytes:
    """A departure notice's value: ``reason`` as UTF-8.

    Raises:
        CorruptValueError: ``reason`` is not a string of 1..:data:`MAX_NAME_LEN` characters.
    """
    if not is_name(reason):
        raise CorruptValueError(f"departure reason must be 1..{MAX_NAME_LEN} characters: "
                                f"{reason!r:.80}")  # fmt: skip
    return reason.encode()


def decode_departure(raw: bytes) -> str:
    """A departure notice's reason: ``raw`` as UTF-8 (an undecodable byte becomes U+FFFD),
    cut to :data:`MAX_NAME_LEN` characters. Never raises."""
    return raw.decode("utf-8", errors="replace")[:MAX_NAME_LEN]
