"""A committed slot persisted in torch DCP's format (``kelastic.checkpoint.persist``, the
codec ``dcp_format``, no torch) loads with plain ``torch.distributed.checkpoint``: with a
template (``dcp.load``) and without (``dcp_to_torch_save``, from the planner data); its
metadata is the one DCP's own writer makes of the same state; a slot rewritten while it is
written, a corrupt slot, a state DCP cannot name each fail with nothing left behind."""

from __future__ import annotations

import json
import math
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from kelastic.checkpoint import CheckpointStore, dcp_format, persist
from kelastic.checkpoint.dcp_format import DcpFormatError, RawTensor, flatten
from kelastic.checkpoint.persist import COMPLETE, PersistError, complete_steps
from kelastic.checkpoint.slot_format import COMMIT_OFFSET, HEADER_SIZE, decode_header
from kelastic.checkpoint.store import slot_path

JOB = "job-dcp"


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),  # an OrderedDict with torch's _metadata
        "optim": opt.state_dict(),  # int keys, lists of groups, 0-dim step tensors
        "step": 17,
        "huge": 2**63 - 1,
        "loss": math.nan,
        "name": "run \u00e9\u6f22",
        "pair": (torch.arange(3), "x"),  # a tuple is one item, its tensor inside
        "dtypes": {
            "bf16": torch.randn(3, 2).to(torch.bfloat16),
            "f8": torch.randn(4).to(torch.float8_e4m3fn),
            "u16": torch.arange(5).to(torch.uint16),
            "c64": torch.randn(2, dtype=torch.complex64),
            "bool": torch.tensor([True, False, True]),
            "empty": torch.empty(0, 3),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "strided": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
        },
        "lists": [torch.ones(2), {"inner": torch.zeros(1)}],  # walked: holds tensors
        "plain": [1, 2, 3],  # one item
        "empty": {},
    }


def _save(folder: Path, state: dict[str, Any], step: int, rank: int = 0, world: int = 1,
          round_: int = 1) -> None:  # fmt: skip
    folder.mkdir(exist_ok=True)
    store = CheckpointStore(folder, rank=rank, job=JOB, world_size=world, round=round_)
    try:
        store.save(step, state, blocking=True)
    finally:
        store.close()


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and (
            torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a, b.view(torch.uint8)
                        if b.dtype.itemsize == 1 else b)
        )  # fmt: skip
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and list(map(str, a)) == list(map(str, b))
            and all(_equal(v, b[k] if k in b else b[str(k)]) for k, v in a.items())
        )
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return bool(a == b)


