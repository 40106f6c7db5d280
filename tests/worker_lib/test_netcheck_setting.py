"""The job's network check setting (``$KELASTIC_NETCHECK``): the one codec the operator
writes with and the sidecar and launcher read with; what no operator writes is refused
with the reason (the sidecar then refuses to start, naming the variable)."""

from __future__ import annotations

import json

import pytest

from kelastic import contract
from kelastic.netcheck import Floors, NetcheckError, Setting, decode_setting, encode_setting
from kelastic_sidecar.config import ConfigError, SidecarConfig


def test_the_setting_round_trips() -> None:
    setting = Setting(Floors(max_latency_s=0.002, min_bandwidth_bps=2e9, size_bytes=64,
                             iterations=2), timeout_s=12.5)  # fmt: skip
    assert decode_setting(encode_setting(setting)) == setting
    assert decode_setting(encode_setting(Setting())) == Setting()
    assert Setting().deadline() == 3 * 30.0 + 30.0


GOOD = json.loads(encode_setting(Setting()))


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ("", "not a network check setting"),
        ("[]", "needs exactly 'floors' and 'timeoutSeconds'"),
        (json.dumps({**GOOD, "extra": 1}), "needs exactly"),
        (json.dumps({**GOOD, "timeoutSeconds": 0}), "timeoutSeconds must be 1..600"),
        (json.dumps({**GOOD, "timeoutSeconds": True}), "timeoutSeconds must be"),
        (json.dumps({**GOOD, "timeoutSeconds": "30"}), "timeoutSeconds must be"),
        (json.dumps({**GOOD, "timeoutSeconds": 1e999}), "not a network check setting"),
        (json.dumps({**GOOD, "floors": {}}), "floors must have exactly"),
        (json.dumps({**GOOD, "floors": {**GOOD["floors"], "size_bytes": 6}}), "multiple of 4"),
        (json.dumps({**GOOD, "floors": {**GOOD["floors"], "iterations": 0}}), "iterations"),
        ('{"floors": ' * 40 + "1" + "}" * 40, "not a network check setting"),
    ],
)
def test_what_no_operator_writes_is_refused(raw: str, words: str) -> None:
    with pytest.raises(NetcheckError, match=words):
        decode_setting(raw)


def test_the_sidecar_reads_it_and_refuses_a_bad_one_by_name() -> None:
    env = {contract.ENV_JOB_NAME: "j", contract.ENV_JOB_UID: "u", contract.ENV_POD_NAME: "j-0",
           contract.ENV_ETCD_ENDPOINTS: "127.0.0.1:2379", contract.ENV_MIN_NODES: "1",
           contract.ENV_MAX_NODES: "2"}  # fmt: skip
    assert SidecarConfig.from_env(env).netcheck is None
    on = {**env, contract.ENV_NETCHECK: encode_setting(Setting(timeout_s=9))}
    assert SidecarConfig.from_env(on).netcheck == Setting(timeout_s=9)
    with pytest.raises(ConfigError, match=f"{contract.ENV_NETCHECK}: timeoutSeconds"):
        SidecarConfig.from_env({**env, contract.ENV_NETCHECK: json.dumps({**GOOD,
                                "timeoutSeconds": -1})})  # fmt: skip
