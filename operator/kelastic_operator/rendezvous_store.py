"""The operator's view of a job's etcd keys, behind a small interface.

The operator does three things with etcd (key layout: :class:`kelastic.contract.Keys`):

- reads the rendezvous state, the restart counter, the in-process restart record and
  the sidecars' reports, all in one range request over the job's prefix
  (:meth:`RendezvousStore.read`, parsed by the pure
  :func:`~kelastic_operator.etcd_view.view_from_keys`);
- removes a node from rendezvous the moment its Pod fails or is deleted by deleting its
  alive key (the sidecars treat a node without one as dead at once);
- deletes the job's whole prefix when the job is deleted (the finalizer).

:class:`EtcdRendezvousStore` does this with kelastic's etcd client
(:class:`kelastic_etcd.EtcdClient`, the sidecar's too: one deadline per call, failover to
the next member); tests can pass any object with the same methods.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Final, Protocol

from kelastic import contract, etcd_values

from .etcd_view import view_from_keys
from .reconcile import RendezvousView

log = logging.getLogger("kelastic_operator.etcd")


#: Most changed keys a :meth:`EtcdRendezvousStore.watch` keeps between two reads of its
#: journal (keys only); a reader further behind reads everything again.
WATCH_JOURNAL_LIMIT: Final = 16384


class RendezvousStoreError(RuntimeError):
    """etcd could not be reached or refused the call; the message names the endpoints.

    The cause (``__cause__``) is the client's :class:`kelastic_etcd.EtcdError`:
    :class:`~kelastic_etcd.EtcdUnavailable` (retry) or :class:`~kelastic_etcd.EtcdRefused`.
    """


class RendezvousStore(Protocol):
    """What the operator needs from etcd (one job prefix per call)."""

    def read(self, prefix: str, nproc_per_node: int, *, replicated: bool = False) -> RendezvousView:
        """The job's rendezvous view (``replicated``: its checkpoint state is, see
        :func:`~kelastic_operator.etcd_view.view_from_keys`).

        Raises:
            RendezvousStoreError: etcd is unreachable.
        """
        ...

    def remove_nodes(self, prefix: str, nodes: Sequence[str]) -> None:
        """Delete the alive keys of ``nodes``.

        Raises:
            RendezvousStoreError: etcd is unreachable.
        """
        ...

    def mark_departing(self, prefix: str, nodes: Sequence[str], reason: str) -> None:
        """Post departure notices (:meth:`kelastic.contract.Keys.departing`) for ``nodes``
        (the value: :func:`kelastic.etcd_values.encode_departure` of ``reason``).

        Raises:
            RendezvousStoreError: etcd is unreachable.
            kelastic.etcd_values.CorruptValueError: ``reason`` is not 1..1024 characters.
        """
        ...

    def clear_departing(self, prefix: str, nodes: Sequence[str]) -> None:
        """Delete the departure notices of ``nodes`` (those absent are no error).

        Raises:
            RendezvousStoreError: etcd is unreachable.
        """
        ...

    def fence(self, prefix: str, pod_uid: str, reason: str) -> None:
        """Fence a Pod incarnation (:meth:`kelastic.contract.Keys.fenced`; the value:
        :func:`kelastic.etcd_values.encode_departure` of ``reason``).

        Raises:
            RendezvousStoreError: etcd is unreachable.
            kelastic.etcd_values.CorruptValueError: ``reason`` is not 1..1024 characters.
        """
        ...

    def delete_prefix(self, prefix: str) -> None:
        """Delete every key under ``prefix``.

        Raises:
            RendezvousStoreError: etcd is unreachable.
        """
        ...

    def watch(self, prefix: str) -> StatusWatch:
        """A watch on every key under ``prefix`` that keeps the keys changed (not their
        values) for :meth:`StatusWatch.events_since`.

        Raises:
            RendezvousStoreError: etcd did not create the watch in time.
        """
        ...


class StatusWatch(Protocol):
    """Changes of the keys under a prefix, as :class:`kelastic_etcd.watcher.Watcher`
    reports them (revisions are etcd store revisions)."""

    @property
    def latest_revision(self) -> int:
        """The newest revision covered so far."""
        ...

    def wait(self, since_revision: int, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for a change after ``since_revision``; True on
        one. Raises an ``EtcdError`` once the stream is broken for good or closed."""
        ...

    def events_since(self, since_revision: int) -> list[tuple[str, bytes | None, int]] | None:
        """The changes after ``since_revision``, oldest first, as ``(key, value, revision)``;
        None when they are not all known (read everything again)."""
        ...

    def close(self) -> None:
        """Stop watching. Idempotent."""
        ...


def parse_endpoint(text: str) -> tuple[str, int]:
    """``host:port`` (an ``http://`` scheme is allowed) -> (host, port).

    Raises:
        ValueError: no port, or a port that is not a number.
    """
    text = text.strip().removeprefix("http://").removeprefix("https://").rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"etcd endpoint must be host:port, got {text!r}")
    return host.strip("[]"), int(port)


