"""Slot files: allocated and touched in full up front, memory-mapped, locked per rank.

A slot file on a tmpfs (a memory-backed ``emptyDir``, ``/dev/shm``) whose pages are
allocated lazily fails with SIGBUS at the first write into a page the file system cannot
provide, long after the file was made (DLRover and ML Flashpoint hit it with Docker's
64 MB ``/dev/shm``). :meth:`SlotFile.grow` therefore checks the folder's free space
first (``statvfs``), allocates with ``os.posix_fallocate`` (tmpfs allocates and charges
the pages there, or fails with ``ENOSPC``) and writes zeros over every new page, so a
folder too small fails at once with :class:`CheckpointSpaceError` naming the bytes
needed. Pages a file already has (a restarted rank opening its slots again) are not
rewritten: they were touched when they were made, and they hold the checkpoints. The
pages are charged to the memory cgroup of the process that touches them (here the
trainer's container; the sidecar, once it keeps the slots, its own). Stdlib only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Final

from .slot_format import HEADER_SIZE

#: Zeros written per call when touching new pages.
_TOUCH_BLOCK: Final = 1 << 20
_SPACE_ERRNOS: Final = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.ENOMEM}


#: A slot file's mode: its writer's, and readable by the sidecar, which checks the slots
#: and may run as another user (as root with only CAP_KILL when the operator does not
#: know the trainer's user). Only the Pod's containers mount the folder.
SLOT_MODE: Final = 0o644


#: Slots per rank (:mod:`kelastic.checkpoint.store`'s doc says why three).
SLOTS: Final = 3
#: A slot file's name: ``rank-<rank>.slot<slot>`` (group 1 the rank, 2 the slot).
SLOT_NAME: Final = re.compile(r"rank-(0|[1-9][0-9]{0,9})\.slot([0-9])")


def slot_path(directory: Path, rank: int, slot: int) -> Path:
    """``<directory>/rank-<rank>.slot<0..SLOTS-1>``."""
    return directory / f"rank-{rank}.slot{slot}"


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, or a store could not be opened."""


class CheckpointRestoreError(CheckpointError):
    """This rank cannot load the step the job agreed to restore (its slot fails its
    checks now, the persisted folder is gone or unreadable). Raised rather than loading
    nothing while the other ranks load the step: the worker fails, and at the next round
    the sidecars agree again without it (an older step, the disk, or none): never a
    mixed restore."""


class CheckpointSpaceError(CheckpointError):
    """The checkpoint folder cannot hold the slots (too small, a file size limit, a quota).

    Attributes:
        needed: bytes the slots need beyond what they hold (every slot at open).
        free: bytes the folder had free (``statvfs``), or -1 when unknown.
        directory: the folder.
    """

    def __init__(self, message: str, needed: int, free: int, directory: Path) -> None:
        super().__init__(message)
        self.needed = needed
        self.free = free
        self.directory = directory


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged writer may still allocate in ``directory`` (-1: unknown)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


def space_error(directory: Path, needed: int, what: str, cause: str = "") -> CheckpointSpaceError:
    """The error for ``needed`` more bytes the folder cannot give (message names all)."""
    free = free_bytes(directory)
    mib = needed / 2**20
    message = (
        f"the checkpoint folder {directory} cannot hold {what}: {needed} more bytes "
        f"({mib:.1f} MiB) are needed, {free} bytes are free"
        + (f" ({cause})" if cause else "")
        + "; give the memory volume more room (its sizeLimit, and the container's memory "
        "limit, which its pages count against) or save less per rank"
    )
    return CheckpointSpaceError(message, needed, free, directory)


