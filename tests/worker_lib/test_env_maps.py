"""The one environment-map check both wire protocols use (``kelastic._safejson.env_map``):
the control protocol's ``respawn``/``assign`` env and the in-process ``go`` env accept and
refuse the same maps, each with its own ``ProtocolError``; only the control protocol takes
integers (as strings)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kelastic import control_messages as cm
from kelastic import inprocess_messages as ipm
from kelastic._safejson import BadEnvError, env_map


def _go(env: Any) -> dict[str, str]:
    line = json.dumps({"type": "go", "iteration": 1, "env": env}).encode()
    return ipm.parse_coordinator_message(line).env  # type: ignore[union-attr]


def _respawn(env: Any) -> dict[str, str]:
    line = json.dumps({"type": "respawn", "attempt": 0, "local_rank": 1, "env": env}).encode()
    return cm.parse_message(line).env  # type: ignore[union-attr]


def _assign(env: Any) -> dict[str, str]:
    line = json.dumps({"type": "assign", "attempt": 0, "round": 0,
                       "workers": [{"local_rank": 0, "env": env}]}).encode()  # fmt: skip
    return cm.parse_message(line).workers[0].env  # type: ignore[union-attr]


BAD = {
    "not_an_object": ["RANK=0"],
    "null": None,
    "empty_name": {"": "x"},
    "equals_in_name": {"A=B": "x"},
    "nul_in_name": {"A\0": "x"},
    "nul_in_value": {"A": "x\0y"},
    "bool": {"A": True},
    "float": {"A": 1.5},
    "list": {"A": ["x"]},
    "null_value": {"A": None},
}


@pytest.mark.parametrize("env", list(BAD.values()), ids=list(BAD))
def test_both_protocols_refuse_the_same_maps_each_with_its_error(env: Any) -> None:
    with pytest.raises(ipm.ProtocolError, match="go env"):
        _go(env)
    for parse, where in ((_respawn, "respawn.env"), (_assign, r"assign workers\[0\]\.env")):
        with pytest.raises(cm.ProtocolError, match=where):
            parse(env)
    with pytest.raises(BadEnvError):
        env_map(env, "env", ints=True)


def test_both_take_strings_and_only_the_control_protocol_integers() -> None:
    env = {"MASTER_PORT": "29500", "EMPTY": "", "UNICODE": "é"}
    assert _go(env) == _respawn(env) == _assign(env) == env
    assert _go({}) == _respawn({}) == {}
    assert _respawn({"RANK": 0, "BIG": 2**40}) == {"RANK": "0", "BIG": str(2**40)}
    with pytest.raises(ipm.ProtocolError, match=r"go env\['RANK'\] must be a string, got 0"):
        _go({"RANK": 0})
    with pytest.raises(BadEnvError, match=r"e\['A'\] must be a string, got 3"):
        env_map({"A": 3}, "e")


def test_the_message_quotes_the_line_and_names_the_key() -> None:
    with pytest.raises(cm.ProtocolError) as err:
        _respawn({"A=B": "x"})
    assert "respawn.env has an invalid name 'A=B'" in str(err.value)
    assert '"type": "respawn"' in str(err.value)  # the excerpt of the line
