"""Leader election on a ``coordination.k8s.io/v1`` Lease, with client-go's semantics.

Several replicas of the operator run; one holds the Lease and reconciles, the others wait.
This follows ``k8s.io/client-go/tools/leaderelection`` (the elector every built-in
controller uses):

- a candidate takes the Lease when it does not exist, is released (no holder), or its
  record has not changed for ``lease_duration`` seconds *as observed by this candidate*
  (its own clock: no cross-machine clock comparison); every write is an update with the
  ``resourceVersion`` read, so two candidates cannot both win one round;
- the leader renews every ``retry_period`` seconds and counts itself leader only while its
  last successful renewal is younger than ``renew_deadline`` (< ``lease_duration``): it
  stops acting before any other candidate may take over, so two leaders never overlap in
  time (given clocks that run at the same rate);
- ``leaseTransitions`` counts leader changes: it is the fencing token of a term
  (:attr:`LeaseElector.term`);
- on a clean stop the leader releases the Lease (empty holder, ``leaseDurationSeconds: 1``)
  so that a successor takes over within ``retry_period`` instead of ``lease_duration``.

Defaults (10 s / 7 s / 2 s): a SIGKILLed leader is replaced within ~12 s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, cast

log = logging.getLogger("kelastic_operator.leader")


class LeaderElectionError(ValueError):
    """Leader-election settings that cannot work (e.g. renew deadline >= lease duration)."""


@dataclass(frozen=True)
class LeaseSettings:
    """Timing of the election, in seconds (client-go's names).

    Attributes:
        lease_duration: how long a candidate waits after the Lease last changed before it
            takes over (integer seconds are written to the Lease).
        renew_deadline: how long the leader keeps acting without a successful renewal.
        retry_period: how often the leader renews and candidates retry.

    Raises:
        LeaderElectionError: unless ``0 < retry_period < renew_deadline < lease_duration``.
    """

    lease_duration: float = 10.0
    renew_deadline: float = 7.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise LeaderElectionError(
                "leader election needs 0 < retry period < renew deadline < lease duration, "
                f"got {self.retry_period:g} / {self.renew_deadline:g} / {self.lease_duration:g} s"
            )


def _micro_time(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseElector:
    """One candidate for the Lease ``namespace/name``.

    Args:
        api: the official client's ApiClient (needs get/create/update on leases).
        namespace, name: the Lease.
        identity: this candidate's unique name (the operator Pod's name).
        settings: the timing.
        monotonic: the clock used for every duration (tests may pass their own).

    Use :meth:`run` (blocks until stopped), or :meth:`try_acquire_or_renew` step by step.
    """

    def __init__(
        self,
        api: Any,
        namespace: str,
        name: str,
        identity: str,
        settings: LeaseSettings | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        from kubernetes import client

        self.leases = client.CoordinationV1Api(api)
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.settings = settings or LeaseSettings()
        self._now = monotonic
        self._observed: tuple[str, str, str] | None = None  # holder, renewTime, transitions
        self._observed_at = 0.0
        self._renewed_at: float | None = None
        self.term: int | None = None  # leaseTransitions of our term while we lead

    # --- state ---------------------------------------------------------------------------

    def is_leader(self) -> bool:
        """True while this candidate holds the Lease and renewed it within the renew
        deadline: the test every action of the leader must pass (its fence)."""
        return (
            self._renewed_at is not None
            and self._now() - self._renewed_at < self.settings.renew_deadline
        )

    # --- one round -----------------------------------------------------------------------

    def try_acquire_or_renew(self) -> bool:
        """One attempt: take or renew the Lease. Returns whether we hold it now.

        API errors (outage, conflict with another candidate) count as a failed attempt.
        """
        from kubernetes.client.exceptions import ApiException

        try:
            return self._attempt()
        except ApiException as exc:
            if exc.status not in (404, 409):
                log.warning("leader election: %s %s", exc.status, exc.reason)
            return False
        except OSError as exc:
            log.warning("leader election: %s", exc)
            return False

    def _attempt(self) -> bool:
        from kubernetes.client.exceptions import ApiException

        wall = datetime.now(timezone.utc)
        try:
            lease = self._read()
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.leases.create_namespaced_lease(
                self.namespace, cast(Any, self._body(wall, None, 0))
            )
            return self._won(0)
        spec = lease.get("spec") or {}
        holder = str(spec.get("holderIdentity") or "")
        transitions = int(spec.get("leaseTransitions") or 0)
        record = (holder, str(spec.get("renewTime")), str(transitions))
        now = self._now()
        if record != self._observed:
            self._observed, self._observed_at = record, now
        duration = float(spec.get("leaseDurationSeconds") or self.settings.lease_duration)
        if holder and holder != self.identity and now - self._observed_at < duration:
            self._renewed_at = None
            return False  # held by someone alive (as far as we have seen)
        acquired: str | None = None
        if holder != self.identity:
            transitions += 1
        else:
            acquired = spec.get("acquireTime")
        body = self._body(wall, acquired, transitions)
        body["metadata"]["resourceVersion"] = lease["metadata"]["resourceVersion"]
        self.leases.replace_namespaced_lease(self.name, self.namespace, cast(Any, body))
        return self._won(transitions)

    def _read(self) -> dict[str, Any]:
        lease = self.leases.read_namespaced_lease(self.name, self.namespace)
        doc: dict[str, Any] = self.leases.api_client.sanitize_for_serialization(lease)
        return doc

    def _won(self, transitions: int) -> bool:
        if self.term != transitions:
            log.info("leader election: %s leads (term %d)", self.identity, transitions)
        self.term = transitions
        self._renewed_at = self._now()
        return True

    def _body(self, wall: datetime, acquired: str | None, transitions: int) -> dict[str, Any]:
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": max(1, round(self.settings.lease_duration)),
                "acquireTime": acquired or _micro_time(wall),
                "renewTime": _micro_time(wall),
                "leaseTransitions": transitions,
            },
        }

    def release(self) -> None:
        """Give the Lease up if we hold it (a clean stop): the successor need not wait."""
        if not self.is_leader():
            return
        self._renewed_at = None
        from kubernetes.client.exceptions import ApiException

        try:
            lease = self._read()
            spec = lease.setdefault("spec", {})
            if spec.get("holderIdentity") != self.identity:
                return
            spec["holderIdentity"] = None
            spec["leaseDurationSeconds"] = 1
            self.leases.replace_namespaced_lease(self.name, self.namespace, cast(Any, lease))
            log.info("leader election: %s released the lease", self.identity)
        except (ApiException, OSError) as exc:
            log.warning("leader election: releasing the lease failed: %s", exc)

    # --- the loop --------------------------------------------------------------------------

    def run(
        self,
        on_started_leading: Callable[[], None],
        on_stopped_leading: Callable[[], None],
        stop: threading.Event,
    ) -> None:
        """Campaign until ``stop`` is set: acquire (retrying every ``retry_period``), call
        ``on_started_leading``, renew; if a renewal deadline passes, call
        ``on_stopped_leading`` and return (the caller should exit: client-go's controllers
        do, so that a restarted process campaigns afresh). On ``stop`` it releases the
        Lease and returns without calling ``on_stopped_leading``."""
        period = self.settings.retry_period
        while not stop.is_set() and not self.try_acquire_or_renew():
            stop.wait(period)
        if stop.is_set():
            return
        on_started_leading()
        while not stop.wait(period):
            self.try_acquire_or_renew()
            if not self.is_leader():
                log.error("leader election: %s lost the lease", self.identity)
                on_stopped_leading()
                return
        self.release()
