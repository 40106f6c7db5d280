"""kelastic_etcd's error taxonomy and etcd authentication, against real etcd."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyetcd import etcdrpc

from kelastic import contract
from kelastic_etcd import (
    EtcdClient,
    EtcdError,
    EtcdLeaseNotFound,
    EtcdRefused,
    EtcdUnavailable,
    Watcher,
)
from kelastic_operator.local.etcd import EmbeddedEtcd
from kelastic_operator.rendezvous_store import EtcdRendezvousStore, RendezvousStoreError
from kelastic_sidecar.config import SidecarConfig

ROOT_PASSWORD = "s3cret-root"


def test_an_invalid_argument_surfaces_at_once_as_refused_and_is_not_retried(
    etcd_endpoint: str,
) -> None:
    # etcd refuses a transaction with more operations than --max-txn-ops (128): it
    # would refuse it again, so it is no outage to ride out.
    with EtcdClient([etcd_endpoint], timeout=30.0) as client:
        errors: list[Exception] = []
        client.on_error = errors.append
        keys = [f"/kelastic-test/refused/{i}" for i in range(200)]
        started = time.monotonic()
        with pytest.raises(EtcdRefused, match="INVALID_ARGUMENT") as err:
            client.read(keys)
        assert time.monotonic() - started < 2.0  # not retried until the 30 s deadline
        assert client.request_counts()["read"] == 1  # one try, no retry
        assert not isinstance(err.value, EtcdUnavailable)
        assert isinstance(err.value, EtcdError)  # the old name still catches it
        assert errors == [err.value]
        assert client.read(keys[:100]).values == {}  # the client goes on working


def test_a_lease_etcd_no_longer_knows_is_lease_not_found(etcd_endpoint: str) -> None:
    with EtcdClient([etcd_endpoint], timeout=5.0) as client:
        lease = client.grant_lease(5)
        lease.revoke()
        with pytest.raises(EtcdLeaseNotFound):
            client.put("/kelastic-test/lease-gone", b"x", lease=lease.id)
        assert issubclass(EtcdLeaseNotFound, EtcdRefused)


def test_an_unreachable_etcd_is_unavailable_after_the_deadline() -> None:
    from kelastic_operator.local.etcd import free_port

    with EtcdClient([f"127.0.0.1:{free_port()}"], timeout=1.0) as client:
        started = time.monotonic()
        with pytest.raises(EtcdUnavailable):
            client.get("/kelastic-test/x")
        assert 0.9 < time.monotonic() - started < 5.0
        assert client.request_counts()["get"] > 1  # retried until the deadline


def _enable_auth(endpoint: str) -> None:
    """A root user and role, then ``auth enable``, through etcd's Auth API (the wheel ships
    no etcdctl)."""
    import grpc

    with grpc.insecure_channel(endpoint) as channel:
        auth = etcdrpc.AuthStub(channel)
        auth.UserAdd(etcdrpc.AuthUserAddRequest(name="root", password=ROOT_PASSWORD), timeout=5)
        auth.RoleAdd(etcdrpc.AuthRoleAddRequest(name="root"), timeout=5)
        auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
        auth.AuthEnable(etcdrpc.AuthEnableRequest(), timeout=5)


@pytest.fixture(scope="module")
def auth_etcd() -> Iterator[str]:
    """An etcd of its own with auth enabled (the session's etcd stays without)."""
    server = EmbeddedEtcd().start()
    try:
        _enable_auth(server.endpoint)
        yield server.endpoint
    finally:
        server.stop()


def test_the_client_authenticates_with_user_and_password(auth_etcd: str) -> None:
    with EtcdClient([auth_etcd], timeout=5.0, user="root", password=ROOT_PASSWORD) as client:
        client.put("/kelastic-test/auth/a", b"1")
        assert client.get("/kelastic-test/auth/a") is not None
        ok, _, revision = client.cas("/kelastic-test/auth/b", b"x", None)
        assert ok and revision > 0
        lease = client.grant_lease(5)
        assert lease.check()
        snap = client.put_read({"/kelastic-test/auth/c": b"2"}, ["/kelastic-test/auth/"], lease.id)
        assert set(snap.values) == {f"/kelastic-test/auth/{k}" for k in "abc"}
        watcher = Watcher(client, ["/kelastic-test/auth/"])  # a stream carries the token too
        try:
            client.put("/kelastic-test/auth/a", b"3")
            assert watcher.wait(snap.revision, 5.0)
        finally:
            watcher.close()
        assert client.wait_change(["/kelastic-test/auth/a"], snap.revision, 5.0)
        lease.revoke()


def test_without_or_with_wrong_credentials_etcd_refuses_at_once(auth_etcd: str) -> None:
    with EtcdClient([auth_etcd], timeout=10.0) as anonymous:
        started = time.monotonic()
        with pytest.raises(EtcdRefused):
            anonymous.get("/kelastic-test/auth/a")
        assert time.monotonic() - started < 2.0
    with EtcdClient([auth_etcd], timeout=10.0, user="root", password="wrong") as wrong:
        started = time.monotonic()
        with pytest.raises(EtcdRefused, match="authentication failed"):
            wrong.get("/kelastic-test/auth/a")
        assert time.monotonic() - started < 2.0


def test_the_sidecar_config_and_the_operator_store_use_etcd_auth(
    auth_etcd: str, tmp_path: Path
) -> None:
    env = {
        contract.ENV_JOB_NAME: "j",
        contract.ENV_JOB_UID: "u1",
        contract.ENV_POD_NAME: "j-0",
        contract.ENV_ETCD_ENDPOINTS: auth_etcd,
        contract.ENV_MIN_NODES: "1",
        contract.ENV_MAX_NODES: "1",
        contract.ENV_ETCD_USER: "root",
        contract.ENV_ETCD_PASSWORD: ROOT_PASSWORD,
    }
    config = SidecarConfig.from_env(env)
    assert ROOT_PASSWORD not in repr(config)
    prefix = config.prefix
    with config.etcd_client() as client:
        assert isinstance(client, EtcdClient)
        client.put(contract.Keys(prefix).rdzv_state, b'{"round": 4}')
    store = EtcdRendezvousStore([auth_etcd], timeout=3, user="root", password=ROOT_PASSWORD)
    try:
        assert store.read(prefix, 1).round == 4
        store.delete_prefix(prefix)
    finally:
        store.close()
    anonymous = EtcdRendezvousStore([auth_etcd], timeout=3)
    try:
        with pytest.raises(RendezvousStoreError, match="EtcdRefused"):
            anonymous.read(prefix, 1)
    finally:
        anonymous.close()


def test_a_job_s_auth_secret_reaches_the_sidecar_as_env(auth_etcd: str) -> None:
    from kelastic_operator.model import ElasticJobSpec
    from kelastic_operator.pods import PodSettings, sidecar_env

    trainer = {"name": "trainer", "image": "t", "command": ["python", "train.py"]}
    spec = ElasticJobSpec.model_validate(
        {
            "replicas": 1,
            "template": {"spec": {"containers": [trainer]}},
            "rendezvous": {"etcdEndpoints": [auth_etcd], "authSecret": "etcd-user"},
        }
    )
    env = sidecar_env("j", "u1", spec, PodSettings())
    secret = {"username": "root", "password": ROOT_PASSWORD}  # the basic-auth Secret's data
    resolved: dict[str, str] = {}
    for item in env:
        ref = item.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None:
            assert ref["name"] == "etcd-user"
            resolved[item["name"]] = secret[ref["key"]]  # as the kubelet does
        elif "value" in item:
            resolved[item["name"]] = item["value"]
    assert resolved[contract.ENV_ETCD_USER] == "root"
    assert not any(ROOT_PASSWORD in str(item.get("value", "")) for item in env)
    resolved[contract.ENV_POD_NAME] = "j-0"
    with SidecarConfig.from_env(resolved).etcd_client() as client:
        client.put("/kelastic-test/auth/pod", b"ok")


def test_a_refusal_leaves_the_rendezvous_at_once_as_a_connection_error(auth_etcd: str) -> None:
    # etcd refuses a client without credentials: the rendezvous does not ride that out
    # as an outage until join_timeout, it surfaces at once.
    from kelastic_sidecar.rendezvous.handler import (
        EtcdRendezvousHandler,
        RendezvousConnectionError,
        RendezvousSettings,
    )

    settings = RendezvousSettings("refused", 1, 1, join_timeout=30.0)
    with EtcdClient([auth_etcd], timeout=10.0) as anonymous:
        handler = EtcdRendezvousHandler(anonymous, contract.Keys("/kelastic/x/"), "a", settings)
        started = time.monotonic()
        with pytest.raises(RendezvousConnectionError) as err:
            handler.next_rendezvous()
        assert time.monotonic() - started < 5.0
        assert isinstance(err.value.__cause__, EtcdRefused)
        handler.shutdown()


def _drop_tokens(endpoint: str) -> None:
    """Make etcd drop every auth token of ``root`` now, as the token's expiry does
    (``--auth-token-ttl`` seconds after its last use, 300 by default: an operator idle for
    minutes meets this): setting a user's password, to the same one here, invalidates its
    tokens. Either way a request with the token gets "invalid auth token"."""
    import grpc

    with grpc.insecure_channel(endpoint) as channel:
        auth = etcdrpc.AuthStub(channel)
        request = etcdrpc.AuthenticateRequest(name="root", password=ROOT_PASSWORD)
        token = auth.Authenticate(request, timeout=5).token
        auth.UserChangePassword(
            etcdrpc.AuthUserChangePasswordRequest(name="root", password=ROOT_PASSWORD),
            timeout=5,
            metadata=[("token", token)],
        )


def _token_refused(endpoint: str, token: str) -> bool:
    """Whether etcd refuses ``token`` (a refused request does not renew it)."""
    import grpc

    with grpc.insecure_channel(endpoint) as channel:
        try:
            etcdrpc.KVStub(channel).Range(
                etcdrpc.RangeRequest(key=b"/kelastic-test/probe"), timeout=5,
                metadata=[("token", token)],
            )  # fmt: skip
        except grpc.RpcError as exc:
            return "invalid auth token" in str(exc.details())
    return False


def test_an_expired_auth_token_is_replaced(tmp_path: Path) -> None:
    # etcd stops accepting a token (it expired, or was invalidated): the client
    # authenticates again, for a plain call, a wait and a long-lived watch stream.
    import subprocess

    from kelastic_operator.local.etcd import etcd_binary, free_port

    client_port, peer_port = free_port(), free_port()
    client_url, peer_url = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    args = [
        str(etcd_binary()), "--name", "ttl", "--data-dir", str(tmp_path / "data"),
        "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
        "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
        "--initial-cluster", f"ttl={peer_url}", "--unsafe-no-fsync", "--log-level", "error",
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"127.0.0.1:{client_port}"
    try:
        with EtcdClient([endpoint], timeout=20.0) as probe:
            probe.get("/kelastic-test/up")  # retried until etcd serves
        _enable_auth(endpoint)
        with EtcdClient([endpoint], timeout=5.0, user="root", password=ROOT_PASSWORD) as client:
            auth = client._endpoints[0].auth
            assert auth is not None

            def expire() -> str:
                """Drop the client's current token; returns it."""
                token = auth.token(5.0)
                _drop_tokens(endpoint)
                assert _token_refused(endpoint, token)  # the precondition
                return token

            client.put("/kelastic-test/ttl", b"1")
            snap = client.read(["/kelastic-test/ttl"])
            old = expire()
            client.put("/kelastic-test/ttl", b"2")
            assert auth.token(5.0) != old  # it authenticated again
            assert client.get("/kelastic-test/ttl") == (
                b"2",
                client.read(["/kelastic-test/ttl"]).values["/kelastic-test/ttl"][1],
            )
            old = expire()
            assert client.wait_change(["/kelastic-test/ttl"], snap.revision, 5.0)
            assert auth.token(5.0) != old
            assert client.request_counts().get("errors", 0) == 0  # no call failed
            old = expire()
            # a long-lived watch stream re-creates its watches with a fresh token (its
            # first try, with the expired one, counts as a broken stream)
            watcher = Watcher(client, ["/kelastic-test/ttl"])
            try:
                assert watcher.wait(snap.revision, 5.0)
            finally:
                watcher.close()
            assert auth.token(5.0) != old
    finally:
        proc.kill()
        proc.wait()


def test_the_sidecar_reports_refused_credentials_as_refused(auth_etcd: str, tmp_path: Path) -> None:
    # etcd refusing the sidecar's credentials is no outage to ride out. The
    # sidecar says "refused" and fails the node at once; it never logs "etcd unavailable
    # ... will retry" (kelastic_etcd's rule: surface a refusal, never retry it).
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        contract.ENV_JOB_NAME: "refused",
        contract.ENV_JOB_UID: "u1",
        contract.ENV_POD_NAME: "refused-0",
        contract.ENV_ETCD_ENDPOINTS: auth_etcd,
        contract.ENV_MIN_NODES: "1",
        contract.ENV_MAX_NODES: "1",
        contract.ENV_ETCD_USER: "root",
        contract.ENV_ETCD_PASSWORD: "wrong",
        contract.ENV_HTTP_HOST: "127.0.0.1",
        contract.ENV_HTTP_PORT: "0",
        contract.ENV_RUN_DIR: str(tmp_path),
    }
    env.pop("KUBERNETES_SERVICE_HOST", None)
    proc = subprocess.run(
        [sys.executable, "-m", "kelastic_sidecar"],
        env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "refused" in proc.stderr, proc.stderr[-2000:]
    assert "authentication failed" in proc.stderr, proc.stderr[-2000:]
    assert "etcd unavailable" not in proc.stderr, proc.stderr[-2000:]
    assert "will retry" not in proc.stderr, proc.stderr[-2000:]
