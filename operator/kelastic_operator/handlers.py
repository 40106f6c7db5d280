"""Thin kopf handlers around :class:`~kelastic_operator.job_reconciler.JobReconciler`.

:func:`register` puts onto a kopf registry:

- a **daemon** per ElasticJob that reconciles it: once at start, again whenever the job or
  one of its Pods changes (a wake-up from the event handlers below), and when the plan
  asks (``requeue_after``: backoff, pending timeouts), when the keys in etcd that its
  status is read from change (:mod:`~kelastic_operator.rendezvous_watch`: a round
  completing, a restart, a node's report; one etcd watch for all jobs), or every
  ``resync_seconds``;
- **event handlers** on ElasticJobs and on Pods labelled with a job name that feed the
  watch cache and wake that job's daemon;
- with ``watch_nodes``, an event handler on **Nodes** that keeps which are not Ready
  (:mod:`~kelastic_operator.node_health`) and wakes the jobs with Pods on a Node whose
  readiness changed (rule 10 of :mod:`~kelastic_operator.reconcile`: lost nodes);
- with ``watch_workloads``, an event handler on Kueue's **Workloads** owned by a job
  (:mod:`~kelastic_operator.kueue`: admission, eviction) that wakes that job;
- a **delete handler** (kopf's finalizer) that deletes the job's Pods, waits until they
  are gone (no sidecar left to write), then releases a queued job's Workload (deleted,
  Kueue's finalizer lifted) and deletes the job's etcd prefix.

``OperatorContext`` and ``JobReconciler`` live in :mod:`kelastic_operator.job_reconciler`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections.abc import Mapping
from typing import Any

import kopf
import urllib3
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from . import kueue
from .job_reconciler import PLURAL, RECONCILE_POOL, JobReconciler, OperatorContext
from .labels import LABEL_JOB
from .model import (
    API_GROUP,
    API_VERSION,
    DEFAULT_NODE_LOST_SECONDS,
    KIND,
    PHASES,
    ElasticJobSpec,
)
from .rendezvous_store import RendezvousStoreError
from .rendezvous_watch import StatusFollower
from .watch_cache import slim_pod
from .workload_client import release_workload

__all__ = ["register"]
log = logging.getLogger("kelastic_operator")


def register(
    registry: kopf.OperatorRegistry,
    ctx: OperatorContext,
    watch_nodes: bool = True,
    watch_workloads: bool = False,
) -> None:
    """Register the ElasticJob handlers on ``registry``, sharing ``ctx``; with
    ``watch_nodes`` the Node handler too (it needs ``list``/``watch`` on Nodes); with
    ``watch_workloads`` the Workload handler (Kueue's CRDs must be served; without it a
    queued job notices its admission at the next resync)."""

    @kopf.daemon(API_GROUP, API_VERSION, PLURAL, registry=registry, cancellation_timeout=2.0)
    async def run_job(
        name: str, namespace: str | None, stopped: kopf.DaemonStopped, **_: Any
    ) -> None:
        namespace = namespace or "default"
        wake = ctx.wakeup(namespace, name)
        reconciler = JobReconciler(ctx, namespace, name)
        loop = asyncio.get_running_loop()
        follower = StatusFollower(ctx.status_hubs, lambda: loop.call_soon_threadsafe(wake.set))
        try:
            await _reconcile_until_stopped(ctx, reconciler, wake, follower, stopped)
        finally:
            follower.close()

    @kopf.on.event(API_GROUP, API_VERSION, PLURAL, registry=registry)
    async def job_changed(
        name: str, namespace: str | None, type: str | None, body: kopf.Body, **_: Any
    ) -> None:
        namespace = namespace or "default"
        if type == "DELETED":
            ctx.cache.drop_job(namespace, name)
        else:
            ctx.cache.put_job(copy.deepcopy(dict(body)))
        ctx.wakeup(namespace, name).set()

    @kopf.on.event("v1", "pods", labels={LABEL_JOB: kopf.PRESENT}, registry=registry)
    async def pod_changed(
        labels: Mapping[str, str],
        namespace: str | None,
        type: str | None,
        body: kopf.Body,
        **_: Any,
    ) -> None:
        namespace, job = namespace or "default", str(labels[LABEL_JOB])
        if type == "DELETED":
            meta = body.get("metadata") or {}
            ctx.cache.drop_pod(namespace, job, str(meta.get("name")), meta.get("uid"))
        else:
            ctx.cache.put_pod(namespace, job, copy.deepcopy(slim_pod(dict(body))))
        ctx.wakeup(namespace, job).set()

    async def node_changed(name: str, type: str | None, body: kopf.Body, **_: Any) -> None:
        now = ctx.clock()
        if type == "DELETED":
            changed = ctx.nodes.deleted(name, now)
        else:
            changed = ctx.nodes.observe(name, body, now)
        if changed:
            for namespace, job in ctx.cache.jobs_on_node(name):
                ctx.wakeup(namespace, job).set()

    if watch_nodes:
        kopf.on.event("v1", "nodes", registry=registry)(node_changed)

    if watch_workloads:
        on_workload = kopf.on.event(kueue.GROUP, kueue.VERSION, kueue.WORKLOADS, registry=registry,
                                    labels={kueue.JOB_UID_LABEL: kopf.PRESENT})  # fmt: skip
        on_workload(_workload_handler(ctx))

    @kopf.on.delete(API_GROUP, API_VERSION, PLURAL, registry=registry)
    async def job_deleted(name: str, namespace: str | None, body: kopf.Body, **_: Any) -> None:
        namespace = namespace or "default"
        reconciler = JobReconciler(ctx, namespace, name)
        # 1. the Pods go first (their sidecars would write the keys again), then 2. the keys
        if not ctx.fence():
            raise kopf.TemporaryError("not the leader any more", delay=2)
        left = await asyncio.to_thread(
            reconciler.stop_pods, str(body["metadata"]["uid"]), _node_lost_seconds(body)
        )
        if left:
            raise kopf.TemporaryError(
                f"waiting for {len(left)} pod(s) to stop: {', '.join(sorted(left))}", delay=1
            )
        await _release_workload(reconciler, body)
        key = (namespace, name)
        try:
            await asyncio.to_thread(reconciler.delete_prefix, dict(body))
        except (RendezvousStoreError, ValueError) as exc:
            failures = ctx._etcd_cleanup_failures[key] = ctx._etcd_cleanup_failures.get(key, 0) + 1
            if failures < ctx.finalizer_retries:
                raise kopf.TemporaryError(f"deleting the etcd keys failed: {exc}", delay=2) from exc
            log.error("%s/%s: giving up on the etcd keys: %s", namespace, name, exc)
        ctx._etcd_cleanup_failures.pop(key, None)
        for event_key in [k for k in ctx.event_counts if k[0] == namespace
                          and k[1].startswith(f"{name}.")]:  # fmt: skip
            ctx.event_counts.pop(event_key, None)
        ctx.metrics.forget(namespace, name, PHASES)
        ctx._wakeups.pop(key, None)


async def _reconcile_until_stopped(
    ctx: OperatorContext,
    reconciler: JobReconciler,
    wake: asyncio.Event,
    follower: StatusFollower,
    stopped: kopf.DaemonStopped,
) -> None:
    """Reconcile the job until its daemon stops: once now, then on each wake-up, when the
    plan asks (``requeue_after``) or every ``ctx.resync_seconds``; an API error or a bug
    is logged and retried (a bug must not stop the job's reconciling for good)."""
    namespace, name = reconciler.namespace, reconciler.name
    while not stopped:
        wake.clear()
        try:
            with ctx.metrics.time_reconcile():  # duration, outcome, errors by kind
                due = await asyncio.get_running_loop().run_in_executor(
                    RECONCILE_POOL, reconciler.reconcile_once
                )
        except ApiException as exc:
            if exc.status == 409:  # the job changed since it was read: decide again
                log.debug("%s/%s: status write conflicted; reconciling again", namespace, name)
                due = 0.05
            else:
                log.warning("%s/%s: reconcile failed: %s", namespace, name, exc)
                due = 1.0
        except (OSError, urllib3.exceptions.HTTPError) as exc:
            # urllib3's errors (e.g. MaxRetryError: the API server is unreachable) are
            # not OSErrors: an outage, not a bug.
            log.warning("%s/%s: reconcile failed: %s", namespace, name, exc)
            due = 1.0
        except Exception:  # a bug must not stop the job's reconciling for good
            log.exception("%s/%s: reconcile crashed", namespace, name)
            due = 5.0
        follower.follow(*reconciler.status_source)  # a round completing wakes us too
        timeout = ctx.resync_seconds if due is None else min(due, ctx.resync_seconds)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(wake.wait(), timeout=max(timeout, 0.05))


def _workload_handler(ctx: OperatorContext) -> Any:
    """The event handler of Kueue's Workloads: wakes the ElasticJob that owns one."""

    async def workload_changed(namespace: str | None, body: kopf.Body, **_: Any) -> None:
        for owner in (body.get("metadata") or {}).get("ownerReferences") or []:
            ours = str(owner.get("apiVersion", "")).startswith(f"{API_GROUP}/")
            if ours and owner.get("kind") == KIND:
                ctx.wakeup(namespace or "default", str(owner.get("name"))).set()

    return workload_changed


async def _release_workload(reconciler: JobReconciler, body: kopf.Body) -> None:
    """A queued job being deleted, its Pods gone: its Workload goes (its quota back now),
    Kueue's finalizer lifted (Kueue leaves an owned Workload's). Nothing for a job without
    the queue label.

    Raises:
        kopf.TemporaryError: an API call failed (the handler is retried).
    """
    if kueue.queue_name((body.get("metadata") or {}).get("labels")) is None:
        return
    try:
        await asyncio.to_thread(release_workload, reconciler.custom, reconciler.namespace,
                                reconciler.name, str(body["metadata"]["uid"]))  # fmt: skip
    except ApiException as exc:
        raise kopf.TemporaryError(f"releasing the Workload failed: {exc}", delay=2) from exc


def _node_lost_seconds(body: Mapping[str, Any]) -> float:
    """The job's ``spec.nodeLostSeconds``; the default when its spec is invalid."""
    try:
        return ElasticJobSpec.model_validate(body.get("spec") or {}).node_lost_seconds
    except ValidationError:
        return DEFAULT_NODE_LOST_SECONDS
