"""Leases: granted, kept alive by a background thread, revoked.

Keys put with ``lease=lease.id`` vanish when the lease expires or is revoked (the
rendezvous binds a node's alive key to its lease).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from typing import Any

from pyetcd import etcdrpc

from .call import Connection, Endpoint
from .errors import EtcdError, EtcdLeaseNotFound, EtcdRefused

log = logging.getLogger("kelastic_etcd")


class Lease:
    """An etcd lease kept alive by a background thread (refresh every ``ttl / 3`` s).

    Obtain one with :meth:`Leases.grant_lease`. Keys put with ``lease=lease.id``
    are deleted by etcd when the lease expires or is revoked.

    Attributes:
        id: the etcd lease id.
        ttl: the granted time-to-live, seconds.
    """

    def __init__(self, store: Leases, lease_id: int, ttl: int) -> None:
        self.id = lease_id
        self.ttl = ttl
        self._store = store
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._thread = threading.Thread(
            target=self._keep_alive, name=f"etcd-lease-{lease_id:x}", daemon=True
        )
        self._thread.start()

    @property
    def lost(self) -> bool:
        """True once etcd said the lease is gone, or no refresh succeeded for ``ttl`` s."""
        return self._lost.is_set()

    def wait_lost(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds until the lease is lost; return :attr:`lost`."""
        return self._lost.wait(timeout)

    def check(self) -> bool:
        """Ask etcd now whether the lease lives (one keep-alive round trip, which also
        refreshes it); a lease etcd says is gone is marked :attr:`lost`.

        Returns:
            False when the lease is lost; True when it lives, or when etcd did not
            answer (the keep-alive goes on deciding then).
        """
        if self.lost:
            return False
        try:
            left = self._store.refresh_lease(self.id, timeout=min(self._store.timeout, 2.0))
        except EtcdError:
            return True
        if left <= 0:
            log.error("lease %x lost: etcd says it expired or was revoked", self.id)
            self._lost.set()
            return False
        return True

    def stop_keep_alive(self) -> None:
        """Stop refreshing without revoking: the lease expires ``ttl`` s after its last refresh."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self._store.timeout + 1.0)

    def revoke(self) -> None:
        """Stop the keep-alive and revoke the lease now (its keys vanish); idempotent.

        Raises:
            EtcdError: etcd did not answer; the lease then expires by its TTL.
        """
        self.stop_keep_alive()
        if not self._lost.is_set():
            self._store.revoke_lease(self.id)
            self._lost.set()

    def _keep_alive(self) -> None:
        interval = max(self.ttl / 3.0, 0.1)
        last_ok = time.monotonic()
        wait = interval
        while not self._stop.wait(wait):
            try:
                left = self._store.refresh_lease(
                    self.id, timeout=min(self._store.timeout, interval)
                )
            except EtcdError as exc:
                silent = time.monotonic() - last_ok
                if silent >= self.ttl:
                    log.error("lease %x lost: no refresh for %.1fs (%s)", self.id, silent, exc)
                    self._lost.set()
                    return
                log.warning("lease %x: refresh failed (%s); retrying", self.id, exc)
                wait = min(interval, 0.5)
                continue
            if left <= 0:
                log.error("lease %x lost: etcd says it expired or was revoked", self.id)
                self._lost.set()
                return
            last_ok = time.monotonic()
            wait = interval


class Leases(Connection):
    """Lease operations over a :class:`~kelastic_etcd.call.Connection`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._leases: weakref.WeakSet[Lease] = weakref.WeakSet()

    def grant_lease(self, ttl: int) -> Lease:
        """Grant a lease of ``ttl`` seconds (>= 1) and keep it alive in the background."""
        if ttl < 1:
            raise ValueError(f"lease ttl must be >= 1 s, got {ttl}")
        req = etcdrpc.LeaseGrantRequest(TTL=int(ttl), ID=0)
        resp = self.call(f"grant_lease({ttl})", lambda ep, t: ep.lease.LeaseGrant(req, timeout=t))
        if resp.error:
            raise EtcdRefused(self.endpoint().netloc, f"grant_lease: {resp.error}")
        lease = Lease(self, int(resp.ID), int(resp.TTL))
        self._leases.add(lease)
        log.debug("granted lease %x (ttl %ds)", lease.id, lease.ttl)
        return lease

    def refresh_lease(self, lease_id: int, timeout: float) -> int:
        """One keep-alive round trip, within ``timeout`` seconds.

        Returns:
            the TTL etcd grants (<= 0: the lease is gone).
        """

        def once(ep: Endpoint, left: float) -> int:
            request = etcdrpc.LeaseKeepAliveRequest(ID=lease_id)
            call = ep.lease.LeaseKeepAlive(iter([request]), timeout=left)
            try:
                for resp in call:
                    return int(resp.TTL)
                return 0
            finally:
                call.cancel()

        return self.call(f"keep_alive({lease_id:x})", once, timeout=timeout)

    def revoke_lease(self, lease_id: int) -> None:
        """Revoke a lease now (its keys vanish); a lease already gone is not an error."""
        req = etcdrpc.LeaseRevokeRequest(ID=lease_id)
        with contextlib.suppress(EtcdLeaseNotFound):  # already expired or revoked
            self.call(f"revoke({lease_id:x})", lambda ep, t: ep.lease.LeaseRevoke(req, timeout=t))

    def close(self) -> None:
        """Stop lease keep-alives (leases then expire by TTL) and close the channels."""
        if not self.closed:
            for lease in list(self._leases):
                lease.stop_keep_alive()
        super().close()
