"""``python -m kelastic_operator``: run the ElasticJob operator (kopf).

In a cluster it logs in with the Pod's service account; elsewhere with ``$KUBECONFIG`` or
``--kubeconfig``. Leader election: replicas campaign for the ``coordination.k8s.io`` Lease
``--lease-name`` in ``--lease-namespace`` (client-go's semantics, see
:mod:`kelastic_operator.leader`); only the holder runs the handlers, the others wait, and a
SIGKILLed leader is replaced within ~12 s with the default timings. A leader that cannot
renew in time stops acting and exits 1 (its Pod restarts and campaigns again).
``--standalone`` runs without an election (one replica only). ``/metrics`` is served on
``--metrics-port``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kelastic import contract
from kelastic._extras import missing_extra

if TYPE_CHECKING:
    import kopf

    from .health import Health
    from .job_reconciler import OperatorContext
    from .leader import LeaseSettings

SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    from .pods import PodSettings  # pydantic: the 'operator' extra, imported in main()

    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m kelastic_operator", description=__doc__)
    p.add_argument(
        "--etcd-endpoints",
        default=env("KELASTIC_OPERATOR_ETCD_ENDPOINTS", ""),
        help="comma-separated host:port of the default etcd for jobs that name none "
        "($KELASTIC_OPERATOR_ETCD_ENDPOINTS)",
    )
    p.add_argument(
        "--etcd-tls-dir",
        default=env(contract.ENV_ETCD_TLS_DIR, ""),
        help="folder with ca.crt, tls.crt, tls.key for etcd with TLS client certificates "
        f"(${contract.ENV_ETCD_TLS_DIR}); plaintext when empty",
    )
    p.add_argument(
        "--sidecar-image",
        default=env("KELASTIC_OPERATOR_SIDECAR_IMAGE", PodSettings.sidecar_image),
        help="image of the kelastic sidecar ($KELASTIC_OPERATOR_SIDECAR_IMAGE)",
    )
    p.add_argument("--sidecar-http-port", type=int, default=contract.DEFAULT_HTTP_PORT)
    p.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace (repeatable); default: all namespaces",
    )
    p.add_argument(
        "--lease-name",
        "--peering",  # the name of the kopf peering object this replaced
        dest="lease_name",
        default=env("KELASTIC_OPERATOR_LEASE", "kelastic-operator"),
        help="the Lease the replicas campaign for ($KELASTIC_OPERATOR_LEASE)",
    )
    p.add_argument(
        "--lease-namespace",
        default=env("POD_NAMESPACE") or _own_namespace(),
        help="namespace of the Lease ($POD_NAMESPACE, else the service account's namespace)",
    )
    p.add_argument("--lease-duration", type=float, default=10.0, help="seconds (default 10)")
    p.add_argument("--renew-deadline", type=float, default=7.0, help="seconds (default 7)")
    p.add_argument("--retry-period", type=float, default=2.0, help="seconds (default 2)")
    p.add_argument("--priority", type=int, default=None, help=argparse.SUPPRESS)  # kopf peering's
    p.add_argument(
        "--standalone", action="store_true", help="no leader election (one replica only)"
    )
    p.add_argument("--metrics-port", type=int, default=8080, help="0 to disable /metrics")
    p.add_argument(
        "--health-port",
        type=int,
        default=8081,
        help="port of /healthz, the liveness probe's (the event loop turns; 0 to disable)",
    )
    p.add_argument(
        "--no-node-watch",
        dest="watch_nodes",
        action="store_false",
        help="do not watch Nodes (no list/watch on Nodes needed); the Pods of a Node that "
        "stops heart-beating are then never counted lost by the operator (spec.nodeLostSeconds "
        "has no effect) and stay Terminating until the Node comes back or is deleted",
    )
    p.add_argument(
        "--taint-quarantined-nodes",
        action="store_true",
        help="taint each Node a job quarantines (status.quarantinedNodes) with "
        "kelastic.dev/quarantined:NoSchedule, so that no new Pod of any job or workload "
        "lands there until its owner removes the taint; needs get and patch on Nodes",
    )
    p.add_argument(
        "--no-workload-watch",
        dest="watch_workloads",
        action="store_false",
        help="do not watch Kueue's Workloads (no list/watch on them needed); by default they "
        "are watched when the API server serves kueue.x-k8s.io/v1beta2, so a job labelled "
        "kueue.x-k8s.io/queue-name starts as soon as Kueue admits it (without the watch: at "
        "the next resync)",
    )
    p.add_argument("--resync-seconds", type=float, default=30.0)
    p.add_argument("--kubeconfig", default=env("KUBECONFIG"))
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _own_namespace() -> str:
    """The namespace of the Pod's service account, ``kelastic-system`` outside a Pod."""
    try:
        return Path(SERVICE_ACCOUNT_NAMESPACE).read_text().strip() or "kelastic-system"
    except OSError:
        return "kelastic-system"


