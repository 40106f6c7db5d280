"""Keys and transactions: reads, writes, compare-and-set, all in single etcd requests.

Semantics used by the rendezvous (see the architecture notes, "Rendezvous"): a
compare-and-set on a key's ``mod_revision`` in one etcd transaction
(:meth:`KV.cas_read`); a write whose outcome is unknown may still have happened, so a
retried compare-and-set compares the value it finds with the value it meant to write.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pyetcd import etcdrpc

from .call import Connection, Endpoint


@dataclass(frozen=True)
class Snapshot:
    """Keys read together in one etcd transaction, consistent at one revision.

    Attributes:
        revision: the store revision the read saw; pass it to
            :meth:`EtcdClient.wait_change` to wait for anything newer.
        values: key -> (value, mod_revision) for every key that exists.
    """

    revision: int
    values: dict[str, tuple[bytes, int]]


def prefix_end(prefix: bytes) -> bytes:
    """The range end that selects every key starting with ``prefix`` (etcd's rule)."""
    end = bytearray(prefix)
    for i in reversed(range(len(end))):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


def key_range(key_or_prefix: str) -> tuple[bytes, bytes]:
    """(key, range_end) for an exact key, or for a prefix when it ends with ``/``."""
    if not key_or_prefix:
        raise ValueError("an etcd key or prefix must not be empty")
    raw = key_or_prefix.encode()
    return (raw, prefix_end(raw)) if key_or_prefix.endswith("/") else (raw, b"")


def items_of(keys_or_prefixes: Sequence[str]) -> list[str]:
    """The keys and prefixes of a read, a single string being one item."""
    return [keys_or_prefixes] if isinstance(keys_or_prefixes, str) else list(keys_or_prefixes)


def range_ops(items: Sequence[str], keys_only: Sequence[str] = ()) -> list[Any]:
    """One transaction range operation per key or prefix (see :func:`_range`); those also
    in ``keys_only`` come back without their values."""
    ops = []
    for item in items:
        key, end = key_range(item)
        request = etcdrpc.RangeRequest(key=key, range_end=end, keys_only=item in keys_only)
        ops.append(etcdrpc.RequestOp(request_range=request))
    return ops


def snapshot(resp: Any) -> Snapshot:
    """The keys that the range operations of a transaction response found."""
    values: dict[str, tuple[bytes, int]] = {}
    for op in resp.responses:
        if op.WhichOneof("response") != "response_range":
            continue
        for kv in op.response_range.kvs:
            values[kv.key.decode()] = (bytes(kv.value), int(kv.mod_revision))
    return Snapshot(int(resp.header.revision), values)


class KV(Connection):
    """Key-value operations over a :class:`~kelastic_etcd.call.Connection`.

    Every method raises :class:`~kelastic_etcd.errors.EtcdUnavailable` when etcd cannot
    serve it within ``timeout`` and :class:`~kelastic_etcd.errors.EtcdRefused` when etcd
    refuses it (e.g. more operations than ``--max-txn-ops``).
    """

    def get(self, key: str) -> tuple[bytes, int] | None:
        """Return ``(value, mod_revision)`` of ``key``, or ``None`` when it does not exist."""
        req = etcdrpc.RangeRequest(key=key.encode())
        resp = self.call(f"get({key!r})", lambda ep, t: ep.kv.Range(req, timeout=t))
        if not resp.kvs:
            return None
        kv = resp.kvs[0]
        return bytes(kv.value), int(kv.mod_revision)

    def get_prefix(self, prefix: str) -> dict[str, tuple[bytes, int]]:
        """Return ``{key: (value, mod_revision)}`` for every key starting with ``prefix``."""
        if not prefix:
            raise ValueError("prefix must not be empty")
        raw = prefix.encode()
        req = etcdrpc.RangeRequest(key=raw, range_end=prefix_end(raw))
        resp = self.call(f"get_prefix({prefix!r})", lambda ep, t: ep.kv.Range(req, timeout=t))
        return {kv.key.decode(): (bytes(kv.value), int(kv.mod_revision)) for kv in resp.kvs}

    def read(self, keys_or_prefixes: Sequence[str], *, keys_only: Sequence[str] = ()) -> Snapshot:
        """Read several keys and prefixes atomically (one transaction, one revision).

        An item ending with ``/`` is a prefix, anything else an exact key. Items also
        listed in ``keys_only`` are read without their values (``b""`` in the snapshot).
        """
        items = items_of(keys_or_prefixes)
        req = etcdrpc.TxnRequest(compare=[], success=range_ops(items, keys_only), failure=[])
        resp = self.call(f"read({items!r})", lambda ep, t: ep.kv.Txn(req, timeout=t))
        return snapshot(resp)

    def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        """Write ``value`` at ``key``, bound to ``lease`` (an id) when given.

        Raises:
            EtcdLeaseNotFound: the lease has expired or was revoked.
        """
        req = etcdrpc.PutRequest(key=key.encode(), value=value, lease=lease or 0)
        self.call(f"put({key!r})", lambda ep, t: ep.kv.Put(req, timeout=t))

    def put_read(
        self,
        puts: Mapping[str, bytes],
        read: Sequence[str],
        lease: int | None = None,
        *,
        keys_only: Sequence[str] = (),
    ) -> Snapshot:
        """Write keys (bound to ``lease`` when given), then read, in one transaction: one
        request instead of :meth:`put` calls and a :meth:`read`.

        Args:
            puts: key -> the bytes written there.
            read: keys and prefixes (ending with ``/``) read after the writes.
            lease: the lease id the keys are bound to.
            keys_only: items of ``read`` read without their values (``b""``).

        Returns:
            the items of ``read`` as of the writes (them included), at their revision.

        Raises:
            EtcdLeaseNotFound: the lease has expired or was revoked (nothing written).
        """
        writes = [
            etcdrpc.RequestOp(
                request_put=etcdrpc.PutRequest(key=key.encode(), value=value, lease=lease or 0)
            )
            for key, value in puts.items()
        ]
        reads = range_ops(items_of(read), keys_only)
        req = etcdrpc.TxnRequest(compare=[], success=[*writes, *reads], failure=[])
        resp = self.call(f"put_read({list(puts)!r})", lambda ep, t: ep.kv.Txn(req, timeout=t))
        return snapshot(resp)

    def cas(
        self, key: str, value: bytes, expected_mod_revision: int | None
    ) -> tuple[bool, bytes | None, int]:
        """Compare-and-set in one etcd transaction (one request, even when it fails).

        Writes ``value`` if the key's ``mod_revision`` equals ``expected_mod_revision``,
        or, when that is ``None``, only if the key does not exist.

        Returns:
            ``(ok, current value, current mod_revision)``: after a successful write the
            value written and its new revision; otherwise what the key holds now, read
            in the same transaction (``None`` and ``0`` when it does not exist).

        A try whose outcome is unknown (connection lost mid-call) is retried; when the
        retry finds exactly ``value`` in place, the first try is taken to have won.
        """
        ok, snap = self.cas_read(key, value, expected_mod_revision)
        current, revision = snap.values.get(key, (None, 0))
        return ok, current, revision

    def cas_read(
        self,
        key: str,
        value: bytes,
        expected_mod_revision: int | None,
        read: Sequence[str] = (),
        *,
        keys_only: Sequence[str] = (),
        require: Mapping[str, int] | None = None,
        delete: Sequence[str] = (),
    ) -> tuple[bool, Snapshot]:
        """Compare-and-set ``key`` and read ``key`` and ``read``, all in one transaction.

        Both outcomes come back in the one request: a writer that lost learns the
        current value (and the other items) without another round trip.

        Args:
            key: the key compared and written.
            value: the bytes written when the comparison holds.
            expected_mod_revision: the ``mod_revision`` the key must have; ``None``:
                the key must not exist.
            read: further keys and prefixes (ending with ``/``) read in the same
                transaction, after the write when there was one.
            keys_only: items of ``read`` read without their values (``b""``).
            require: further keys -> the ``mod_revision`` each must have (``0``: must
                not exist) for the write to happen.
            delete: keys deleted together with the write (not when it fails).

        Returns:
            ``(ok, snapshot)``: whether ``value`` was written, and ``key`` (when it
            exists) plus the items of ``read`` as of the transaction's revision.

        A try whose outcome is unknown (connection lost mid-call) is retried; when the
        retry finds exactly ``value`` in place, the first try is taken to have won.
        """
        raw = key.encode()
        wanted = {key: expected_mod_revision or 0, **(require or {})}
        compares = [
            etcdrpc.Compare(
                key=name.encode(),
                target=etcdrpc.Compare.MOD,
                result=etcdrpc.Compare.EQUAL,
                mod_revision=revision,
            )
            for name, revision in wanted.items()
        ]
        items = [key, *(item for item in items_of(read) if item != key)]
        reads = range_ops(items, keys_only)
        writes = [etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=raw, value=value))]
        writes += [
            etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=name.encode()))
            for name in delete
        ]
        req = etcdrpc.TxnRequest(compare=compares, success=[*writes, *reads], failure=reads)
        attempts = 0

        def txn(ep: Endpoint, left: float) -> Any:
            nonlocal attempts
            attempts += 1
            return ep.kv.Txn(req, timeout=left)

        resp = self.call(f"cas({key!r})", txn)
        snap = snapshot(resp)
        current = snap.values.get(key)
        ok = bool(resp.succeeded) or (attempts > 1 and current is not None and current[0] == value)
        if not ok:
            self.count("cas_failed")
        return ok, snap

    def delete(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""
        req = etcdrpc.DeleteRangeRequest(key=key.encode())
        resp = self.call(f"delete({key!r})", lambda ep, t: ep.kv.DeleteRange(req, timeout=t))
        return int(resp.deleted) > 0

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key starting with ``prefix``; return how many were deleted."""
        if not prefix:
            raise ValueError("prefix must not be empty")
        raw = prefix.encode()
        req = etcdrpc.DeleteRangeRequest(key=raw, range_end=prefix_end(raw))
        resp = self.call(
            f"delete_prefix({prefix!r})", lambda ep, t: ep.kv.DeleteRange(req, timeout=t)
        )
        return int(resp.deleted)
