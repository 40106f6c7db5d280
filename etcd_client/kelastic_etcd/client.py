"""The client: key-value, transactions, leases and watches over one connection."""

from __future__ import annotations

from .lease import Leases
from .watch import Watches


class EtcdClient(Watches, Leases):
    """Key-value access to etcd v3 with compare-and-set, leases and watches.

    Args: see :class:`~kelastic_etcd.call.Connection` (endpoints, ``tls_dir``,
    ``timeout``, ``user`` and ``password``).

    Every method raises :class:`~kelastic_etcd.errors.EtcdUnavailable` when etcd cannot
    serve it within ``timeout`` and :class:`~kelastic_etcd.errors.EtcdRefused` when etcd
    answers with an error it will give again. Thread-safe; a context manager that
    closes the client.
    """

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
