"""etcd errors, by what the caller should do about them.

- :class:`EtcdUnavailable`: etcd could not answer (unreachable, leader change, the
  call's deadline passed, the client was closed). Retrying later may succeed.
- :class:`EtcdRefused`: etcd answered, and will give the same answer again
  (``INVALID_ARGUMENT`` such as more operations in one transaction than
  ``--max-txn-ops``, ``PERMISSION_DENIED``, wrong credentials, ...). Surfaced at once,
  never retried as an outage: the request or the configuration must change.
- :class:`EtcdLeaseNotFound`: a refusal that names a lease etcd no longer knows
  (expired or revoked): the caller re-joins with a new lease.

All are :class:`EtcdError`, a :class:`ConnectionError`, so code that treats every etcd
failure alike catches one class.
"""

from __future__ import annotations


class EtcdError(ConnectionError):
    """etcd could not serve a request (unreachable, timed out, or refused it).

    Attributes:
        endpoint: the ``host:port`` last tried.
    """

    def __init__(self, endpoint: str, message: str) -> None:
        super().__init__(f"etcd at {endpoint}: {message}")
        self.endpoint = endpoint


class EtcdUnavailable(EtcdError):
    """etcd did not answer in time (or the client is closed): retry later."""


class EtcdRefused(EtcdError):
    """etcd answered with an error it will give again: surface it, do not retry."""


class EtcdLeaseNotFound(EtcdRefused):
    """A write or keep-alive named a lease that etcd no longer knows (expired or revoked)."""
