"""``python -m kelastic_operator``: run the ElasticJob operator (kopf).

In a cluster it logs in with the Pod's service account; elsewhere with ``$KUBECONFIG`` or
``--kubeconfig``. Leader election: with ``--peering NAME`` (the default, ``kelastic``)
several replicas coordinate through kopf's ``ClusterKopfPeering``/``KopfPeering`` object of
that name and only the highest-priority one handles resources (give each replica a
different ``--priority``, or rely on kopf's random tie-breaking); ``--standalone`` turns
peering off. ``/metrics`` is served on ``--metrics-port``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kelastic import contract

from .pods import PodSettings


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
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
    p.add_argument("--peering", default=env("KELASTIC_OPERATOR_PEERING", "kelastic"))
    p.add_argument("--priority", type=int, default=int(env("KELASTIC_OPERATOR_PRIORITY", "0")))
    p.add_argument("--standalone", action="store_true", help="no peering (one replica only)")
    p.add_argument("--metrics-port", type=int, default=8080, help="0 to disable /metrics")
    p.add_argument("--resync-seconds", type=float, default=30.0)
    p.add_argument("--kubeconfig", default=env("KUBECONFIG"))
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def api_client(kubeconfig: str | None) -> Any:
    """An ApiClient of the official client: in-cluster if possible, else the kubeconfig."""
    from kubernetes import client, config

    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()  # type: ignore[no-untyped-call]
        return client.ApiClient()
    return config.new_client_from_config(config_file=kubeconfig)  # type: ignore[no-untyped-call]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the operator until SIGINT/SIGTERM; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.kubeconfig:  # the kubernetes package reads it when first imported
        os.environ["KUBECONFIG"] = args.kubeconfig
    import kopf
    from prometheus_client import start_http_server

    from .handlers import OperatorContext, register
    from .metrics import OperatorMetrics
    from .rendezvous_store import EtcdRendezvousStore, StoreCache

    settings = PodSettings(
        sidecar_image=args.sidecar_image,
        etcd_endpoints=tuple(e.strip() for e in args.etcd_endpoints.split(",") if e.strip()),
        http_port=args.sidecar_http_port,
    )
    metrics = OperatorMetrics()
    tls_dir = Path(args.etcd_tls_dir) if args.etcd_tls_dir else None
    ctx = OperatorContext(
        api=api_client(args.kubeconfig),
        pod_settings=settings,
        stores=StoreCache(lambda eps: EtcdRendezvousStore(eps, tls_dir=tls_dir)),
        resync_seconds=args.resync_seconds,
        metrics=metrics,
        instance=os.environ.get("POD_ID", ""),
    )
    registry = kopf.OperatorRegistry()
    register(registry, ctx)

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        """kopf logs in as the official client does (in-cluster, else the kubeconfig)."""
        return kopf.login_via_client(**kwargs)

    kopf_settings = kopf.OperatorSettings()
    kopf_settings.peering.priority = args.priority
    kopf_settings.peering.mandatory = not args.standalone
    kopf_settings.posting.enabled = True
    if args.metrics_port:
        start_http_server(args.metrics_port, registry=metrics.registry)
    asyncio.run(
        kopf.operator(
            registry=registry,
            settings=kopf_settings,
            standalone=args.standalone,
            peering_name=None if args.standalone else args.peering,
            namespaces=args.namespace,
            clusterwide=not args.namespace,
        )
    )
    ctx.stores.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
