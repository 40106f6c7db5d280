"""The sidecar's last word: its final ``/status`` document, kept in the run volume as it
exits (:func:`write_last_status`), for whoever reads what a node said after its HTTP
server is gone (:func:`read_last_status`; ``kelastic run`` says from it what the loop's
last poll missed, e.g. a straggler episode begun in the job's last steps).

One codec for both sides: the writer's bytes are JSON without ``NaN``/``Infinity``
(``json.dumps(allow_nan=False)``); the reader takes them through
:func:`kelastic._safejson.load_object` (size, depth and number bounds), so a crafted or
torn file raises :class:`LastStatusError` and nothing else. The file is replaced
atomically (a temporary file, then ``rename``): a reader sees the old document or the new
one, never half of one. Where it lives: :data:`LAST_STATUS_NAME` in the run dir
(:func:`kelastic.contract.run_dir`), the volume both containers share, so it outlives the
sidecar's process but not the Pod (an ``emptyDir``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

from kelastic._safejson import load_object

__all__ = [
    "LAST_STATUS_NAME",
    "MAX_BYTES",
    "LastStatusError",
    "decode_last_status",
    "encode_last_status",
    "keep_last_status",
    "read_last_status",
    "write_last_status",
]

logger = logging.getLogger("kelastic.last_status")

#: The file's name in the run dir.
LAST_STATUS_NAME: Final = "sidecar-status.json"
#: Largest document written or read, bytes (a node's ``/status`` is a few KiB).
MAX_BYTES: Final = 1 << 20


class LastStatusError(ValueError):
    """A last-status document that is not one (not bounded JSON, not an object, too
    big); the message says why and shows its first bytes."""


def encode_last_status(doc: Mapping[str, Any]) -> bytes:
    """The file's bytes for ``doc`` (a ``/status`` document: JSON types only).

    Raises:
        LastStatusError: ``doc`` is not JSON-encodable, holds ``NaN`` or an infinity,
            or encodes to more than :data:`MAX_BYTES` bytes.
    """
    try:
        raw = json.dumps(dict(doc), allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError, RecursionError) as exc:
        raise LastStatusError(f"not a JSON document: {exc}") from None
    if len(raw) > MAX_BYTES:
        raise LastStatusError(f"{len(raw)} bytes, over the {MAX_BYTES}-byte limit")
    return raw


def decode_last_status(raw: bytes, where: str = LAST_STATUS_NAME) -> dict[str, Any]:
    """The document in ``raw`` (see the module doc).

    Raises:
        LastStatusError: not bounded JSON or not an object; the message names ``where``.
    """
    return load_object(raw, where, max_bytes=MAX_BYTES, error=LastStatusError)


def write_last_status(run_dir: Path, doc: Mapping[str, Any]) -> Path:
    """Replace ``run_dir``'s last-status file with ``doc`` atomically; returns its path.

    Raises:
        LastStatusError: ``doc`` cannot be encoded (:func:`encode_last_status`).
        OSError: the run dir cannot be written (the old file, if any, stays whole).
    """
    raw = encode_last_status(doc)
    path = run_dir / LAST_STATUS_NAME
    tmp = path.with_name(f".{LAST_STATUS_NAME}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(raw)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def keep_last_status(run_dir: Path, status: Callable[[], Mapping[str, Any]]) -> bool:
    """The sidecar's exit: :func:`write_last_status` of ``status()``; True when kept.
    Best effort: any failure (the document, the disk, or ``status`` itself raising on a
    part half-stopped by the exception that ends the sidecar) is logged as a warning,
    never raised over the exit's own outcome."""
    try:
        write_last_status(run_dir, status())
    except Exception as exc:
        logger.warning("could not keep the last status in %s: %s", run_dir, exc)
        return False
    return True


def read_last_status(run_dir: Path) -> dict[str, Any] | None:
    """``run_dir``'s last-status document, or None when there is none (the sidecar has
    not exited, or died before it could write it: SIGKILL, OOM).

    Raises:
        LastStatusError: the file is not a document (:func:`decode_last_status`) or
            larger than :data:`MAX_BYTES` (not read past that bound).
        OSError: it exists but cannot be read.
    """
    path = run_dir / LAST_STATUS_NAME
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    return decode_last_status(raw, str(path))
