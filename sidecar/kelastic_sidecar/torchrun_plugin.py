"""The rendezvous state backend on etcd: torch's ``RendezvousBackend`` contract, on v3.

:class:`EtcdRendezvousBackend` keeps one opaque state blob at one etcd key. The fencing
token is the key's ``mod_revision`` and every write is one etcd transaction
(compare-and-set, :meth:`~kelastic_etcd.EtcdClient.cas`). Our own
rendezvous (:mod:`kelastic_sidecar.rendezvous.handler`) uses it directly, with JSON states.

The same class backs torch's own ``DynamicRendezvousHandler`` so that
``torchrun --rdzv-backend=kelastic-etcd --rdzv-endpoint=<etcd host:port>`` works (torch's
etcd backends speak the v2 API, which etcd 3.6 removed). torch is imported lazily, only
by :func:`register_torch_backend` and the handler creator, because the sidecar image has
no torch. torchrun finds the creator without user code through the entry point group
``torchrun.handlers`` (torch calls the entry point with no arguments and registers what
it returns), for example in ``pyproject.toml``::

    [project.entry-points."torchrun.handlers"]
    kelastic-etcd = "kelastic_sidecar.torchrun_plugin:torchrun_handler"

torchrun parameters (``--rdzv-conf key=value,...``): ``tls_dir`` (holds ca.crt, tls.crt,
tls.key; default ``$KELASTIC_ETCD_TLS_DIR``), ``etcd_timeout`` (seconds per etcd call,
default 5), ``read_timeout`` (seconds a c10d store read may block, default 60),
``key_prefix`` (default ``/kelastic/torchrun/``; the run's keys live under
``<key_prefix><run id>/``). Use a fresh ``--rdzv-id`` per run: the state outlives the
run in etcd, and a closed one stays closed. For an etcd with auth enabled, the user and
password come from ``$KELASTIC_ETCD_USER`` and ``$KELASTIC_ETCD_PASSWORD`` (never from
the command line, where ``ps`` shows them).

torch's handler pickles its state; in that mode whoever can write the key can run code
in every agent, so protect the etcd prefix (TLS client certificates, etcd RBAC). The
torch adapter wraps the pickle in a versioned JSON envelope, so a value written by
anything else is refused before unpickling.

Over ~400 lines because it is one cohesive thing: torch's ``RendezvousBackend`` contract
on etcd v3 and what torch needs to use it (the state envelope, the c10d store on etcd, the
handler creator and torchrun's entry point), all behind one lazy import of torch.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import functools
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kelastic._safejson import UnsafeJSONError, loads_bounded
from kelastic.contract import ENV_ETCD_PASSWORD, ENV_ETCD_TLS_DIR, ENV_ETCD_USER

if TYPE_CHECKING:  # the etcd client (grpc) loads on first use: torch imports this module
    from collections.abc import Mapping, Sequence

    from kelastic_etcd import EtcdClient, Snapshot

log = logging.getLogger("kelastic_sidecar.rendezvous")

#: Name under which the torch adapter is registered by default.
TORCH_BACKEND_NAME = "kelastic-etcd"
#: Entry point group torch scans for out-of-tree rendezvous handlers (2.13: registry.py).
TORCHRUN_ENTRY_POINT_GROUP = "torchrun.handlers"
#: Default etcd prefix of torchrun runs (``<prefix><run id>/``).
TORCHRUN_KEY_PREFIX = "/kelastic/torchrun/"

_ENVELOPE_VERSION = 1
_ENVELOPE_KIND = "torch-dynamic-rendezvous-state"


class EtcdRendezvousBackend:
    """Holds a rendezvous state blob at one etcd key (torch's ``RendezvousBackend`` contract).

    Args:
        store: the etcd client.
        key: the etcd key of the state (e.g. ``Keys.rdzv_state``).
        name: the backend name reported to torch.

    The fencing token is the key's ``mod_revision`` (an ``int``). Errors from etcd
    propagate as :class:`~kelastic_etcd.EtcdError`; the torch
    adapter maps them to torch's ``RendezvousConnectionError``.
    """

    def __init__(self, store: EtcdClient, key: str, *, name: str = TORCH_BACKEND_NAME) -> None:
        if not key:
            raise ValueError("the state key must not be empty")
        self._store = store
        self._key = key
        self._name = name

    @property
    def name(self) -> str:
        """The backend name."""
        return self._name

    @property
    def key(self) -> str:
        """The etcd key holding the state."""
        return self._key

    def get_state(self) -> tuple[bytes, int] | None:
        """Return ``(state, token)``, or ``None`` when no state is stored.

        Raises:
            EtcdError: etcd did not answer within the store's timeout.
        """
        return self._store.get(self._key)

    def set_state(self, state: bytes, token: Any | None = None) -> tuple[bytes, int, bool] | None:
        """Write ``state`` if ``token`` still matches; torch's ``set_state`` semantics.

        - ``token`` matches the stored ``mod_revision``: the state is replaced; returns
          ``(state, new token, True)``;
        - it does not match (or is not one of our tokens): nothing is written; returns
          ``(stored state, its token, False)``;
        - ``token`` is ``None``: the state is written only if none exists.

        Returns ``None`` when the write failed and no state exists (it was deleted).

        Raises:
            EtcdError: etcd did not answer within the store's timeout.
        """
        if token is not None and (not isinstance(token, int) or isinstance(token, bool)):
            # A token from another backend cannot match ours.
            current = self.get_state()
            return None if current is None else (current[0], current[1], False)
        ok, value, revision = self._store.cas(self._key, state, token)
        if value is None:
            return None
        return value, revision, ok

    def set_state_and_read(
        self,
        state: bytes,
        token: int | None,
        read: Sequence[str],
        *,
        keys_only: Sequence[str] = (),
        require: Mapping[str, int] | None = None,
        delete: Sequence[str] = (),
    ) -> tuple[bool, Snapshot]:
        """:meth:`set_state`, also reading ``read`` in the same etcd transaction.

        One request whatever the outcome: a writer that lost gets the current state (and
        the other keys) from it, without reading again.

        Args:
            state: the bytes to write.
            token: the ``mod_revision`` the state must still have; ``None``: write only
                if no state exists.
            read: further keys and prefixes (ending with ``/``) to read.
            keys_only: items of ``read`` to read without their values (``b""``).
            require: further keys -> the ``mod_revision`` each must have (``0``: must
                not exist) for the write to happen.
            delete: keys deleted together with the write.

        Returns:
            ``(ok, snapshot)``: whether ``state`` was written, and the state key (when
            it exists) plus the items of ``read``, consistent at one revision (after
            the write when there was one).

        Raises:
            EtcdError: etcd did not answer within the store's timeout.
        """
        return self._store.cas_read(
            self._key, state, token, read, keys_only=keys_only, require=require, delete=delete
        )


# ------------------------------------------------------------------------ torch adapter


_MAX_ENVELOPE_BYTES = 2 * 1024 * 1024


def encode_envelope(state: bytes) -> bytes:
    """Wrap torch's (pickled) state in the versioned JSON envelope stored in etcd."""
    doc = {
        "version": _ENVELOPE_VERSION,
        "kind": _ENVELOPE_KIND,
        "state": base64.b64encode(state).decode(),
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_envelope(raw: bytes, key: str) -> bytes:
    """Unwrap :func:`encode_envelope`.

    Raises:
        ValueError: naming ``key``, when malformed: not bounded JSON (over 2 MiB, nested
            over 32 deep, an integer over 19 digits, a non-finite number), another kind
            or version, or no base64 ``state``. Never another exception.
    """
    try:
        doc = loads_bounded(raw, max_bytes=_MAX_ENVELOPE_BYTES)
    except UnsafeJSONError as exc:
        raise ValueError(f"rendezvous state at {key} is not JSON ({exc}): {raw[:80]!r}") from None
    if not isinstance(doc, dict) or doc.get("kind") != _ENVELOPE_KIND:
        raise ValueError(f"rendezvous state at {key} is not a torch rendezvous state")
    if doc.get("version") != _ENVELOPE_VERSION:
        raise ValueError(
            f"rendezvous state at {key} has version {doc.get('version')!r:.40}; "
            f"this kelastic reads version {_ENVELOPE_VERSION}"
        )
    payload = doc.get("state")
    if not isinstance(payload, str):
        raise ValueError(f"rendezvous state at {key} has no 'state' string")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"rendezvous state at {key}: 'state' is not base64") from exc


@functools.cache
def _torch_classes() -> tuple[type[Any], type[Any]]:
    """Build the torch adapter classes (imports torch; called on first use)."""
    return _torch_backend_class(), _torch_store_class()


def _torch_backend_class() -> type[Any]:
    """torch's ``RendezvousBackend`` over :class:`EtcdRendezvousBackend` (imports torch)."""
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousConnectionError,
        RendezvousStateError,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

    from kelastic_etcd import EtcdError

    class TorchEtcdRendezvousBackend(RendezvousBackend):  # type: ignore[misc,unused-ignore]
        """torch's ``RendezvousBackend`` over :class:`EtcdRendezvousBackend`.

        States are wrapped in a versioned JSON envelope; a malformed value raises
        ``RendezvousStateError``, an etcd failure ``RendezvousConnectionError``.
        """

        def __init__(self, inner: EtcdRendezvousBackend) -> None:
            self._inner = inner

        @property
        def name(self) -> str:
            return self._inner.name

        def _unwrap(self, raw: bytes) -> bytes:
            try:
                return decode_envelope(raw, self._inner.key)
            except ValueError as exc:
                raise RendezvousStateError(str(exc)) from exc

        def get_state(self) -> tuple[bytes, Any] | None:
            try:
                got = self._inner.get_state()
            except EtcdError as exc:
                raise RendezvousConnectionError(str(exc)) from exc
            return None if got is None else (self._unwrap(got[0]), got[1])

        def set_state(
            self, state: bytes, token: Any | None = None
        ) -> tuple[bytes, Any, bool] | None:
            try:
                got = self._inner.set_state(encode_envelope(state), token)
            except EtcdError as exc:
                raise RendezvousConnectionError(str(exc)) from exc
            return None if got is None else (self._unwrap(got[0]), got[1], got[2])

    return TorchEtcdRendezvousBackend


def _torch_store_class() -> type[Any]:
    """A c10d ``Store`` on etcd (imports torch)."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import Store

    from kelastic_etcd import EtcdError

    class EtcdC10dStore(Store):  # type: ignore[misc,unused-ignore]
        """A c10d ``Store`` on etcd, returned by the handler (torch's etcd-v2 backend does alike).

        Keys live under ``prefix``; values are stored as given. ``get``/``wait`` block
        (via etcd watches) up to the store timeout and then raise ``DistStoreError``.
        """

        def __init__(self, store: EtcdClient, prefix: str, timeout: dt.timedelta) -> None:
            super().__init__()  # the pybind trampoline needs it
            self._store = store
            self._prefix = prefix if prefix.endswith("/") else prefix + "/"
            self._timeout = timeout
            self.set_timeout(timeout)

        def _key(self, key: str) -> str:
            return self._prefix + key

        @staticmethod
        def _bytes(value: str | bytes) -> bytes:
            return value.encode() if isinstance(value, str) else bytes(value)

        def _call(self, fn: Any, *args: Any) -> Any:
            try:
                return fn(*args)
            except EtcdError as exc:
                raise dist.DistStoreError(str(exc)) from exc

        def set(self, key: str, value: str | bytes) -> None:
            self._call(self._store.put, self._key(key), self._bytes(value))

        def get(self, key: str) -> bytes:
            self.wait([key])
            got = self._call(self._store.get, self._key(key))
            if got is None:  # deleted in between
                raise dist.DistStoreError(f"key {key!r} vanished from the etcd store")
            return bytes(got[0])

        def add(self, key: str, amount: int) -> int:
            full = self._key(key)
            while True:
                got = self._call(self._store.get, full)
                current = int(got[0]) if got else 0
                new = str(current + amount).encode()
                ok, _, _ = self._call(self._store.cas, full, new, got[1] if got else None)
                if ok:
                    return current + amount

        def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
            full, want, new = self._key(key), self._bytes(expected), self._bytes(desired)
            while True:
                got = self._call(self._store.get, full)
                if got is None and want:
                    return want  # c10d: a missing key with a non-empty expectation
                if got is not None and got[0] != want:
                    return bytes(got[0])
                ok, _, _ = self._call(self._store.cas, full, new, got[1] if got else None)
                if ok:
                    return new

        def check(self, keys: list[str]) -> bool:
            snap = self._call(self._store.read, [self._key(k) for k in keys])
            return all(self._key(k) in snap.values for k in keys)

        def wait(self, keys: list[str], timeout: dt.timedelta | None = None) -> None:
            current: dt.timedelta = getattr(self, "timeout", self._timeout)
            limit = (timeout or current).total_seconds()
            full = [self._key(k) for k in keys]
            deadline = time.monotonic() + limit
            while True:
                snap = self._call(self._store.read, full)
                if all(k in snap.values for k in full):
                    return
                left = deadline - time.monotonic()
                if left <= 0 or not self._call(self._store.wait_change, full, snap.revision, left):
                    raise dist.DistStoreError(
                        f"timed out after {limit:.1f}s waiting for keys {keys} in the etcd store"
                    )

        def delete_key(self, key: str) -> bool:
            return bool(self._call(self._store.delete, self._key(key)))

        def num_keys(self) -> int:
            return len(self._call(self._store.get_prefix, self._prefix))

        # The pybind trampoline dispatches these two by their C++ names.
        deleteKey = delete_key
        getNumKeys = num_keys

    return EtcdC10dStore


def create_torch_handler(params: Any) -> Any:
    """torch handler creator: a ``DynamicRendezvousHandler`` on etcd v3.

    Args:
        params: torch's ``RendezvousParameters``; ``endpoint`` is etcd's
            ``host:port`` (several, comma separated), see the module doc for options.

    Raises:
        torch's ``RendezvousConnectionError`` when etcd cannot be reached.
    """
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    from kelastic_etcd import EtcdClient, EtcdError

    backend_cls, store_cls = _torch_classes()
    if not params.endpoint:
        raise ValueError("--rdzv-endpoint must name etcd's host:port")
    tls_dir = params.get("tls_dir") or os.environ.get(ENV_ETCD_TLS_DIR)
    etcd_timeout = float(params.get("etcd_timeout", 5.0))
    read_timeout = params.get_as_int("read_timeout", 60)
    prefix = str(params.get("key_prefix", TORCHRUN_KEY_PREFIX))
    if not prefix.endswith("/"):
        prefix += "/"
    prefix += params.run_id + "/"
    store = EtcdClient(
        params.endpoint.split(","),
        tls_dir=Path(tls_dir) if tls_dir else None,
        timeout=etcd_timeout,
        user=os.environ.get(ENV_ETCD_USER) or None,
        password=os.environ.get(ENV_ETCD_PASSWORD, ""),
    )
    try:
        store.get(prefix + "rdzv/state")  # fail now, clearly, when etcd is unreachable
    except EtcdError as exc:
        store.close()
        raise RendezvousConnectionError(str(exc)) from exc
    name = str(params.backend or TORCH_BACKEND_NAME)
    backend = backend_cls(EtcdRendezvousBackend(store, prefix + "rdzv/state", name=name))
    c10d_store = store_cls(store, prefix + "store/", dt.timedelta(seconds=read_timeout))
    log.info("torch rendezvous %r on etcd %s under %s", params.run_id, params.endpoint, prefix)
    return create_handler(c10d_store, backend, params)


def torchrun_handler() -> Any:
    """Entry point for group ``torchrun.handlers``: returns :func:`create_torch_handler`.

    Must not import torch: torch calls it while importing its rendezvous package.
    """
    return create_torch_handler


def register_torch_backend(name: str = TORCH_BACKEND_NAME) -> None:
    """Register :func:`create_torch_handler` with torch's rendezvous handler registry.

    After this, ``get_rendezvous_handler`` (and torchrun in this process) accepts
    ``backend=name``. Idempotent.

    Raises:
        ImportError: torch is not installed.
        ValueError: ``name`` is already registered with another creator.
    """
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(name, create_torch_handler)
