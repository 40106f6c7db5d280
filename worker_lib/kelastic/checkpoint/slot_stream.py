"""A slot's checks applied to its bytes as they arrive, in order: what a fetch from a peer
runs while the transfer goes on (``kelastic_sidecar.replica.fetch_slot``), the same checks
:func:`kelastic.checkpoint.scan.verified_step` makes of a slot file (header, chunk table,
every payload chunk's crc32, manifest), through the format's one codec
(:mod:`.slot_format`). A chunk is checked as soon as its last byte came, so a corrupt one
ends the transfer there. Stdlib only.
"""

from __future__ import annotations

import zlib

from .slot_format import (
    HEADER_SIZE,
    Layout,
    SlotFormatError,
    SlotHeader,
    chunk_crcs,
    decode_header,
    decode_manifest,
)

__all__ = ["SlotStreamCheck", "SlotTornError"]


class SlotTornError(SlotFormatError):
    """The slot's header came uncommitted: it was rewritten while it was sent."""


class SlotStreamCheck:
    """Checks a slot's bytes as they arrive, in order (:meth:`feed`), as
    :func:`kelastic.checkpoint.scan.verified_step` checks a slot file: the header (a
    committed slot of ``rank`` of ``job`` holding ``step``, within ``size`` bytes), the
    chunk table against its crc32, each payload chunk against the table once its last
    byte came, and at :meth:`finish` the manifest. Every failure is a
    :class:`SlotFormatError` naming what failed."""

    def __init__(self, size: int, rank: int, job: str, step: int) -> None:
        self._size, self._rank, self._job, self._step = size, rank, job, step
        self._fed = 0  # bytes fed so far: the next byte's offset in the slot
        self._head = bytearray()  # bytes 0..HEADER_SIZE
        self._table = bytearray()  # the chunk table's bytes
        self._manifest = bytearray()
        self._header: SlotHeader | None = None
        self._crcs: tuple[int, ...] | None = None
        self._crc = 0  # the running crc32 of the chunk being received
        self._chunks = 0  # payload chunks checked
        #: A check or write failed: the bytes after it are not looked at.
        self.failed = False

    def feed(self, data: memoryview) -> None:
        """Check the slot's next ``len(data)`` bytes.

        Raises:
            SlotFormatError: the header, the table or a payload chunk fails its checks.
        """
        offset, self._fed = self._fed, self._fed + len(data)
        if self._crcs is None:
            self._read_prefix(offset, data)
        if self._header is not None and self._crcs is not None:
            lay = self._header.layout
            self._sum(offset, data, lay)
            end = lay.manifest_offset + lay.manifest_len
            _gather(offset, data, lay.manifest_offset, end, self._manifest)

    def _read_prefix(self, offset: int, data: memoryview) -> None:
        """The header, then the table (which precede the payload)."""
        if self._header is None:
            _gather(offset, data, 0, HEADER_SIZE, self._head)
            if len(self._head) < HEADER_SIZE:
                return
            h = decode_header(bytes(self._head), file_size=self._size)
            if h.rank != self._rank or h.job != self._job:
                raise SlotFormatError(f"the header is of rank {h.rank} of job {h.job!r}")
            if not h.seq:  # a server sends committed slots only: a save began over it
                raise SlotTornError("its header came uncommitted")
            if h.step != self._step:
                raise SlotFormatError(f"the slot holds step {h.step}")
            self._header = h
        lay = self._header.layout
        _gather(offset, data, HEADER_SIZE, HEADER_SIZE + 4 * lay.chunk_count, self._table)
        if len(self._table) == 4 * lay.chunk_count:
            if zlib.crc32(self._table) != self._header.table_crc:
                raise SlotFormatError("the checksum table fails its crc32")
            self._crcs = chunk_crcs(bytes(self._table), lay.payload_len, lay.chunk_size)

    def _sum(self, offset: int, data: memoryview, lay: Layout) -> None:
        """Add ``data``'s payload bytes to their chunks' crc32s; check each chunk ended."""
        assert self._crcs is not None
        first, last = lay.payload_offset, lay.payload_offset + lay.payload_len
        pos, stop = max(offset, first), min(offset + len(data), last)
        while pos < stop:
            index = (pos - first) // lay.chunk_size
            chunk_end = min(first + (index + 1) * lay.chunk_size, last)
            upto = min(stop, chunk_end)
            self._crc = zlib.crc32(data[pos - offset : upto - offset], self._crc)
            pos = upto
            if pos == chunk_end:
                if self._crc != self._crcs[index]:
                    begin = index * lay.chunk_size
                    raise SlotFormatError(f"payload chunk {index} (bytes {begin}.."
                                          f"{chunk_end - first}) fails its crc32")  # fmt: skip
                self._crc = 0
                self._chunks += 1

    def piece_end(self, offset: int, limit: int) -> int:
        """Where the slot's next piece from ``offset`` (of at most ``limit`` bytes) ends:
        never past the header's end while the header is unknown, nor past the payload's
        start, a chunk's end or the payload's end (a chunk is checked as soon as its
        last byte came, not when the next buffer is full)."""
        end = min(offset + limit, self._size)
        h = self._header
        if h is None:
            return min(end, HEADER_SIZE)
        lay = h.layout
        first, last = lay.payload_offset, lay.payload_offset + lay.payload_len
        if offset < first:
            return min(end, first)
        if offset < last:
            chunk_end = first + ((offset - first) // lay.chunk_size + 1) * lay.chunk_size
            return min(end, chunk_end, last)
        return end

    @property
    def has_header(self) -> bool:
        """Whether the header came (and passed)."""
        return self._header is not None

    def finish(self) -> SlotHeader:
        """The slot's header, once all ``size`` bytes were fed and passed, and the
        manifest decodes.

        Raises:
            SlotFormatError: bytes are missing, or the manifest fails its checks.
        """
        h = self._header
        if self._fed != self._size or h is None or self._crcs is None:
            raise SlotFormatError(f"{self._fed} of {self._size} bytes were checked")
        if self._chunks != h.layout.chunk_count:
            raise SlotFormatError(f"{self._chunks} of {h.layout.chunk_count} chunks checked")
        if zlib.crc32(self._manifest) != h.manifest_crc:
            raise SlotFormatError("the manifest fails its crc32")
        decode_manifest(bytes(self._manifest), payload_len=h.layout.payload_len)
        return h


def _gather(offset: int, data: memoryview, lo: int, hi: int, into: bytearray) -> None:
    """Append the bytes of ``[lo, hi)`` in ``data`` (the slot's bytes from ``offset``)
    to ``into`` (which holds that range's bytes before ``offset``)."""
    begin, end = max(lo, offset), min(hi, offset + len(data))
    if begin < end:
        into += data[begin - offset : end - offset]