class EtcdRendezvousStore:
    """:class:`RendezvousStore` on :class:`kelastic_etcd.EtcdClient`.

    Args:
        endpoints: ``host:port`` strings.
        timeout: seconds per call, retries on the other members included.
        time_retry: ignored (pyetcd's endpoint blacklist time; the client fails over
            per call instead); kept so that callers need not change.
        tls_dir: folder with ``ca.crt``, ``tls.crt``, ``tls.key`` (the layout of a
            Kubernetes TLS Secret plus its CA) for an etcd that requires TLS with client
            certificates; plaintext when None.
        user, password: etcd user and password, for an etcd with auth enabled.

    Raises:
        ValueError: an endpoint is not ``host:port``.
        OSError: a file of ``tls_dir`` cannot be read.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        timeout: float = 5.0,
        time_retry: float = 2.0,
        tls_dir: Path | None = None,
        *,
        user: str | None = None,
        password: str = "",
    ) -> None:
        from kelastic_etcd import EtcdClient

        del time_retry  # see the docstring
        self.endpoints = tuple(endpoints)
        for endpoint in self.endpoints:
            parse_endpoint(endpoint)
        self._client = EtcdClient(
            self.endpoints, timeout=timeout, tls_dir=tls_dir, user=user, password=password
        )

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        from kelastic_etcd import EtcdError

        try:
            return fn()
        except EtcdError as exc:
            raise RendezvousStoreError(
                f"etcd {','.join(self.endpoints)}: {what} failed: {type(exc).__name__}: {exc}"
            ) from exc

    def read(self, prefix: str, nproc_per_node: int, *, replicated: bool = False) -> RendezvousView:
        """See :meth:`RendezvousStore.read`."""

        def get() -> dict[str, bytes]:
            return {key: value for key, (value, _) in self._client.get_prefix(prefix).items()}

        kv = self._call(f"read {prefix}", get)
        return view_from_keys(prefix, kv, nproc_per_node, replicated=replicated)

    def remove_nodes(self, prefix: str, nodes: Sequence[str]) -> None:
        """See :meth:`RendezvousStore.remove_nodes`."""
        keys = [contract.Keys(prefix).alive(node) for node in nodes]

        def delete() -> None:
            for key in keys:
                self._client.delete(key)

        if keys:
            self._call(f"delete {', '.join(keys)}", delete)

    def mark_departing(self, prefix: str, nodes: Sequence[str], reason: str) -> None:
        """See :meth:`RendezvousStore.mark_departing`."""
        keys = [contract.Keys(prefix).departing(node) for node in nodes]
        value = etcd_values.encode_departure(reason)

        def put() -> None:
            for key in keys:
                self._client.put(key, value)

        if keys:
            self._call(f"put {', '.join(keys)}", put)

    def fence(self, prefix: str, pod_uid: str, reason: str) -> None:
        """See :meth:`RendezvousStore.fence`."""
        key, value = contract.Keys(prefix).fenced(pod_uid), etcd_values.encode_departure(reason)
        self._call(f"put {key}", lambda: self._client.put(key, value))

    def clear_departing(self, prefix: str, nodes: Sequence[str]) -> None:
        """See :meth:`RendezvousStore.clear_departing`."""
        keys = [contract.Keys(prefix).departing(node) for node in nodes]

        def delete() -> None:
            for key in keys:
                self._client.delete(key)

        if keys:
            self._call(f"delete {', '.join(keys)}", delete)

    def delete_prefix(self, prefix: str) -> None:
        """See :meth:`RendezvousStore.delete_prefix`."""
        if not prefix.startswith(contract.ETCD_ROOT + "/") or not prefix.endswith("/"):
            raise ValueError(f"refusing to delete a prefix outside a job's keys: {prefix!r}")
        self._call(f"delete prefix {prefix}", lambda: self._client.delete_prefix(prefix))

    def watch(self, prefix: str) -> StatusWatch:
        """See :meth:`RendezvousStore.watch`: one watch stream, its journal keeping up to
        :data:`WATCH_JOURNAL_LIMIT` keys."""
        from kelastic_etcd import EtcdError
        from kelastic_etcd.watcher import Watcher

        try:
            return Watcher(self._client, [prefix], journal=True,
                           journal_limit=WATCH_JOURNAL_LIMIT, journal_values=False)  # fmt: skip
        except EtcdError as exc:
            raise RendezvousStoreError(
                f"etcd {','.join(self.endpoints)}: watch {prefix} failed: {exc}"
            ) from exc

    def close(self) -> None:
        """Close the client's channels."""
        self._client.close()


class StoreCache:
    """One :class:`EtcdRendezvousStore` per distinct endpoint list, created on first use.

    Args:
        factory: builds a store for an endpoint tuple (tests pass their own).
    """

    def __init__(self, factory: Callable[[tuple[str, ...]], RendezvousStore] | None = None) -> None:
        self._factory = factory or (lambda eps: EtcdRendezvousStore(eps))
        self._stores: dict[tuple[str, ...], RendezvousStore] = {}
        self._lock = threading.Lock()

    def get(self, endpoints: Iterable[str]) -> RendezvousStore:
        """The store for ``endpoints``.

        Raises:
            ValueError: an endpoint is not ``host:port``.
        """
        key = tuple(endpoints)
        with self._lock:
            if key not in self._stores:
                self._stores[key] = self._factory(key)
            return self._stores[key]

    def close(self) -> None:
        """Close every store that has a ``close`` method."""
        with self._lock:
            for store in self._stores.values():
                close = getattr(store, "close", None)
                if callable(close):
                    close()
            self._stores.clear()
