"""The operator's API client keeps a connection for each thread that may use it at once
(every reconcile pass and every Pod write), so a busy operator never opens and throws
away connections (a TLS handshake each, on the API server too)."""

from __future__ import annotations

from pathlib import Path

import yaml

from kelastic_operator.__main__ import api_client
from kelastic_operator.job_reconciler import (
    API_CONNECTIONS,
    MAX_CREATE_BATCH,
    RECONCILE_POOL,
    RECONCILE_THREADS,
)


def test_the_client_pools_a_connection_for_every_thread(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "https://10.9.8.7:6443"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
    }))  # fmt: skip
    api = api_client(str(kubeconfig))
    assert api.configuration.host == "https://10.9.8.7:6443"
    assert api.configuration.connection_pool_maxsize == API_CONNECTIONS
    assert API_CONNECTIONS >= RECONCILE_THREADS + MAX_CREATE_BATCH
    assert RECONCILE_POOL._max_workers == RECONCILE_THREADS  # not asyncio's cores + 4
