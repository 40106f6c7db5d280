"""EtcdRendezvousBackend: torch's RendezvousBackend contract on a real etcd, and torch's own
DynamicRendezvousHandler running on it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from kelastic_etcd import EtcdClient, EtcdError
from kelastic_sidecar.torchrun_plugin import (
    TORCHRUN_ENTRY_POINT_GROUP,
    EtcdRendezvousBackend,
    create_torch_handler,
    decode_envelope,
    encode_envelope,
    register_torch_backend,
    torchrun_handler,
)
from tests.prereq import require_module

# The sidecar image has no torch; the adapter tests need it (they use torch_elastic).
with contextlib.suppress(ImportError):
    from torch.distributed.elastic.rendezvous import (
        RendezvousConnectionError,
        RendezvousParameters,
        RendezvousStateError,
        rendezvous_handler_registry,
    )
    from torch.distributed.elastic.rendezvous.registry import _register_out_of_tree_handlers


@pytest.fixture
def torch_elastic() -> None:
    """torch's rendezvous API, which the adapter tests need: skipped where torch is not
    installed, failed under CI=true (tests/prereq.py)."""
    require_module("torch.distributed.elastic.rendezvous")


needs_torch = pytest.mark.usefixtures("torch_elastic")


@pytest.fixture
def backend(store: EtcdClient, job_prefix: str) -> EtcdRendezvousBackend:
    return EtcdRendezvousBackend(store, job_prefix + "rdzv/state")


# ------------------------------------------------------------------ the contract itself


def test_get_state_of_nothing_is_none(backend: EtcdRendezvousBackend) -> None:
    assert backend.name == "kelastic-etcd"
    assert backend.get_state() is None


def test_set_state_without_token_creates_only(backend: EtcdRendezvousBackend) -> None:
    created = backend.set_state(b"one")
    assert created is not None
    state, token, ok = created
    assert (state, ok) == (b"one", True) and isinstance(token, int)
    assert backend.get_state() == (b"one", token)
    again = backend.set_state(b"two")  # a state exists: not overwritten
    assert again == (b"one", token, False)


def test_set_state_with_token(backend: EtcdRendezvousBackend) -> None:
    first = backend.set_state(b"one")
    assert first is not None
    token = first[1]
    second = backend.set_state(b"two", token)
    assert second is not None and second[0] == b"two" and second[2] is True
    assert second[1] != token
    # a stale token loses and gets the current state back
    assert backend.set_state(b"three", token) == (b"two", second[1], False)
    # a token from another backend (c10d uses bytes) never matches
    assert backend.set_state(b"three", b"not-ours") == (b"two", second[1], False)


def test_set_state_after_the_state_vanished(
    backend: EtcdRendezvousBackend, store: EtcdClient
) -> None:
    first = backend.set_state(b"one")
    assert first is not None
    store.delete(backend.key)
    assert backend.set_state(b"two", first[1]) is None
    assert backend.set_state(b"x", b"foreign") is None


def test_backend_errors_are_connection_errors() -> None:
    with EtcdClient(["127.0.0.1:1"], timeout=0.5) as dead:
        b = EtcdRendezvousBackend(dead, "/k")
        with pytest.raises(EtcdError):
            b.get_state()
        with pytest.raises(ConnectionError):
            b.set_state(b"x", 3)


# ------------------------------------------------------------------------- torch adapter


def _torch_backend(store: EtcdClient, key: str) -> Any:
    from kelastic_sidecar.torchrun_plugin import _torch_classes

    cls, _ = _torch_classes()
    return cls(EtcdRendezvousBackend(store, key))


def test_envelope_round_trip() -> None:
    payload = bytes(range(256))
    assert decode_envelope(encode_envelope(payload), "/k") == payload


@needs_torch
@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\x80\x04\x95garbage", "not JSON"),
        (b'{"version": 1, "kind": "something-else", "state": ""}', "not a torch rendezvous"),
        (b'{"version": 9, "kind": "torch-dynamic-rendezvous-state", "state": ""}', "version 9"),
        (b'{"version": 1, "kind": "torch-dynamic-rendezvous-state", "state": "@@"}', "base64"),
        (b'{"version": 1, "kind": "torch-dynamic-rendezvous-state"}', "no 'state'"),
    ],
)
def test_corrupt_value_raises_torch_state_error(
    store: EtcdClient, job_prefix: str, raw: bytes, message: str
) -> None:
    key = job_prefix + "rdzv/state"
    adapter = _torch_backend(store, key)
    store.put(key, raw)
    with pytest.raises(RendezvousStateError, match=message):
        adapter.get_state()
    with pytest.raises(RendezvousStateError, match=message):
        adapter.set_state(b"new", None)  # the existing (corrupt) state comes back


@needs_torch
def test_torch_adapter_round_trip_and_token(store: EtcdClient, job_prefix: str) -> None:
    adapter = _torch_backend(store, job_prefix + "rdzv/state")
    assert adapter.name == "kelastic-etcd"
    assert adapter.get_state() is None
    state, token, ok = adapter.set_state(b"\x80pickled")
    assert (state, ok) == (b"\x80pickled", True)
    assert adapter.get_state() == (b"\x80pickled", token)
    assert adapter.set_state(b"other", token + 1000) == (b"\x80pickled", token, False)


@needs_torch
def test_torch_adapter_maps_unavailable_etcd_to_connection_error() -> None:
    with EtcdClient(["127.0.0.1:1"], timeout=0.5) as dead:
        adapter = _torch_backend(dead, "/k")
        with pytest.raises(RendezvousConnectionError, match=r"127\.0\.0\.1:1"):
            adapter.get_state()
        with pytest.raises(RendezvousConnectionError):
            adapter.set_state(b"x")


def _params(endpoint: str, run_id: str, **extra: Any) -> RendezvousParameters:
    return RendezvousParameters(
        backend="kelastic-etcd",
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=2,
        max_nodes=2,
        local_addr="127.0.0.1",
        join_timeout="60",
        last_call_timeout="1",
        close_timeout="10",
        **extra,
    )


@needs_torch
def test_torch_dynamic_rendezvous_handler_on_our_backend(
    etcd_endpoint: str, job_prefix: str, store: EtcdClient
) -> None:
    """torch's own DynamicRendezvousHandler completes a 2-node rendezvous on etcd v3."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    register_torch_backend()
    register_torch_backend()  # idempotent
    run_id = uuid.uuid4().hex
    prefix = job_prefix + "torchrun/"
    handlers = [
        get_rendezvous_handler(_params(etcd_endpoint, run_id, key_prefix=prefix)) for _ in range(2)
    ]
    assert all(isinstance(h, DynamicRendezvousHandler) for h in handlers)
    assert handlers[0].get_backend() == "kelastic-etcd"
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def join(i: int) -> None:
        try:
            results[i] = handlers[i].next_rendezvous()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors
    assert sorted(r.rank for r in results.values()) == [0, 1]
    assert {r.world_size for r in results.values()} == {2}
    masters = {
        (r.bootstrap_store_info.master_addr, r.bootstrap_store_info.master_port)
        for r in results.values()
    }
    assert len(masters) == 1  # both agents agree on rank 0's store
    # the c10d store handed out is shared through etcd
    results[0].store.set("hello", b"from rank 0")
    assert results[1].store.get("hello") == b"from rank 0"
    assert results[1].store.add("counter", 2) == 2 and results[0].store.add("counter", 3) == 5
    # state and store live under the run's prefix, the state in the JSON envelope
    raw = store.get(prefix + run_id + "/rdzv/state")
    assert raw is not None and raw[0].startswith(b'{"version":1,"kind":')
    assert handlers[0].num_nodes_waiting() == 0
    for h in handlers:
        assert h.shutdown()  # torch's shutdown closes the rendezvous
    assert handlers[0].is_closed()


