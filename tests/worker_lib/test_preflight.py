"""kelastic.preflight: the env codec (strict, bounded, fuzzed), running the check (exit
codes, a timeout that kills the check's whole session, a missing program), the ``hello``
field that carries a failure, and the operator's side (spec -> trainer env)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given

from kelastic import contract
from kelastic.control_messages import Hello, ProtocolError, parse_launcher_message
from kelastic.preflight import (
    MAX_ARG_CHARS,
    MAX_ARGS,
    MAX_ERROR_CHARS,
    Preflight,
    PreflightError,
    decode_preflight,
    encode_preflight,
    run_preflight,
)
from tests.conftest import wait_for
from tests.test_decoder_fuzz import json_values

CHECK = Preflight((sys.executable, "-c", "print('ok')"), 5.0)


def test_the_env_value_round_trips() -> None:
    assert decode_preflight(encode_preflight(CHECK)) == CHECK
    assert json.loads(encode_preflight(CHECK)) == {"command": list(CHECK.command),
                                                   "timeoutSeconds": 5.0}  # fmt: skip


@pytest.mark.parametrize(
    "raw",
    [
        "", "null", "[]", '{"command": ["x"]}', '{"command": [], "timeoutSeconds": 1}',
        '{"command": "x", "timeoutSeconds": 1}', '{"command": [1], "timeoutSeconds": 1}',
        '{"command": [""], "timeoutSeconds": 1}', '{"command": ["x"], "timeoutSeconds": 0}',
        '{"command": ["x"], "timeoutSeconds": 3601}', '{"command": ["x"], "timeoutSeconds": true}',
        '{"command": ["x"], "timeoutSeconds": NaN}', '{"command": ["x"], "timeoutSeconds": 1e999}',
        '{"command": ["x"], "timeoutSeconds": "60"}',
        '{"command": ["x"], "timeoutSeconds": 1, "shell": true}',
        json.dumps({"command": ["x"] * (MAX_ARGS + 1), "timeoutSeconds": 1}),
        json.dumps({"command": ["x" * (MAX_ARG_CHARS + 1)], "timeoutSeconds": 1}),
        '{"command": [["x"]], "timeoutSeconds": 1}', "[" * 10_000,
        '{"command": ["x"], "timeoutSeconds": 1' + "0" * 30 + "}",
    ],
)  # fmt: skip
def test_what_no_operator_writes_is_refused(raw: str) -> None:
    with pytest.raises(PreflightError):
        decode_preflight(raw)


@given(command=json_values, timeout=json_values)
def test_fuzz_the_decoder_raises_only_its_error(command: Any, timeout: Any) -> None:
    for raw in (json.dumps({"command": command, "timeoutSeconds": timeout}), json.dumps(command)):
        try:
            got = decode_preflight(raw)
        except PreflightError:
            continue
        assert 1 <= len(got.command) <= MAX_ARGS and 1 <= got.timeout <= 3600


def test_a_passing_check_says_nothing_and_a_failing_one_says_why(tmp_path: Path) -> None:
    assert run_preflight(CHECK) is None
    noisy = "import sys\nprint('x' * 10000)\nprint('ECC errors on GPU 1', file=sys.stderr)\n"
    fail = Preflight((sys.executable, "-c", noisy + "sys.exit(3)"), 5.0)
    why = run_preflight(fail)
    assert why is not None and why.startswith("exited with code 3: ")
    assert why.endswith("ECC errors on GPU 1") and len(why) < 2100  # the output's tail
    killed = Preflight((sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"), 5.0)
    assert run_preflight(killed) == "killed by SIGKILL"
    assert run_preflight(Preflight(("/no/such/check",), 5.0)) == (
        "could not start '/no/such/check': [Errno 2] No such file or directory: '/no/such/check'"
    )
    uses_env = "import os, sys; sys.exit(os.environ['X'] != '1')"
    env_check = Preflight((sys.executable, "-c", uses_env), 5.0)
    assert run_preflight(env_check, {**os.environ, "X": "1"}) is None


def test_a_check_past_its_timeout_is_killed_with_its_children(tmp_path: Path) -> None:
    pidfile = tmp_path / "child"
    hang = (
        "import os, sys, time\n"
        f"pid = os.fork()\n"
        f"if pid == 0:\n    time.sleep(600)\n"
        f"open({str(pidfile)!r}, 'w').write(str(pid))\n"
        "print('stuck in dcgmi', flush=True)\ntime.sleep(600)\n"
    )
    started = time.monotonic()
    why = run_preflight(Preflight((sys.executable, "-c", hang), 1.0))
    assert why == "timed out after 1 s: stuck in dcgmi"
    assert time.monotonic() - started < 30
    child = int(pidfile.read_text())

    def gone() -> bool:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return True
        return Path(f"/proc/{child}/stat").read_text().split()[2] == "Z"

    wait_for(gone, 10, what="the check's child killed with its session")


def test_hello_carries_a_failed_check_and_refuses_a_crafted_one() -> None:
    hello = Hello(4242, 2, "exited with code 3: ECC")
    assert parse_launcher_message(json.dumps(hello.as_dict()).encode()) == hello
    older = {"type": "hello", "pid": 4242, "nproc": 2}  # an older launcher: no check
    assert parse_launcher_message(json.dumps(older).encode()) == Hello(4242, 2)
    for bad in ("", 3, ["x"], {"x": 1}, "x" * (MAX_ERROR_CHARS + 1)):
        with pytest.raises(ProtocolError, match="preflight_error"):
            parse_launcher_message(json.dumps({**older, "preflight_error": bad}).encode())


def test_the_operator_writes_the_spec_into_the_trainers_env_and_refuses_a_bad_one() -> None:
    from pydantic import ValidationError

    from kelastic_operator.model import PreflightSpec, load_manifest
    from kelastic_operator.pods import PodSettings, build_pod

    root = Path(__file__).resolve().parents[2]
    spec = load_manifest(root / "examples/digits/elasticjob.yaml").spec
    check = PreflightSpec.model_validate({"command": ["nvidia-smi", "-L"], "timeoutSeconds": 30})
    settings = PodSettings(sidecar_image="kelastic:test", etcd_endpoints=("etcd:2379",))
    pod = build_pod("digits", "ml", "uid-1", spec.model_copy(update={"preflight": check}), 0,
                    settings)  # fmt: skip
    trainer = pod["spec"]["containers"][0]
    (value,) = [e["value"] for e in trainer["env"] if e["name"] == contract.ENV_PREFLIGHT]
    assert decode_preflight(value) == Preflight(("nvidia-smi", "-L"), 30.0)
    bare = build_pod(
        "digits",
        "ml",
        "uid-1",
        spec,
        0,
        PodSettings(sidecar_image="kelastic:test", etcd_endpoints=("etcd:2379",)),
    )
    assert all(e["name"] != contract.ENV_PREFLIGHT for e in bare["spec"]["containers"][0]["env"])
    for bad in ({"command": []}, {"command": [""]}, {"command": ["x"], "timeoutSeconds": 0},
                {"command": ["x"], "timeoutSeconds": 3601}, {"command": ["x"], "shell": True},
                {"command": ["x" * (MAX_ARG_CHARS + 1)]}):  # fmt: skip
        with pytest.raises(ValidationError):
            PreflightSpec.model_validate(bad)


def test_the_network_check_reaches_both_containers_by_its_codec() -> None:
    """``spec.preflight.network`` alone (no command) is a preflight: ``$KELASTIC_NETCHECK``
    in the trainer (its checker started ahead) and the sidecar (it runs the check), with
    the spec's units turned into the codec's (ms -> s, MB/s -> bytes/s, MiB -> bytes)."""
    from pydantic import ValidationError

    from kelastic.netcheck import Floors, Setting, decode_setting
    from kelastic_operator.labels import SIDECAR_CONTAINER
    from kelastic_operator.model import PreflightSpec, load_manifest
    from kelastic_operator.pods import PodSettings, build_pod

    root = Path(__file__).resolve().parents[2]
    spec = load_manifest(root / "examples/digits/elasticjob.yaml").spec
    check = PreflightSpec.model_validate({"network": {
        "maxLatencyMilliseconds": 5, "minBandwidthMBps": 800, "sizeMiB": 8, "iterations": 3,
        "timeoutSeconds": 20}})  # fmt: skip
    settings = PodSettings(sidecar_image="kelastic:test", etcd_endpoints=("etcd:2379",))
    pod = build_pod("digits", "ml", "uid-1", spec.model_copy(update={"preflight": check}), 0,
                    settings)  # fmt: skip
    want = Setting(Floors(max_latency_s=0.005, min_bandwidth_bps=8e8, size_bytes=8 * 2**20,
                          iterations=3), timeout_s=20.0)  # fmt: skip
    containers = {c["name"]: c for c in pod["spec"]["containers"] + pod["spec"].get(
        "initContainers", [])}  # fmt: skip
    for name in ("trainer", SIDECAR_CONTAINER):
        env = containers[name]["env"]
        (value,) = [e["value"] for e in env if e["name"] == contract.ENV_NETCHECK]
        assert decode_setting(value) == want, name
        assert all(e["name"] != contract.ENV_PREFLIGHT for e in env)  # no command: none
    defaults = PreflightSpec.model_validate({"network": {}}).network
    assert defaults is not None and defaults.to_setting() == Setting()
    with pytest.raises(ValidationError, match="needs a command, a network check, or both"):
        PreflightSpec.model_validate({"timeoutSeconds": 30})