def api_client(kubeconfig: str | None) -> Any:
    """An ApiClient of the official client: in-cluster if possible, else the kubeconfig;
    with :data:`~kelastic_operator.job_reconciler.API_CONNECTIONS` kept-alive connections.

    Raises:
        kubernetes.config.ConfigException: no credentials either way.
    """
    from kubernetes import client, config

    from .job_reconciler import API_CONNECTIONS

    cfg = client.Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    else:
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)  # type: ignore[no-untyped-call]
    cfg.connection_pool_maxsize = API_CONNECTIONS
    return client.ApiClient(cfg)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the operator until SIGINT/SIGTERM; returns the exit status (2: bad arguments,
    or the 'operator' extra is not installed)."""
    try:
        return _main(argv)
    except ModuleNotFoundError as exc:  # kopf, kubernetes, pydantic, ...
        return missing_extra("kelastic-operator", "operator", exc)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from .leader import LeaderElectionError, LeaseSettings

    try:
        lease_settings = LeaseSettings(args.lease_duration, args.renew_deadline, args.retry_period)
    except LeaderElectionError as exc:
        parser.error(str(exc))
    if args.priority is not None:
        logging.warning("--priority is ignored: leader election uses a Lease, not kopf peering")
    if args.kubeconfig:  # the kubernetes package reads it when first imported
        os.environ["KUBECONFIG"] = args.kubeconfig
    from prometheus_client import start_http_server

    from .health import Health, serve

    ctx = _context(args)
    if ctx is None:
        return 2
    health = Health()
    from .workload_client import kueue_served

    watch_workloads = args.watch_workloads and kueue_served(ctx.api)
    registry = _registry(ctx, health, args.watch_nodes, watch_workloads)
    if args.metrics_port:
        start_http_server(args.metrics_port, registry=ctx.metrics.registry)
    if args.health_port:
        serve(health, args.health_port)
    try:
        return _run(args, ctx, registry, health, None if args.standalone else lease_settings)
    finally:
        ctx.status_hubs.close()
        ctx.stores.close()


def _context(args: argparse.Namespace) -> OperatorContext | None:
    """The handlers' shared context from the arguments; None (and a line on stderr) when
    there are no Kubernetes credentials."""
    from kubernetes import config as kubernetes_config

    from .job_reconciler import OperatorContext
    from .metrics import OperatorMetrics
    from .pods import PodSettings
    from .rendezvous_store import EtcdRendezvousStore, StoreCache

    settings = PodSettings(
        sidecar_image=args.sidecar_image,
        etcd_endpoints=tuple(e.strip() for e in args.etcd_endpoints.split(",") if e.strip()),
        http_port=args.sidecar_http_port,
    )
    tls_dir = Path(args.etcd_tls_dir) if args.etcd_tls_dir else None
    # etcd auth: the operator's own user, from its env (a Secret), never from the command line
    etcd_user = os.environ.get(contract.ENV_ETCD_USER) or None
    etcd_password = os.environ.get(contract.ENV_ETCD_PASSWORD, "")
    try:
        api = api_client(args.kubeconfig)
    except kubernetes_config.ConfigException as exc:
        print(
            "kelastic-operator: no Kubernetes credentials (not in a Pod, and no kubeconfig: "
            f"--kubeconfig or $KUBECONFIG): {exc}",
            file=sys.stderr,
        )
        return None
    return OperatorContext(
        api=api,
        pod_settings=settings,
        stores=StoreCache(
            lambda eps: EtcdRendezvousStore(
                eps, tls_dir=tls_dir, user=etcd_user, password=etcd_password
            )
        ),
        resync_seconds=args.resync_seconds,
        taint_nodes=args.taint_quarantined_nodes,
        metrics=OperatorMetrics(),
        instance=os.environ.get("POD_ID", ""),
    )


def _registry(
    ctx: OperatorContext, health: Health, watch_nodes: bool = True, watch_workloads: bool = False
) -> kopf.OperatorRegistry:
    """kopf's registry: the ElasticJob handlers (with the Node watch when
    ``watch_nodes``, Kueue's Workloads' when ``watch_workloads``), the login, and the
    event loop's heartbeat for /healthz."""
    import kopf

    from .handlers import register

    registry = kopf.OperatorRegistry()
    register(registry, ctx, watch_nodes, watch_workloads)
    tickers: set[asyncio.Task[None]] = set()

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        """kopf logs in as the official client does (in-cluster, else the kubeconfig)."""
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    async def start_ticking(**_: Any) -> None:
        """The event loop's heartbeat for /healthz (kept until the loop stops)."""
        ticker = asyncio.get_running_loop().create_task(health.ticker())
        tickers.add(ticker)
        ticker.add_done_callback(tickers.discard)

    return registry