class SlotFile:
    """One slot file, mapped shared (``MAP_SHARED``): writes are in the file at once,
    visible to other processes and kept when this one dies.

    Args:
        path: the file; created (mode :data:`SLOT_MODE`) when ``writable`` and missing.
        writable: map it for writing (the rank's writer) or read only (a reader).
    """

    def __init__(self, path: Path, writable: bool) -> None:
        self.path = path
        self.writable = writable
        flags = os.O_RDWR | os.O_CREAT if writable else os.O_RDONLY
        self.fd = os.open(path, flags | os.O_CLOEXEC, SLOT_MODE)
        # a SlotFile dropped unclosed gives its descriptor back when collected
        self._release = weakref.finalize(self, os.close, self.fd)
        if writable:  # whatever the umask: the sidecar reads them, maybe as another user
            with contextlib.suppress(OSError):  # a file of another owner keeps its mode
                os.fchmod(self.fd, SLOT_MODE)
        self.size = os.fstat(self.fd).st_size
        self.map: mmap.mmap | None = None
        #: Called with the map before it is unmapped (the CUDA path unregisters it).
        self.before_unmap: Callable[[mmap.mmap], None] | None = None
        self._map()

    def _unmap(self) -> None:
        if self.map is not None:
            if self.before_unmap is not None:
                self.before_unmap(self.map)
            self.map.close()
            self.map = None

    def _map(self) -> None:
        if self.size < HEADER_SIZE:
            return
        if self.writable:  # page tables filled now (MAP_POPULATE), not by faults in a save
            populate = getattr(mmap, "MAP_POPULATE", 0)
            self.map = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED | populate,
                                 prot=mmap.PROT_READ | mmap.PROT_WRITE)  # fmt: skip
        else:
            self.map = mmap.mmap(self.fd, self.size, access=mmap.ACCESS_READ)

    def grow(self, size: int) -> None:
        """Make the file ``size`` bytes or more: allocate (``posix_fallocate``), write zeros
        over every new page, map it again. The caller has checked the folder's free space
        (:func:`space_error` names what is missing); the map must have no buffer exported.

        Raises:
            CheckpointSpaceError: the file system refused (``ENOSPC``, ``EFBIG`` past
                ``RLIMIT_FSIZE``, ``EDQUOT``, ``ENOMEM``); the file keeps its old size.
            OSError: another failure.
        """
        if size <= self.size:
            return
        old = self.size
        self._unmap()
        try:
            os.posix_fallocate(self.fd, old, size - old)
            zeros = bytes(_TOUCH_BLOCK)
            for offset in range(old, size, _TOUCH_BLOCK):
                os.pwrite(self.fd, zeros[: min(_TOUCH_BLOCK, size - offset)], offset)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, old)
            self._map()
            if exc.errno in _SPACE_ERRNOS:
                what = f"{self.path.name} of {size} bytes"
                raise space_error(
                    self.path.parent, size - old, what, os.strerror(exc.errno)
                ) from exc
            raise
        self.size = size
        self._map()

    def refresh(self) -> None:
        """Map the file again if another process resized it (a reader's view)."""
        size = os.fstat(self.fd).st_size
        if size != self.size:
            self._unmap()
            self.size = size
            self._map()

    def read(self, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` (the caller checked the range is in the file)."""
        assert self.map is not None
        return self.map[offset : offset + length]

    def write(self, offset: int, data: bytes) -> None:
        assert self.map is not None
        self.map[offset : offset + len(data)] = data

    def flush(self, offset: int = 0, length: int = 0) -> None:
        """``msync(MS_SYNC)`` of the range (all with ``length == 0``): on a disk-backed
        folder the bytes reach the disk before the next write is ordered after them; on
        tmpfs it returns at once (the pages are the file)."""
        if self.map is not None:
            if length:
                self.map.flush(offset, length)
            else:
                self.map.flush()

    def close(self) -> None:
        """Unmap the slot and close its descriptor (once, however often called).

        Raises:
            BufferError: a view of the map is still alive (the map stays until the view
                goes); the descriptor is closed all the same.
        """
        try:
            self._unmap()
        finally:
            self._release()
            self.fd = -1


def lock_rank(path: Path) -> int:
    """Take the rank's writer lock: a POSIX record lock (``lockf``), released when the
    process dies and not inherited by its forked children (a DataLoader worker that
    outlives a killed trainer for a moment does not keep the restarted rank out).

    Returns:
        the lock file's descriptor (close it to release).

    Raises:
        CheckpointError: another live process holds it (two writers would tear slots).
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise CheckpointError(
            f"another process (pid {holder or '?'}) writes these slots ({path}): one writer "
            "per rank"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd
