"""A node's stragglers at :meth:`kelastic.contract.Keys.straggler`: bytes <-> document.

Written by the node's sidecar each time a straggler episode begins or ends (its step
times, ``kelastic_sidecar.steptime``: a local rank whose median step exceeds the factor
times its node's other ranks' median), read by the operator (``status.stragglers``, and
``spec.stragglers.action: Replace``)::

    {"node": "job-1", "pod_uid": "6c1f...", "time": 1718000000.0,
     "stragglers": [{"local_rank": 1, "scope": "train_step", "median_s": 0.31,
                     "others_median_s": 0.1, "ratio": 3.1}]}

``stragglers`` empty: none now (an episode ended). ``pod_uid`` names the Pod incarnation
whose sidecar wrote it (``""`` outside Kubernetes), so that a reader can tell a verdict
of an earlier Pod of the same name; ``time`` is when the verdict was taken (the sidecar's
clock).

Bounds (every reader and the writer alike): at most :data:`MAX_STRAGGLERS_BYTES` bytes
nested at most 32 deep; ``node`` a name of 1..1024 characters; ``pod_uid`` at most 128
characters; ``time`` in 0..1e11;
at most :data:`MAX_STRAGGLERS` entries (the writer keeps the highest ratios), each with
``local_rank`` in 0..2**31-1, ``scope`` at most :data:`MAX_SCOPE` characters, finite
``median_s`` and ``others_median_s`` >= 0 and ``ratio`` > 0 (at most 1e9).
:func:`encode_stragglers` is strict, :func:`decode_stragglers` refuses what it could not
write (:class:`CorruptValueError`, nothing else, whatever the bytes). Stdlib only, no I/O.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Final, TypedDict

from kelastic._safejson import is_int, load_object

from ._fields import CorruptValueError, is_name, is_text, is_time

__all__ = [
    "MAX_SCOPE",
    "MAX_STRAGGLERS",
    "MAX_STRAGGLERS_BYTES",
    "StragglersDoc",
    "decode_stragglers",
    "encode_stragglers",
]

#: Most stragglers one value holds (the highest ratios).
MAX_STRAGGLERS: Final = 64
#: Longest scope name, characters.
MAX_SCOPE: Final = 256
#: Largest value accepted, bytes.
MAX_STRAGGLERS_BYTES: Final = 64 * 1024
_MAX_SECONDS: Final = 1e9
#: Longest Pod uid, characters (Kubernetes' are 36).
MAX_UID: Final = 128


class StragglersDoc(TypedDict):
    """The value's document (the module doc's layout)."""

    node: str
    pod_uid: str
    time: float
    stragglers: list[dict[str, Any]]


def _seconds(value: object, *, positive: bool = False) -> bool:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value):  # type: ignore[arg-type]
        return False
    return (value > 0 if positive else value >= 0) and value <= _MAX_SECONDS  # type: ignore[operator]


def _entry_ok(entry: object) -> bool:
    return (
        isinstance(entry, Mapping)
        and set(entry) == {"local_rank", "scope", "median_s", "others_median_s", "ratio"}
        and is_int(entry["local_rank"], 0, 2**31 - 1)
        and is_text(entry["scope"], MAX_SCOPE)
        and _seconds(entry["median_s"])
        and _seconds(entry["others_median_s"])
        and _seconds(entry["ratio"], positive=True)
    )


def _check(doc: Mapping[str, Any], where: str) -> StragglersDoc:
    if set(doc) != {"node", "pod_uid", "time", "stragglers"}:
        raise CorruptValueError(
            f"{where}: fields must be node, pod_uid, time, stragglers: {sorted(doc)}"
        )
    node, uid, at, found = doc["node"], doc["pod_uid"], doc["time"], doc["stragglers"]
    if not is_name(node) or not is_text(uid, MAX_UID) or not is_time(at):
        raise CorruptValueError(f"{where}: 'node' must be a name, 'pod_uid' a text, 'time' a time")
    if not isinstance(found, list) or len(found) > MAX_STRAGGLERS:
        raise CorruptValueError(f"{where}: 'stragglers' must be a list of <= {MAX_STRAGGLERS}")
    if not all(_entry_ok(e) for e in found):
        raise CorruptValueError(
            f"{where}: each straggler needs local_rank, scope, median_s, others_median_s and "
            f"a ratio, within bounds: {found!r:.200}"
        )
    return {"node": node, "pod_uid": uid, "time": float(at),
            "stragglers": [dict(e) for e in found]}  # fmt: skip


def encode_stragglers(
    node: str, pod_uid: str, time: float, stragglers: list[dict[str, Any]]
) -> bytes:
    """The value for ``node``'s ``stragglers`` (entries as the module doc's; the highest
    :data:`MAX_STRAGGLERS` ratios kept, scopes cut to :data:`MAX_SCOPE` characters).

    Raises:
        CorruptValueError: a field outside the bounds (a NaN, a negative time...).
    """
    entries = [{**e, "scope": e["scope"][:MAX_SCOPE]} if isinstance(e.get("scope"), str)
               else dict(e) for e in stragglers]  # fmt: skip
    if not all(_entry_ok(e) for e in entries):
        raise CorruptValueError(f"stragglers of {node}: an entry out of bounds: {entries!r:.200}")
    kept = sorted(entries, key=lambda e: -e["ratio"])[:MAX_STRAGGLERS]
    doc = _check({"node": node, "pod_uid": pod_uid, "time": time, "stragglers": kept}, "stragglers")
    raw = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    if len(raw) > MAX_STRAGGLERS_BYTES:  # cannot happen within the entries' bounds
        raise CorruptValueError(f"stragglers of {node}: {len(raw)} bytes")
    return raw


def decode_stragglers(raw: bytes, where: str = "stragglers") -> StragglersDoc:
    """Read a value written by :func:`encode_stragglers`.

    Raises:
        CorruptValueError: not what the writer produces. Never another exception.
    """
    doc = load_object(raw, where, max_bytes=MAX_STRAGGLERS_BYTES, error=CorruptValueError)
    return _check(doc, where)