def _run(
    args: argparse.Namespace,
    ctx: OperatorContext,
    registry: kopf.OperatorRegistry,
    health: Health,
    lease_settings: LeaseSettings | None,
) -> int:
    """Campaign for the Lease (unless ``lease_settings`` is None: standalone), then run
    kopf until a signal or the loss of the Lease. Returns the exit status: 1 when this
    replica lost the election (its Pod restarts and campaigns again), else 0."""
    import kopf

    from .leader import LeaseElector

    stop_kopf, shutdown = threading.Event(), threading.Event()
    leading, lost = threading.Event(), threading.Event()
    elector_thread = None
    if lease_settings is not None:
        identity = f"{os.environ.get('POD_ID') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"
        elector = LeaseElector(
            ctx.api, args.lease_namespace, args.lease_name, identity, lease_settings
        )
        ctx.fence = elector.is_leader

        def stopped_leading() -> None:
            lost.set()
            stop_kopf.set()

        elector_thread = threading.Thread(
            target=elector.run, args=(leading.set, stopped_leading, shutdown), daemon=True
        )
        elector_thread.start()
        health.campaigning = elector_thread.is_alive

        def on_signal(signum: int, frame: object) -> None:
            shutdown.set()
            leading.set()  # wake the wait below

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        logging.info("waiting to lead (Lease %s/%s as %s)", args.lease_namespace,
                     args.lease_name, identity)  # fmt: skip
        leading.wait()
    settings = kopf.OperatorSettings()
    settings.posting.enabled = True

    async def run_kopf() -> None:
        try:
            await kopf.operator(
                registry=registry,
                settings=settings,
                standalone=True,
                namespaces=args.namespace,
                clusterwide=not args.namespace,
                stop_flag=stop_kopf,
            )
        finally:
            # kopf waits on a threading.Event in an executor thread, which asyncio.run()
            # joins on exit: a stop by signal must release it too
            stop_kopf.set()

    if not shutdown.is_set():
        asyncio.run(run_kopf())
    shutdown.set()  # the elector releases the Lease
    if elector_thread is not None:
        elector_thread.join(10)
    if lost.is_set():
        logging.error("exiting: this replica lost the leader election")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
