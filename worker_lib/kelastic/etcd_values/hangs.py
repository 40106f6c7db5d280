"""A node's hang evidence at :meth:`kelastic.contract.Keys.hang`: bytes <-> document.

Written by a node's sidecar as a hung round ends, before it stops its workers (its
attempt monitor: where each of its workers was, :mod:`kelastic.hang_where`), one value
per node overwritten at each hang; read by the operator, which summarises every node's
evidence of the newest hung round in the job's status and an Event
(:func:`kelastic.hang_where.summarize`)::

    {"round": 3, "node": "job-1",
     "ranks": [{"rank": 2, "local_rank": 0, "pid": 812, "state": "T", "reaped": false,
                "where": "main thread at /w/train.py:231 in _epochs (stacks in ...)",
                "collectives": [{"group": "default_pg", "seq": 4, "name": "gloo:barrier",
                                 "done": true}]}, ...]}

The document is :meth:`HangWhere.as_dict`'s, with its bounds (:func:`decode_where`), in at
most :data:`MAX_HANG_BYTES` bytes nested at most 32 deep. :func:`encode_hang` is strict:
what it writes is read back; a document too long is made to fit by cutting each rank's
``where``, never refused for its length. :func:`decode_hang` refuses anything a writer
could not produce (:class:`CorruptValueError`, nothing else, whatever the bytes). Stdlib
only, no I/O.
"""

from __future__ import annotations

import json
from typing import Any, Final

from kelastic._safejson import load_object
from kelastic.hang_where import HangWhere, decode_where

from ._fields import CorruptValueError

__all__ = ["MAX_HANG_BYTES", "decode_hang", "encode_hang"]

#: Largest value accepted, bytes (under etcd's default request limit of 1.5 MiB).
MAX_HANG_BYTES: Final = 1024 * 1024
#: Fewest characters of a rank's ``where`` kept when a document is cut to fit.
_MIN_WHERE: Final = 16


def _dump(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def encode_hang(where: HangWhere) -> bytes:
    """The value of ``where``: :meth:`HangWhere.as_dict` as compact JSON, each rank's
    ``where`` cut (halved until the value fits in :data:`MAX_HANG_BYTES`, never below
    16 characters) when it would not fit, then the ranks' ``collectives`` dropped.

    Raises:
        CorruptValueError: it cannot fit even so (cannot happen within
            :data:`kelastic.hang_where.MAX_RANKS` ranks).
    """
    doc = where.as_dict()
    raw = _dump(doc)
    share = max(len(r["where"]) for r in doc["ranks"]) if doc["ranks"] else 0
    while len(raw) > MAX_HANG_BYTES and share > _MIN_WHERE:
        share = max(_MIN_WHERE, share // 2)
        for rank in doc["ranks"]:
            rank["where"] = rank["where"][:share]
            rank["state"] = rank["state"][:_MIN_WHERE]
        raw = _dump(doc)
    if len(raw) > MAX_HANG_BYTES:  # then the flight records' collectives go
        for rank in doc["ranks"]:
            rank["collectives"] = []
        raw = _dump(doc)
    if len(raw) > MAX_HANG_BYTES:
        raise CorruptValueError(f"hang evidence of {where.node}: {len(raw)} bytes do not fit")
    return raw


def decode_hang(raw: bytes, where: str = "hang evidence") -> HangWhere:
    """Read a value written by :func:`encode_hang`.

    Raises:
        CorruptValueError: not bounded JSON, not an object, or not what the writer
            produces (a field missing, of another type or out of bounds). Never another
            exception, whatever ``raw`` holds.
    """
    doc = load_object(raw, where, max_bytes=MAX_HANG_BYTES, error=CorruptValueError)
    out = decode_where(doc)
    if out is None:
        raise CorruptValueError(f"{where}: not a hang evidence document: {raw[:80]!r}")
    return out
