"""``kelastic-sidecar`` / ``python -m kelastic_sidecar``: run one node's sidecar.

Configuration comes from the environment the operator (or ``kelastic run``) sets; see
:class:`kelastic_sidecar.config.SidecarConfig` and :mod:`kelastic.contract`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kelastic import contract
from kelastic._extras import missing_extra

from .config import ConfigError, SidecarConfig

_MAX, _PORT = contract.DEFAULT_MAX_RESTARTS, contract.DEFAULT_HTTP_PORT
_ENV_HELP = f"""
environment (set by the operator or by `kelastic run`):
  {contract.ENV_JOB_NAME}, {contract.ENV_NAMESPACE}, {contract.ENV_JOB_UID}   job identity
  {contract.ENV_POD_NAME}, {contract.ENV_POD_IP}          this node's name and address
  {contract.ENV_ETCD_ENDPOINTS}              host:port[,host:port...]
  {contract.ENV_ETCD_TLS_DIR}                dir with ca.crt, tls.crt, tls.key (optional)
  {contract.ENV_MIN_NODES}, {contract.ENV_MAX_NODES}  rendezvous bounds
  {contract.ENV_NPROC_PER_NODE}             workers per node (default 1)
  {contract.ENV_MAX_RESTARTS}               global restart budget (default {_MAX})
  {contract.ENV_JOIN_TIMEOUT}, {contract.ENV_LAST_CALL_TIMEOUT}, {contract.ENV_LEASE_TTL}  seconds
  {contract.ENV_HTTP_PORT}                  /metrics /healthz /readyz /status (default {_PORT})
  {contract.ENV_RUN_DIR}                    shared volume (default {contract.DEFAULT_RUN_DIR})
  {contract.ENV_CHECKPOINT_DIR}, {contract.ENV_CHECKPOINT_MEMORY}  checkpoint volume, bytes
"""


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (0 job succeeded on this node, 1 failed, 2 bad
    configuration, 128+N stopped by signal N)."""
    parser = argparse.ArgumentParser(
        prog="kelastic-sidecar",
        description="kelastic sidecar: expiration-timer server, rendezvous on etcd and the "
        "worker-group supervisor for one node of an ElasticJob.",
        epilog=_ENV_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname).1s sidecar %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:  # grpc, pyetcd, prometheus_client: the 'sidecar' extra
        from .checkpoint_volume import prepare_volume
        from .supervisor import Supervisor
    except ModuleNotFoundError as exc:
        return missing_extra("kelastic-sidecar", "sidecar", exc)
    try:
        config = SidecarConfig.from_env()
        prepare_volume(os.environ)  # a checkpoint volume too small fails now
    except (ConfigError, ValueError) as exc:
        print(f"kelastic-sidecar: {exc}", file=sys.stderr)
        return contract.SIDECAR_EXIT_CONFIG
    return Supervisor(config).run()


if __name__ == "__main__":
    sys.exit(main())
