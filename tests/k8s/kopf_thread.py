"""Run a kopf operator in a thread, logged in to the test cluster as a given identity.

with KopfThread(client, registry, namespaces=[ns]):   # waits until kopf is ready
    ...
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import yaml

from .cluster import Client

if TYPE_CHECKING:
    import kopf


def connection_info(client: Client) -> kopf.ConnectionInfo:
    """kopf's login for the identity of ``client``'s kubeconfig (token or client cert)."""
    import kopf

    doc = yaml.safe_load(client.kubeconfig.read_text())
    cluster = doc["clusters"][0]["cluster"]
    user = doc["users"][0]["user"]
    return kopf.ConnectionInfo(
        server=cluster["server"],
        ca_path=cluster.get("certificate-authority"),
        token=user.get("token"),
        certificate_path=user.get("client-certificate"),
        private_key_path=user.get("client-key"),
        default_namespace=client.namespace,
    )


class KopfThread:
    """Run ``kopf.operator()`` for a registry in a thread, logged in as ``api``'s identity.

    Use as a context manager: entering waits until kopf is ready, exiting stops it and
    re-raises what killed it. By default it serves only ``api``'s namespace (each test has
    its own), ``clusterwide=True`` serves all.
    """

    def __init__(
        self,
        api: Client,
        registry: kopf.OperatorRegistry,
        *,
        settings: kopf.OperatorSettings | None = None,
        clusterwide: bool = False,
        namespaces: Collection[str] = (),
    ) -> None:
        import kopf

        self.api = api
        self.registry = registry
        self.settings = settings or fast_kopf_settings()
        self.clusterwide = clusterwide
        self.namespaces = tuple(namespaces) or (() if clusterwide else (api.namespace,))
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._errors: list[BaseException] = []
        self._thread: threading.Thread | None = None

        @kopf.on.login(registry=registry)
        def _login(**_: Any) -> kopf.ConnectionInfo:
            return connection_info(api)

    def _run(self) -> None:
        import kopf

        try:
            asyncio.run(
                kopf.operator(
                    registry=self.registry,
                    settings=self.settings,
                    standalone=True,
                    clusterwide=self.clusterwide,
                    namespaces=self.namespaces,
                    stop_flag=self._stop,
                    ready_flag=self._ready,
                )
            )
        except BaseException as exc:
            self._errors.append(exc)
            self._ready.set()

    def __enter__(self) -> KopfThread:
        self._thread = threading.Thread(target=self._run, name="kopf-operator", daemon=True)
        self._thread.start()
        if not self._ready.wait(20):
            raise AssertionError("kopf did not become ready in 20 s")
        if self._errors:
            raise self._errors[0]
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(20)
            if self._thread.is_alive():
                raise AssertionError("kopf did not stop in 20 s")
        if self._errors:
            raise self._errors[0]


def fast_kopf_settings() -> kopf.OperatorSettings:
    """Kopf settings for quick tests: short timeouts, quiet event posting."""
    import kopf

    settings = kopf.OperatorSettings()
    settings.watching.server_timeout = 30
    settings.watching.client_timeout = 40
    settings.networking.request_timeout = 10
    settings.process.ultimate_exiting_timeout = 5
    return settings
