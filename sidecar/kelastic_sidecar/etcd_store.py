"""The sidecar's former etcd client names, kept importable; the client is
:mod:`kelastic_etcd` (shared with the operator).

``EtcdUnavailableError`` was raised for every etcd failure, so it names the base class
:class:`~kelastic_etcd.errors.EtcdError` (``except EtcdUnavailableError`` keeps catching
what it caught); new code catches :class:`~kelastic_etcd.errors.EtcdUnavailable` or
:class:`~kelastic_etcd.errors.EtcdRefused`.
"""

from __future__ import annotations

from kelastic_etcd import DEFAULT_PORT, EtcdClient, Lease, Snapshot
from kelastic_etcd import EtcdError as EtcdUnavailableError
from kelastic_etcd import EtcdLeaseNotFound as EtcdLeaseNotFoundError

#: The client under its former name.
EtcdStore = EtcdClient

__all__ = [
    "DEFAULT_PORT",
    "EtcdLeaseNotFoundError",
    "EtcdStore",
    "EtcdUnavailableError",
    "Lease",
    "Snapshot",
]
