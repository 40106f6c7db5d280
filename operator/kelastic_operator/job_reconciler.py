"""One reconcile pass of one ElasticJob against the API and etcd: observe, call
:func:`~kelastic_operator.reconcile.reconcile`, apply (blocking calls; kopf's handlers in
:mod:`kelastic_operator.handlers` run it in a thread).

A pass (:meth:`JobReconciler.reconcile_once`) reads the job and its Pods from the watch
cache (the API only for what it does not know), reads the rendezvous view from etcd
(optional: reconcile works without it), and applies the plan: the status first (a patch
conditional on the job's resourceVersion, so the accounting is stored before the actions
it counts; a failed write means this pass does nothing), then rendezvous departures and
removals, Pod deletions and creations (slow-start batches), Events (aggregated).
A job labelled ``kueue.x-k8s.io/queue-name`` has its Workload read (created when missing)
before the decision, its admission's flavors placing the Pods created, and the Workload
settled after (:mod:`~kelastic_operator.workload_client`: an evicted job's quota given
back once its Pods are gone, a finished job's Workload marked Finished).
Only the leader acts: a pass applies nothing while :attr:`OperatorContext.fence` is false
(leader election on a Lease, :mod:`kelastic_operator.leader`).

Over ~400 lines because it is one cohesive thing: one pass's observe-and-apply cycle and
the context it runs in; the order of its writes (status first, then etcd, Pod deletions
and creations, Events) is what makes a pass safe to repeat or interrupt, and is read in
one place.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, cast

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from kelastic import contract

from .api_errors import api_message
from .inprocess_status import restart_increases
from .kueue import Placement, place_pods, queue_gate, queue_name
from .labels import LABEL_UID, selector
from .metrics import OperatorMetrics
from .model import (
    API_GROUP,
    API_VERSION,
    DEFAULT_NODE_LOST_SECONDS,
    PHASES,
    TERMINAL_PHASES,
    ElasticJobSpec,
    ElasticJobStatus,
)
from .node_health import NodeHealth
from .node_taint import taint_node, taint_value
from .pods import PodBuildError, PodSettings, build_pod, etcd_endpoints, trainer_name
from .reconcile import (
    LOST_REASON,
    REPLACE_REASON,
    Event,
    JobView,
    Plan,
    PodView,
    RendezvousView,
    pod_view,
    reconcile,
    reconcile_invalid,
)
from .rendezvous_store import RendezvousStore, RendezvousStoreError, StoreCache
from .rendezvous_watch import StatusHubs
from .status import event_body, status_patch
from .watch_cache import WatchCache
from .workload_client import ensure_workload, pod_placement, settle_workload

PLURAL = "elasticjobs"
#: Most Pods created at once by one reconcile pass (slow start: 1, 2, 4, ... up to this).
MAX_CREATE_BATCH = 16
#: Threads that send the Pod creations and deletions of every job's passes.
_WRITE_POOL = concurrent.futures.ThreadPoolExecutor(
    max_workers=MAX_CREATE_BATCH, thread_name_prefix="kelastic-write"
)
#: Reconcile passes run at once, over every job (each pass blocks on the API while it
#: reads, creates through :data:`_WRITE_POOL` and writes the status). asyncio's default
#: executor has min(32, cores + 4) threads: 6 on a 2-core operator Pod, where a queue
#: admitting 100 jobs at once waited for 6 passes at a time (reconcile p99 30 s).
RECONCILE_THREADS = 32
RECONCILE_POOL = concurrent.futures.ThreadPoolExecutor(
    max_workers=RECONCILE_THREADS, thread_name_prefix="kelastic-reconcile"
)
#: Kept-alive connections of the operator's API client: every reconcile and write thread
#: at once, and a few for the rest (the Node and Kueue clients). The official client's
#: default is 5 per core: with more threads than that, each request beyond it opened a
#: connection (a TLS handshake on both sides) and threw it away.
API_CONNECTIONS = RECONCILE_THREADS + MAX_CREATE_BATCH + 8
log = logging.getLogger("kelastic_operator")


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(timezone.utc)


@dataclass
class OperatorContext:
    """What the handlers share.

    Attributes:
        api: the official client's ApiClient (in-cluster or from a kubeconfig).
        pod_settings: operator-wide Pod settings (sidecar image, default etcd...).
        stores: etcd access per endpoint list.
        status_hubs: one etcd watch per store that wakes the jobs whose status changed
            (:mod:`~kelastic_operator.rendezvous_watch`).
        resync_seconds: longest time between two passes of a job.
        finalizer_retries: attempts at deleting a job's etcd prefix before giving up
            (so that an unreachable etcd cannot block the job's deletion forever).
        clock: the time source (tests may fix it).
        metrics: the operator's metrics.
        instance: this operator's name (``reportingInstance`` of its Events).
        cache: the jobs and Pods the watch streams reported (a pass reads the API only
            for what it does not know: an idle job costs no API request).
        fence: whether this replica may act now (the leader election's
            :meth:`~kelastic_operator.leader.LeaseElector.is_leader`); a pass that finds it
            false writes nothing.
        nodes: the Nodes that are not Ready, as the Node watch reports them (empty when
            the operator does not watch Nodes: no Pod is then ever counted lost).
        taint_nodes: taint each Node a job quarantines (:mod:`~kelastic_operator.node_taint`;
            needs ``get``/``patch`` on Nodes).
    """

    api: client.ApiClient
    pod_settings: PodSettings
    stores: StoreCache = field(default_factory=StoreCache)
    status_hubs: StatusHubs = field(default_factory=StatusHubs)
    resync_seconds: float = 30.0
    finalizer_retries: int = 5
    clock: Callable[[], datetime] = utcnow
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    instance: str = ""
    fence: Callable[[], bool] = lambda: True
    cache: WatchCache = field(default_factory=WatchCache)
    nodes: NodeHealth = field(default_factory=NodeHealth)
    taint_nodes: bool = False
    _wakeups: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    _etcd_cleanup_failures: dict[tuple[str, str], int] = field(default_factory=dict)
    #: (namespace, Event name) -> count posted, for aggregating repeats
    event_counts: dict[tuple[str, str], int] = field(default_factory=dict)

    def wakeup(self, namespace: str, name: str) -> asyncio.Event:
        """The event that wakes the daemon of job ``namespace/name`` (created on demand)."""
        return self._wakeups.setdefault((namespace, name), asyncio.Event())


class JobReconciler:
    """One reconcile pass of one job against the API and etcd (blocking calls).

    Args:
        ctx: the shared context.
        namespace, name: the job.
    """

    def __init__(self, ctx: OperatorContext, namespace: str, name: str) -> None:
        self.ctx = ctx
        self.namespace = namespace
        self.name = name
        self.core = client.CoreV1Api(ctx.api)
        self.custom = client.CustomObjectsApi(ctx.api)
        #: where the job's status is read from in etcd, (store, job prefix), as the last
        #: pass that completed found it; (None, None) when there is none, or the job has
        #: finished or is being deleted (no watch is kept for it)
        self.status_source: tuple[RendezvousStore | None, str | None] = (None, None)

    def _get_job(self) -> dict[str, Any] | None:
        """The job as the watch last told it; read from the API when not known yet."""
        cached = self.ctx.cache.job(self.namespace, self.name)
        if cached is not None:
            return cached
        try:
            obj = cast(
                "dict[str, Any]",
                self.custom.get_namespaced_custom_object(
                    API_GROUP, API_VERSION, self.namespace, PLURAL, self.name
                ),
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        self.ctx.cache.put_job(obj)
        return obj

    def _pods(self, uid: str, trainer: str) -> list[PodView]:
        """The job's Pods as the watch told them; listed from the API when never listed
        or when the cache's relist is due."""
        pods = self.ctx.cache.pods(self.namespace, self.name)
        if pods is None:
            listed = self.core.list_namespaced_pod(
                self.namespace, label_selector=selector(self.name), _preload_content=False
            )
            # raw JSON: the client's models are slow
            pods = json.loads(cast(Any, listed).data)["items"]
            self.ctx.cache.replace_pods(self.namespace, self.name, pods)
        views = []
        for pod in pods:
            labels = (pod.get("metadata") or {}).get("labels") or {}
            view = pod_view(self.name, pod, trainer)
            if view is None:
                continue
            lost_since = self.ctx.nodes.since(view.node_name) if view.node_name else None
            if lost_since is not None:
                view = dataclasses.replace(view, node_not_ready_since=lost_since)
            if labels.get(LABEL_UID, uid) != uid:
                # a Pod of an earlier job of the same name, being collected: it holds its
                # name until it is gone, and is not ours
                view = dataclasses.replace(view, deleting=True, phase="Unknown")
            views.append(view)
        return views

    def _rendezvous(
        self, spec: ElasticJobSpec, prefix: str
    ) -> tuple[RendezvousView | None, RendezvousStore | None]:
        """The job's rendezvous view and store; either is None when it cannot be had."""
        try:
            store = self.ctx.stores.get(etcd_endpoints(spec, self.ctx.pod_settings))
        except (PodBuildError, ValueError) as exc:
            log.warning("%s/%s: no usable etcd: %s", self.namespace, self.name, exc)
            return None, None
        try:
            replicated = spec.checkpoint.replicated
            return store.read(prefix, spec.nproc_per_node, replicated=replicated), store
        except RendezvousStoreError as exc:
            log.warning("%s/%s: cannot read rendezvous state: %s", self.namespace, self.name, exc)
            return None, store

    def reconcile_once(self) -> float | None:
        """Observe, decide, apply once.

        Returns:
            Seconds until the next pass is due (None: only on a change or the resync).

        Raises:
            ApiException: an API call failed other than with 404/409 (kopf logs it and
                the daemon retries).
        """
        obj = self._get_job()
        if obj is None or obj["metadata"].get("deletionTimestamp"):
            self.status_source = (None, None)
            return None
        meta = obj["metadata"]
        uid = str(meta["uid"])
        now = self.ctx.clock()
        old = ElasticJobStatus.model_validate(obj.get("status") or {})
        try:
            spec = ElasticJobSpec.model_validate(obj.get("spec") or {})
        except ValidationError as exc:
            self.status_source = (None, None)
            self._invalid(obj, old, validation_message(exc), now)
            return None
        prefix = contract.job_prefix(self.namespace, self.name, uid)
        queue = queue_name(meta.get("labels"))  # Kueue admits it: its Workload, made if missing
        workload, refused = ensure_workload(self.custom, self.ctx.pod_settings, obj, spec,
                                            old.phase in TERMINAL_PHASES, queue)  # fmt: skip
        view = JobView(
            name=self.name,
            namespace=self.namespace,
            uid=uid,
            generation=int(meta.get("generation") or 1),
            spec=spec,
            status=old,
            queue=queue_gate(queue, workload, spec),
        )
        pods = self._pods(uid, trainer_name(spec.template))
        rdzv, store = self._rendezvous(spec, prefix)
        plan = reconcile(view, pods, now, rdzv)
        plan.events.extend(refused)
        if not self.ctx.fence():
            self.status_source = (None, None)
            log.warning(
                "%s/%s: not the leader any more: nothing applied", self.namespace, self.name
            )
            return None
        where = pod_placement(self.custom, workload, view.queue, plan)
        self._apply(obj, spec, old, plan, store, prefix, now, where)
        settle_workload(self.custom, view, workload, len(pods), plan, now)
        self.ctx.metrics.set_phase(self.namespace, self.name, plan.status.phase, PHASES)
        # (a pass that raised keeps the last one: an API error does not drop the watch)
        finished = plan.status.phase in TERMINAL_PHASES
        self.status_source = (None, None) if finished else (store, prefix)
        return plan.requeue_after

    def _apply(
        self,
        obj: dict[str, Any],
        spec: ElasticJobSpec,
        old: ElasticJobStatus,
        plan: Plan,
        store: RendezvousStore | None,
        prefix: str,
        now: datetime,
        where: Placement | None = None,
    ) -> None:
        uid = str(obj["metadata"]["uid"])
        # status first, conditional on the job as observed: the accounting (replacements,
        # failures counted) must be stored before the actions it counts. A failed write
        # (conflict, throttling, outage) raises: this pass acts on nothing, the next one
        # decides again from what is stored.
        if plan.status_changed:
            body = status_patch(old, plan.status)
            body["metadata"] = {"resourceVersion": obj["metadata"]["resourceVersion"]}
            try:
                written = self.custom.patch_namespaced_custom_object_status(
                    API_GROUP, API_VERSION, self.namespace, PLURAL, self.name, body
                )
            except ApiException as exc:
                if exc.status == 409:  # the job as known is stale: read it again next time
                    self.ctx.cache.drop_job_body(self.namespace, self.name)
                raise
            self.ctx.cache.put_job(cast("dict[str, Any]", written))
            for level, grew in restart_increases(old, plan.status).items():
                self.ctx.metrics.restarts.labels(level).inc(grew)
        for uid, why in plan.fence:
            if store is None:
                break
            try:  # before the Pod is deleted and another of its name made
                store.fence(prefix, uid, why)
            except RendezvousStoreError as exc:
                log.warning("%s/%s: fencing pod uid %s failed: %s", self.namespace, self.name,
                            uid, exc)  # fmt: skip
        for nodes, reason in (
            (plan.depart_nodes, contract.DEPARTURE_SCALE_DOWN),
            (plan.disrupted_nodes, contract.DEPARTURE_DISRUPTION),
        ):
            if not nodes or store is None:
                continue
            try:
                store.mark_departing(prefix, nodes, reason)
            except RendezvousStoreError as exc:
                log.warning("%s/%s: posting departures failed: %s", self.namespace, self.name, exc)
        if plan.remove_nodes and store is not None:
            try:
                store.remove_nodes(prefix, plan.remove_nodes)
                self.ctx.metrics.nodes_removed.inc(len(plan.remove_nodes))
            except RendezvousStoreError as exc:
                log.warning("%s/%s: removing nodes failed: %s", self.namespace, self.name, exc)
        if plan.clear_departures and store is not None:
            try:
                store.clear_departing(prefix, plan.clear_departures)
            except RendezvousStoreError as exc:  # the Pods still come: only accounting
                log.warning("%s/%s: clearing departures failed: %s", self.namespace, self.name, exc)
        for delete in plan.delete:
            log.info("%s/%s: %sdeleting pod %s (%s)", self.namespace, self.name,
                     "force-" if delete.force else "", delete.name, delete.reason)  # fmt: skip
            if not self._delete_one(delete.name, delete.force):
                continue
            if delete.reason == REPLACE_REASON:
                self.ctx.metrics.pod_replacements.inc()
            if delete.reason == LOST_REASON:
                self.ctx.metrics.pods_lost.inc()
        try:
            pods = [
                build_pod(
                    self.name,
                    self.namespace,
                    uid,
                    spec,
                    c.index,
                    self.ctx.pod_settings,
                    plan.status.quarantined_nodes,
                )
                for c in plan.create
            ]
        except PodBuildError as exc:
            plan.events.append(Event("Warning", "FailedCreate", str(exc)))
            pods = []
        place_pods(pods, where)  # Kueue's admission: its flavors' node labels, tolerations
        refused = self._create(pods)
        if refused is not None:
            plan.events.append(Event("Warning", "FailedCreate", refused))
        for node in plan.taint_nodes if self.ctx.taint_nodes else []:
            plan.events.append(
                taint_node(self.core, node, taint_value(self.namespace, self.name), now)
            )
        for event in plan.events:
            self._post(event, uid, now)
        if plan.delete_job:
            self._delete_job(uid)

    def _delete_job(self, uid: str) -> None:
        """Delete the job (``ttlSecondsAfterFinished`` passed), only the one of ``uid``: a
        job re-created under the same name meanwhile is not touched (a precondition the API
        server checks). Its finalizer then stops its Pods and deletes its etcd keys.

        Raises:
            ApiException: the delete failed other than with 404 (gone) or 409 (another
                job of that name now).
        """
        log.info("%s/%s: ttlSecondsAfterFinished passed: deleting the job",
                 self.namespace, self.name)  # fmt: skip
        try:
            self.custom.delete_namespaced_custom_object(
                API_GROUP, API_VERSION, self.namespace, PLURAL, self.name,
                body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)),
            )  # fmt: skip
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    def _create(self, pods: list[dict[str, Any]]) -> str | None:
        """Create ``pods`` in slow-start batches (1, 2, 4, ... up to
        :data:`MAX_CREATE_BATCH` at once, as the ReplicaSet controller does): a job of many
        replicas is created quickly, and a refusal (quota, admission, invalid template)
        stops it after one failed batch instead of one refusal per Pod.

        Returns:
            The first refusal's message (``creating pod <name>: <why>``), None when none.

        Raises:
            ApiException: a create failed other than with 409 (already there) or a 4xx.
        """
        done, size = 0, 1
        while done < len(pods):
            batch = pods[done : done + size]
            outcomes = list(_WRITE_POOL.map(self._create_one, batch))
            refusals = [o for o in outcomes if o is not None]
            if refusals:
                return refusals[0]
            done, size = done + len(batch), min(size * 2, MAX_CREATE_BATCH)
        return None

    def _create_one(self, pod: dict[str, Any]) -> str | None:
        """Create one Pod; returns a refusal's message, None when created or already there."""
        try:
            created = self.core.create_namespaced_pod(
                self.namespace, cast(Any, pod), _preload_content=False
            )
        except ApiException as exc:
            if exc.status == 409:  # already there (an earlier pass or a stale pod)
                return None
            if exc.status is None or not 400 <= exc.status < 500:
                raise
            # refused (invalid template, quota, admission): say so, as ReplicaSets do
            return f"creating pod {pod['metadata']['name']}: {api_message(exc)}"
        self.ctx.metrics.pods_created.inc()
        # raw JSON: the client's models cost ~10x the request's own CPU at thousands of Pods
        self.ctx.cache.put_pod(self.namespace, self.name, json.loads(cast(Any, created).data))
        return None

    def _post(self, event: Event, uid: str, now: datetime) -> None:
        """Post an Event, or count a repeat of it on the existing one (aggregation)."""
        body = event_body(event, self.name, self.namespace, uid, now, self.ctx.instance)
        key = (self.namespace, str(body["metadata"]["name"]))
        try:
            try:
                self.core.create_namespaced_event(self.namespace, cast(Any, body))
                self.ctx.event_counts[key] = 1
                return
            except ApiException as exc:
                if exc.status != 409:
                    raise
            count = self.ctx.event_counts.get(key)
            if count is None:  # posted by an earlier operator process
                existing = self.core.read_namespaced_event(key[1], self.namespace)
                count = int(existing.count or 1)
            self.core.patch_namespaced_event(key[1], self.namespace, {
                "count": count + 1, "message": body["message"],
                "lastTimestamp": body["lastTimestamp"],
                "reportingInstance": body["reportingInstance"],
            })  # fmt: skip
            self.ctx.event_counts[key] = count + 1
        except ApiException as exc:  # events are best effort
            log.warning("%s/%s: posting event %s failed: %s", self.namespace, self.name,
                        event.reason, exc.reason)  # fmt: skip

    def _invalid(
        self, obj: dict[str, Any], old: ElasticJobStatus, error: str, now: datetime
    ) -> None:
        generation = int(obj["metadata"].get("generation") or 1)
        plan = reconcile_invalid(old, generation, error, now)
        if plan.status_changed:
            self.custom.patch_namespaced_custom_object_status(
                API_GROUP, API_VERSION, self.namespace, PLURAL, self.name,
                status_patch(old, plan.status),
            )  # fmt: skip
        for event in plan.events:
            self._post(event, str(obj["metadata"]["uid"]), now)

    def stop_pods(
        self, uid: str, node_lost_seconds: float = DEFAULT_NODE_LOST_SECONDS
    ) -> list[str]:
        """Delete the job's Pods (the first step of deleting a job) and say which are
        still there: the job's etcd keys may go only once no sidecar can write them again.
        A Pod whose Node has not been Ready for ``node_lost_seconds`` is force-deleted
        (nothing would ever confirm its graceful deletion: the job's deletion would wait
        for good).

        Returns:
            Names of the job's Pods that still exist (being deleted or just deleted).

        Raises:
            ApiException: listing or deleting failed other than with 404.
        """
        listed = self.core.list_namespaced_pod(self.namespace, label_selector=selector(self.name))
        now = self.ctx.clock()
        left, running, lost = [], [], []
        for pod in self.ctx.api.sanitize_for_serialization(listed.items):  # type: ignore[no-untyped-call]
            meta = pod.get("metadata") or {}
            if (meta.get("labels") or {}).get(LABEL_UID, uid) != uid:
                continue
            name = str(meta["name"])
            left.append(name)
            since = self.ctx.nodes.since(str((pod.get("spec") or {}).get("nodeName") or ""))
            if since is not None and (now - since).total_seconds() >= node_lost_seconds:
                lost.append(name)
            elif not meta.get("deletionTimestamp"):
                running.append(name)
        list(_WRITE_POOL.map(self._delete_one, running))
        list(_WRITE_POOL.map(lambda name: self._delete_one(name, force=True), lost))
        return left

    def _delete_one(self, name: str, force: bool = False) -> bool:
        """Delete Pod ``name`` (``force``: grace period 0). Returns False when it was gone
        already.

        Raises:
            ApiException: the deletion failed other than with 404.
        """
        try:
            if force:
                self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0)
            else:
                self.core.delete_namespaced_pod(name, self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            return False
        self.ctx.metrics.pods_deleted.inc()
        return True

    def delete_prefix(self, obj: dict[str, Any]) -> None:
        """Delete the job's etcd prefix (the finalizer's work).

        Raises:
            RendezvousStoreError: etcd is unreachable.
        """
        prefix = contract.job_prefix(self.namespace, self.name, str(obj["metadata"]["uid"]))
        rdzv = (obj.get("spec") or {}).get("rendezvous") or {}
        endpoints = list(rdzv.get("etcdEndpoints") or []) or list(
            self.ctx.pod_settings.etcd_endpoints
        )
        if not endpoints:
            return  # no etcd: nothing stored
        self.ctx.stores.get(endpoints).delete_prefix(prefix)
        log.info("%s/%s: deleted etcd prefix %s", self.namespace, self.name, prefix)


def validation_message(exc: ValidationError) -> str:
    """One line per problem, ``spec.<field>: <message>``, like ``kelastic run`` prints."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in ("spec", *err["loc"]))
        lines.append(f"{where}: {err['msg'].removeprefix('Value error, ')}")
    return "invalid spec: " + "; ".join(lines)