@needs_torch
def test_create_torch_handler_fails_clearly_without_etcd() -> None:
    params = _params("127.0.0.1:1", "r", etcd_timeout="0.5")
    with pytest.raises(RendezvousConnectionError, match=r"127\.0\.0\.1:1"):
        create_torch_handler(params)


@needs_torch
def test_entry_point_is_loadable_by_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's out-of-tree loader accepts our entry point (group ``torchrun.handlers``)."""
    dist_info = tmp_path / "kelastic_ep_probe-0.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kelastic-ep-probe\nVersion: 0.0\n"
    )
    (dist_info / "entry_points.txt").write_text(
        textwrap.dedent(
            f"""\
            [{TORCHRUN_ENTRY_POINT_GROUP}]
            kelastic-etcd-probe = kelastic_sidecar.torchrun_plugin:torchrun_handler
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert TORCHRUN_ENTRY_POINT_GROUP == "torchrun.handlers"
    assert torchrun_handler() is create_torch_handler
    _register_out_of_tree_handlers()
    assert rendezvous_handler_registry._registry["kelastic-etcd-probe"] is create_torch_handler


@needs_torch
@pytest.mark.slow
def test_torchrun_with_kelastic_etcd_backend(etcd_endpoint: str, tmp_path: Path) -> None:
    """Two torchrun agents meet through etcd and run an all_reduce over gloo."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """\
            import os, torch, torch.distributed as dist
            dist.init_process_group("gloo")
            t = torch.tensor([dist.get_rank() + 1.0])
            dist.all_reduce(t)
            out = os.environ["OUT_DIR"] + "/rank" + os.environ["RANK"]
            open(out, "w").write(f"{int(t.item())} {os.environ['WORLD_SIZE']}")
            dist.destroy_process_group()
            """
        )
    )
    launcher = (
        "import sys; from kelastic_sidecar.torchrun_plugin import register_torch_backend; "
        "register_torch_backend(); from torch.distributed.run import main; main(sys.argv[1:])"
    )
    run_id = uuid.uuid4().hex
    args = [
        sys.executable, "-c", launcher,
        "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=kelastic-etcd",
        f"--rdzv-endpoint={etcd_endpoint}", f"--rdzv-id={run_id}",
        "--rdzv-conf=last_call_timeout=1,join_timeout=120",
        "--monitor-interval=0.2", str(script),
    ]  # fmt: skip
    env = {**os.environ, "OUT_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for _ in range(2)
    ]
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        outputs.append(out.decode(errors="replace"))
    assert all(p.returncode == 0 for p in procs), "\n----\n".join(o[-3000:] for o in outputs)
    results = sorted((tmp_path / f"rank{r}").read_text() for r in range(2))
    assert results == ["3 2", "3 2"]


def test_lost_set_state_returns_the_current_state_without_another_request(
    store: EtcdClient, backend: EtcdRendezvousBackend
) -> None:
    first = backend.set_state(b"s1")
    assert first is not None and first[2]
    assert backend.set_state(b"s2", first[1]) is not None  # moves the token on
    before = store.request_counts()
    lost = backend.set_state(b"s3", first[1])  # a stale token
    assert lost is not None
    assert lost[0] == b"s2" and lost[2] is False
    assert lost[1] == backend.get_state()[1]  # type: ignore[index]
    after = store.request_counts()
    assert after["cas"] - before.get("cas", 0) == 1
    assert after.get("get", 0) - before.get("get", 0) == 1  # only the check just above


def test_set_state_and_read(
    store: EtcdClient, backend: EtcdRendezvousBackend, job_prefix: str
) -> None:
    store.put(job_prefix + "rdzv/alive/a", b"x")
    ok, snap = backend.set_state_and_read(b"s1", None, [job_prefix + "rdzv/alive/"])
    assert ok
    assert snap.values[backend.key][0] == b"s1"
    assert job_prefix + "rdzv/alive/a" in snap.values
    ok, snap = backend.set_state_and_read(b"s2", None, [])
    assert not ok and snap.values[backend.key][0] == b"s1"