def _template(state: Any) -> Any:
    """A state of the same structure with every tensor zeroed (what a user loads into)."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state.contiguous())
    if isinstance(state, OrderedDict):
        return OrderedDict((k, _template(v)) for k, v in state.items())
    if isinstance(state, dict):
        return {k: _template(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_template(v) for v in state]
    if isinstance(state, tuple):
        return tuple(_template(v) for v in state)
    return None if not isinstance(state, (int, float, str)) else type(state)()


def test_a_persisted_slot_loads_with_plain_dcp(tmp_path: Path) -> None:
    state = _state()
    _save(tmp_path / "slots", state, step=42)
    done = persist.persist(tmp_path / "slots", 0, JOB, 42, tmp_path / "persist")
    assert done.path == tmp_path / "persist" / "step-42" / "rank-0"
    assert done.nbytes > 0 and done.completed_step
    assert complete_steps(tmp_path / "persist") == [42]
    assert sorted(p.name for p in done.path.iterdir()) == [
        ".metadata", "__0_0.distcp", "kelastic-int-keys.json", "kelastic.json"]  # fmt: skip
    # the optimizer's int keys, which DCP stores as text (kelastic's load turns them back)
    int_keys = json.loads((done.path / "kelastic-int-keys.json").read_text())
    assert int_keys == [["optim", "state", str(k)] for k in state["optim"]["state"]]
    info = json.loads((done.path / "kelastic.json").read_text())
    assert (info["job"], info["step"], info["round"], info["rank"]) == (JOB, 42, 1, 0)

    # with a template, as a user's training script loads
    template = _template(state)
    dcp.load(template, checkpoint_id=str(done.path), no_dist=True)
    expected = {k: v for k, v in state.items() if k != "empty"}
    got = {k: v for k, v in template.items() if k != "empty"}
    assert _equal(expected, got)
    # without one: DCP's own converter rebuilds the state from the planner data
    dcp_to_torch_save(str(done.path), str(tmp_path / "whole.pt"))
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert _equal(whole["model"], dict(state["model"]))
    assert _equal(whole["optim"]["state"], {str(k): v for k, v in state["optim"]["state"].items()})
    assert whole["step"] == 17 and whole["huge"] == 2**63 - 1 and math.isnan(whole["loss"])
    assert _equal(whole["pair"], state["pair"]) and whole["name"] == state["name"]


def test_the_metadata_is_the_one_dcps_own_writer_makes(tmp_path: Path) -> None:
    state = _state()
    _save(tmp_path / "slots", state, step=3)
    ours = persist.persist(tmp_path / "slots", 0, JOB, 3, tmp_path / "persist").path
    dcp.save(state, checkpoint_id=str(tmp_path / "theirs"), no_dist=True)
    with (ours / ".metadata").open("rb") as fh:
        mine = pickle.load(fh)
    with (tmp_path / "theirs" / ".metadata").open("rb") as fh:
        theirs = pickle.load(fh)
    assert mine.state_dict_metadata == theirs.state_dict_metadata
    assert mine.planner_data == theirs.planner_data
    assert set(mine.storage_data) == set(theirs.storage_data)
    assert mine.version == theirs.version and mine.storage_meta.modules == []


def test_every_rank_gets_its_folder_and_the_last_one_completes_the_step(tmp_path: Path) -> None:
    slots, root = tmp_path / "slots", tmp_path / "persist"
    for rank in range(3):
        _save(slots, {"w": torch.full((2,), float(rank))}, step=9, rank=rank, world=3)
    assert not persist.persist(slots, 2, JOB, 9, root).completed_step
    assert not persist.persist(slots, 0, JOB, 9, root).completed_step
    assert complete_steps(root) == []
    assert persist.persist(slots, 1, JOB, 9, root).completed_step
    assert complete_steps(root) == [9]
    assert '"world_size": 3' in (root / "step-9" / COMPLETE).read_text()
    again = persist.persist(slots, 1, JOB, 9, root)  # kept as it is
    assert again.nbytes == 0 and not again.completed_step
    for rank in range(3):
        template = {"w": torch.zeros(2)}
        dcp.load(template, checkpoint_id=str(root / "step-9" / f"rank-{rank}"), no_dist=True)
        assert template["w"].tolist() == [float(rank)] * 2
    assert [p.name for p in (root / "step-9").iterdir() if p.name.startswith(".")] == []


def test_a_writer_killed_before_it_wrote_complete_leaves_it_to_the_next_write(
    tmp_path: Path,
) -> None:
    """Every rank's folder whole, ``COMPLETE`` missing (the last writer was killed between
    its rename and the marker): the next write of any rank writes nothing of its own and
    completes the step (what the writer-kill test found as a dead end: no rank absent)."""
    slots, root = tmp_path / "slots", tmp_path / "persist"
    for rank in (0, 1):
        _save(slots, {"w": torch.full((2,), float(rank))}, step=4, rank=rank, world=2)
        persist.persist(slots, rank, JOB, 4, root)
    (root / "step-4" / COMPLETE).unlink()
    assert complete_steps(root) == []
    again = persist.persist(slots, 0, JOB, 4, root)
    assert again.nbytes == 0 and again.completed_step
    assert complete_steps(root) == [4]


def test_a_step_of_an_abandoned_history_is_replaced_never_mixed(tmp_path: Path) -> None:
    slots, root = tmp_path / "slots", tmp_path / "persist"
    for rank in (0, 1):  # round 1: both ranks saved step 5, with values of that history
        _save(slots, {"w": torch.full((4,), 1.0)}, step=5, rank=rank, world=2)
    assert persist.persist(slots, 0, JOB, 5, root).completed_step is False
    assert persist.persist(slots, 1, JOB, 5, root).completed_step
    # round 2 restored step 4 and saved step 5 again (new values): rank 0 first
    _save(slots, {"w": torch.full((4,), 2.0)}, step=5, rank=0, world=2, round_=2)
    done = persist.persist(slots, 0, JOB, 5, root)
    assert done.nbytes > 0 and not done.completed_step
    assert complete_steps(root) == []  # rank 0 of round 2 beside rank 1 of round 1: not whole
    _save(slots, {"w": torch.full((4,), 2.0)}, step=5, rank=1, world=2, round_=2)
    assert persist.persist(slots, 1, JOB, 5, root).completed_step
    assert complete_steps(root) == [5]
    assert '"round": 2' in (root / "step-5" / COMPLETE).read_text()
    for rank in (0, 1):
        template = {"w": torch.zeros(4)}
        dcp.load(template, checkpoint_id=str(root / "step-5" / f"rank-{rank}"), no_dist=True)
        assert template["w"].eq(2.0).all()
    # an older round's slot never replaces a newer round's folder
    _save(slots, {"w": torch.full((4,), 9.0)}, step=5, rank=0, world=2, round_=1)
    assert persist.persist(slots, 0, JOB, 5, root).nbytes == 0
    assert [p.name for p in (root / "step-5").iterdir() if p.name.startswith(".")] == []


def test_a_slot_rewritten_while_it_is_written_is_not_persisted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slots, root = tmp_path / "slots", tmp_path / "persist"
    _save(slots, {"a": torch.ones(1000), "b": torch.ones(10)}, step=5)
    path = slot_path(slots, 0, 0)
    real = persist.write_torch_save
    calls = []

    def a_save_begins(value: Any, out: Any, name: str = "archive") -> None:
        real(value, out, name)
        if not calls:  # after the first item: a new save marks the slot dirty
            with path.open("r+b") as fh:
                fh.seek(COMMIT_OFFSET)
                fh.write(bytes(16))
        calls.append(1)

    monkeypatch.setattr(persist, "write_torch_save", a_save_begins)
    with pytest.raises(PersistError, match="rewritten while step 5 was written"):
        persist.persist(slots, 0, JOB, 5, root)
    assert list((root / "step-5").iterdir()) == []
    assert complete_steps(root) == []


def test_a_corrupt_or_missing_slot_is_not_persisted(tmp_path: Path) -> None:
    slots, root = tmp_path / "slots", tmp_path / "persist"
    with pytest.raises(PersistError, match="no slot file"):
        persist.persist(slots, 0, JOB, 1, root)
    _save(slots, {"a": torch.ones(100)}, step=1)
    with pytest.raises(PersistError, match="no committed step 2"):
        persist.persist(slots, 0, JOB, 2, root)
    with pytest.raises(PersistError, match="no committed step 1 of rank 0"):
        persist.persist(slots, 0, "another-job", 1, root)
    path = slot_path(slots, 0, 0)
    with path.open("rb") as fh:
        header = decode_header(fh.read(HEADER_SIZE), file_size=path.stat().st_size)
    with path.open("r+b") as fh:  # one payload byte flipped
        fh.seek(header.layout.payload_offset + 7)
        byte = fh.read(1)
        fh.seek(header.layout.payload_offset + 7)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(PersistError, match="fails its crc32"):
        persist.persist(slots, 0, JOB, 1, root)
    assert not (root / "step-1" / "rank-0").exists()


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, "two paths of the state give"),
        ([torch.ones(1)], "DCP stores a dict of state; the slot holds a list"),
    ],
    ids=["duplicate-key", "not-a-dict"],
)
def test_a_state_dcp_cannot_name_fails_clearly(tmp_path: Path, state: Any, match: str) -> None:
    _save(tmp_path / "slots", state, step=4)
    with pytest.raises(PersistError, match=match):
        persist.persist(tmp_path / "slots", 0, JOB, 4, tmp_path / "persist")
    assert list((tmp_path / "persist" / "step-4").iterdir()) == []


# ----------------------------------------------------------------- the codec alone

_leaf = (
    st.none() | st.booleans() | st.floats(allow_nan=True, allow_infinity=True)
    | st.integers(min_value=-(2**200), max_value=2**200) | st.text(max_size=20)
)  # fmt: skip
_keys = st.one_of(st.text(max_size=8), st.integers(-5, 5))
_values = st.recursive(
    _leaf,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(_keys, inner, max_size=4)
        | st.dictionaries(_keys, inner, max_size=4).map(OrderedDict)
    ),
    max_leaves=20,
)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


@settings(max_examples=300, deadline=None)
@given(_values)
def test_the_pickle_writer_round_trips_any_plain_value(value: Any) -> None:
    p = dcp_format._Pickle()
    p.value(value)
    assert _same(value, pickle.loads(p.done()))


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=6), _values, max_size=5))
def test_flatten_names_items_as_dcp_does(state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    try:
        theirs = flatten_state_dict(state)[1]
    except ValueError:
        with pytest.raises(DcpFormatError):
            flatten(state)
        return
    assert {i.fqn: i.path for i in flatten(state)} == theirs


def test_torch_loads_what_write_torch_save_wrote_with_weights_only(tmp_path: Path) -> None:
    import io

    data = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    raw = RawTensor("int32", (2, 3), memoryview(data.numpy().tobytes()))
    out = io.BytesIO()
    out.write(b"prefix")  # an archive at an offset in a data file, as DCP writes them
    dcp_format.write_torch_save(raw, out)
    got = torch.load(io.BytesIO(out.getvalue()[6:]), weights_only=True)
    assert torch.equal(got, data)
    with pytest.raises(DcpFormatError, match="needs 24 bytes, its buffer has 4"):
        dcp_format.write_torch_save(RawTensor("int32", (2, 3), b"1234"), io.BytesIO())
    with pytest.raises(DcpFormatError, match="a set has no pickle"):
        dcp_format.write_torch_save({1, 2}, io.BytesIO())
    with pytest.raises(DcpFormatError, match="an int of 3000 bits"):
        dcp_format.write_torch_save(2**2999, io.BytesIO())
