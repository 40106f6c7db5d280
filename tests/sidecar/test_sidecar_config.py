"""Sidecar configuration from env: complete envs load; bad ones list every problem."""

from __future__ import annotations

import pytest

from kelastic import contract
from kelastic_sidecar.config import ConfigError, SidecarConfig

GOOD = {
    contract.ENV_JOB_NAME: "digits",
    contract.ENV_JOB_UID: "u1",
    contract.ENV_POD_NAME: "digits-0",
    contract.ENV_ETCD_ENDPOINTS: "127.0.0.1:2379, 127.0.0.2:2379",
    contract.ENV_MIN_NODES: "1",
    contract.ENV_MAX_NODES: "4",
}


def test_complete_env_loads_with_defaults() -> None:
    cfg = SidecarConfig.from_env(GOOD)
    assert cfg.etcd_endpoints == ("127.0.0.1:2379", "127.0.0.2:2379")
    assert (cfg.min_nodes, cfg.max_nodes, cfg.nproc_per_node) == (1, 4, 1)
    assert cfg.max_restarts == contract.DEFAULT_MAX_RESTARTS
    assert cfg.prefix == "/kelastic/default/digits/u1/"


def test_every_problem_is_listed_at_once() -> None:
    env = dict(GOOD)
    del env[contract.ENV_JOB_UID]
    env[contract.ENV_MAX_NODES] = "many"
    env[contract.ENV_LEASE_TTL] = "1.5"
    with pytest.raises(ConfigError) as err:
        SidecarConfig.from_env(env)
    text = str(err.value)
    assert f"{contract.ENV_JOB_UID} is required" in text
    assert f"{contract.ENV_MAX_NODES}='many' is not a valid int" in text
    assert f"{contract.ENV_LEASE_TTL}='1.5' is not a valid int" in text


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({contract.ENV_MIN_NODES: "5"}, "min_nodes (5) <= max_nodes (4)"),
        ({contract.ENV_NPROC_PER_NODE: "0"}, "nproc_per_node must be >= 1"),
        ({contract.ENV_JOIN_TIMEOUT: "-1"}, "join_timeout must be > 0"),
        ({contract.ENV_ETCD_ENDPOINTS: " , "}, "lists no endpoint"),
        ({contract.ENV_HTTP_PORT: "70000"}, "http_port out of range"),
    ],
)
def test_out_of_range_values_are_rejected(override: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SidecarConfig.from_env(GOOD | override)


def test_sidecar_command_rejects_a_bad_environment_and_explains_itself() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "kelastic_sidecar"],
        capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert "invalid sidecar environment" in out.stderr
    assert f"{contract.ENV_ETCD_ENDPOINTS} is required" in out.stderr
    helped = subprocess.run(
        [sys.executable, "-m", "kelastic_sidecar", "--help"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    assert contract.ENV_ETCD_ENDPOINTS in helped.stdout and "/metrics" in helped.stdout
