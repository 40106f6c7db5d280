"""The checkpoint volume's size: ``spec.checkpoint.memory`` as bytes, and the sidecar's
check at its start that the volume holds that many (stdlib only).

A memory-backed ``emptyDir`` (tmpfs) allocates its pages lazily: a volume whose
``sizeLimit`` the node's memory (or a small ``/dev/shm``) cannot back fails only when a
page is first written, by SIGBUS in the process that writes it. :func:`touch_volume`
allocates the whole size at once (``posix_fallocate`` on tmpfs allocates the pages) and
writes every page, so a volume too small fails at the sidecar's start with
:class:`kelastic.checkpoint.CheckpointSpaceError` naming the bytes needed and free; it
then frees them for the slots (the worker library allocates and touches each slot again
at its first save, with the same check).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path
from typing import Final

from ._slotfile import free_bytes, space_error

__all__ = ["QUANTITY_PATTERN", "parse_quantity", "touch_volume"]

#: The quantities ``spec.checkpoint.memory`` accepts: a positive integer number of bytes
#: with an optional suffix, binary (Ki, Mi, Gi, Ti) or decimal (k, M, G, T), as Kubernetes writes.
QUANTITY_PATTERN: Final = r"^[1-9][0-9]{0,14}(Ki|Mi|Gi|Ti|k|M|G|T)?$"
_UNITS: Final = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
                 "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}  # fmt: skip
_TOUCH_BLOCK: Final = 1 << 20
_NAME: Final = ".kelastic-volume-check"


def parse_quantity(text: str) -> int:
    """Bytes of a quantity such as ``"512Mi"`` or ``"2G"`` (:data:`QUANTITY_PATTERN`).

    Raises:
        ValueError: another form (zero, a fraction, an exponent, another suffix).
    """
    match = re.fullmatch(QUANTITY_PATTERN, text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(
            f"memory {text!r:.40}: expected a positive integer with an optional suffix "
            "Ki, Mi, Gi, Ti, k, M, G or T (e.g. 512Mi)"
        )
    return int(text[: len(text) - len(match.group(1) or "")]) * _UNITS[match.group(1) or ""]


def touch_volume(directory: str | os.PathLike[str], size: int) -> None:
    """Allocate and write ``size`` bytes in ``directory`` (a file made and removed), so a
    volume that cannot hold them fails now, not with SIGBUS at a later save.

    Raises:
        kelastic.checkpoint.CheckpointSpaceError: the folder has less than ``size`` bytes
            free, or the file system refused them (``ENOSPC``, ``ENOMEM``, ``EFBIG``,
            ``EDQUOT``); the message names the bytes needed and free.
        FileNotFoundError: ``directory`` does not exist.
        OSError: another failure.
    """
    folder = Path(directory)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint volume {folder} does not exist")
    what = f"the checkpoint volume's {size} bytes (spec.checkpoint.memory)"
    free = free_bytes(folder)
    if 0 <= free < size:
        raise space_error(folder, size, what)
    path = folder / _NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        zeros = bytes(_TOUCH_BLOCK)
        for offset in range(0, size, _TOUCH_BLOCK):
            os.pwrite(fd, zeros[: min(_TOUCH_BLOCK, size - offset)], offset)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG, errno.EDQUOT):
            raise space_error(folder, size, what, os.strerror(exc.errno)) from exc
        raise
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
