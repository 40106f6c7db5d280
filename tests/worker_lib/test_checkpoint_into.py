"""``load(into=...)``: the loaded tensors go straight into the trainer's own (torch DCP's
in-place load), each checked before any is written; a place, dtype or shape that differs
gets a fresh tensor; a corrupt slot leaves the trainer's tensors as they were."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kelastic import checkpoint, contract
from kelastic.checkpoint import CheckpointStore
from kelastic.checkpoint.slot_format import HEADER_SIZE, decode_header
from kelastic.checkpoint.store import SLOTS, slot_path
from kelastic.checkpoint.tree import flatten, pair_tensors


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    for _ in range(2):
        net(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return net, opt


def _state(net: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": net.state_dict(), "optim": opt.state_dict(), "step": 7}


def test_a_load_into_the_trainers_tensors_fills_them_in_place(tmp_path: Path) -> None:
    net, opt = _trained(0)
    with CheckpointStore(tmp_path, job="j") as ckpt:
        ckpt.save(7, _state(net, opt), blocking=True)
    fresh_net, fresh_opt = _trained(1)  # another process's model: other values
    into = _state(fresh_net, fresh_opt)
    weight = fresh_net[0].weight
    with CheckpointStore(tmp_path, job="j") as ckpt:
        got = ckpt.load(into=into)
    assert got is not None and got[0] == 7
    state = got[1]
    assert state["model"]["0.weight"] is into["model"]["0.weight"]  # the trainer's own
    assert torch.equal(weight, net[0].weight)  # the parameter itself holds the step's values
    exp_avg = state["optim"]["state"][0]["exp_avg"]
    assert exp_avg is fresh_opt.state[weight]["exp_avg"]
    assert torch.equal(exp_avg, opt.state[net[0].weight]["exp_avg"])
    fresh_opt.load_state_dict(state["optim"])  # what the trainer then does: still right
    for a, b in zip(fresh_net.parameters(), net.parameters(), strict=True):
        assert torch.equal(a, b)
    assert state["step"] == 7


def test_what_does_not_match_gets_a_fresh_tensor_and_is_left_alone(tmp_path: Path) -> None:
    saved = {"a": torch.arange(6.0), "b": torch.ones(2, 3), "c": torch.full((3,), 5),
             "l": [torch.zeros(2), torch.ones(2)]}  # fmt: skip
    with CheckpointStore(tmp_path, job="j") as ckpt:
        ckpt.save(1, saved, blocking=True)
    into = {"a": torch.zeros(6, dtype=torch.float64),  # another dtype
            "b": torch.zeros(3, 2),  # another shape
            "l": [torch.full((2,), 9.0)],  # a shorter list: its first place pairs
            "extra": torch.full((2,), 4.0)}  # fmt: skip
    before = {k: v.clone() for k, v in into.items() if isinstance(v, torch.Tensor)}
    with CheckpointStore(tmp_path, job="j") as ckpt:
        got = ckpt.load(into=into)
    assert got is not None
    state = got[1]
    assert state["l"][0] is into["l"][0] and torch.equal(into["l"][0], torch.zeros(2))
    for key in ("a", "b", "extra"):
        assert torch.equal(into[key], before[key])  # untouched
    assert state["a"] is not into["a"] and torch.equal(state["a"], saved["a"])
    assert torch.equal(state["b"], saved["b"]) and torch.equal(state["c"], saved["c"])
    assert torch.equal(state["l"][1], saved["l"][1])


def test_strided_targets_and_parameters_that_require_grad_are_filled(tmp_path: Path) -> None:
    base = torch.arange(12.0).reshape(3, 4)
    with CheckpointStore(tmp_path, job="j") as ckpt:
        ckpt.save(1, {"t": base.t().contiguous(), "p": torch.full((5,), 2.0)}, blocking=True)
    strided = torch.zeros(3, 4).t()  # shape (4, 3), not contiguous
    param = torch.nn.Parameter(torch.zeros(5))
    with CheckpointStore(tmp_path, job="j") as ckpt:
        got = ckpt.load(into={"t": strided, "p": param})
    assert got is not None
    assert torch.equal(strided, base.t()) and got[1]["t"] is strided
    assert torch.equal(param.detach(), torch.full((5,), 2.0)) and param.requires_grad


def test_a_corrupt_slot_leaves_the_targets_as_they_were(tmp_path: Path) -> None:
    with CheckpointStore(tmp_path, job="j") as ckpt:
        ckpt.save(1, {"w": torch.full((1 << 20,), 1.0)}, blocking=True)
        ckpt.save(2, {"w": torch.full((1 << 20,), 2.0)}, blocking=True)

    def step_of(path: Path) -> int:
        return decode_header(path.read_bytes()[:HEADER_SIZE], file_size=path.stat().st_size).step

    newest = next(p for p in (slot_path(tmp_path, 0, s) for s in range(SLOTS))
                  if p.exists() and step_of(p) == 2)  # fmt: skip
    raw = bytearray(newest.read_bytes())
    h = decode_header(bytes(raw[:HEADER_SIZE]), file_size=len(raw))
    raw[h.layout.payload_offset + h.layout.payload_len - 5] ^= 0xFF  # the last chunk
    newest.write_bytes(bytes(raw))
    into = {"w": torch.full((1 << 20,), 9.0)}
    with CheckpointStore(tmp_path, job="j") as ckpt:
        assert ckpt.load(step=2, into=into) is None
        assert bool((into["w"] == 9.0).all())  # no byte of the failing slot was copied
        got = ckpt.load(into=into)  # the older slot passes and fills it
    assert got is not None and got[0] == 1 and bool((into["w"] == 1.0).all())


def test_into_that_no_slot_holds_is_refused_by_name(tmp_path: Path) -> None:
    with CheckpointStore(tmp_path, job="j") as ckpt:
        ckpt.save(1, {"w": torch.ones(2)}, blocking=True)
        with pytest.raises(checkpoint.TreeError, match="state\\['x'\\]"):
            ckpt.load(into={"x": object()})


def test_the_module_load_takes_the_agreed_step_into_the_trainers_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checkpoint, "_default", None)
    monkeypatch.setattr(checkpoint, "_sized", False)
    env = {contract.ENV_CHECKPOINT_DIR: str(tmp_path), "RANK": "0",
           contract.TORCHELASTIC_RUN_ID: "run", contract.KELASTIC_ROUND: "-1"}  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with CheckpointStore(tmp_path, job="run") as ckpt:
        for step in (3, 4):
            ckpt.save(step, {"w": torch.full((4,), float(step))}, blocking=True)
    monkeypatch.setenv(contract.ENV_CHECKPOINT_STEP, "3")
    into = {"w": torch.zeros(4)}
    try:
        got = checkpoint.load(into=into)
    finally:
        checkpoint.default_store().close()
    assert got is not None and got[0] == 3 and got[1]["w"] is into["w"]
    assert torch.equal(into["w"], torch.full((4,), 3.0))


def test_tensors_pair_by_place_whatever_the_key_order() -> None:
    t = torch.zeros(1)
    saved, _ = flatten({"a": t, "b": [t.clone(), {"c": t.clone()}], "d": (t.clone(),)},
                       lambda v: isinstance(v, torch.Tensor))  # fmt: skip
    into, _ = flatten({"b": [t.clone(), {"c": t.clone(), "z": t.clone()}], "a": t.clone(),
                       "d": [t.clone()]}, lambda v: isinstance(v, torch.Tensor))  # fmt: skip
    # saved: a=0, b[0]=1, b[1].c=2, d[0]=3; into: b[0]=0, b[1].c=1, z=2, a=3, d (a list)=4
    assert pair_tensors(saved, into) == {0: 3, 1: 0, 2: 1}
    assert pair_tensors(saved, ["l"]) == {} and pair_tensors(["T", 0], ["T", 5]) == {0: 5}
