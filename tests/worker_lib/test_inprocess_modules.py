"""No module of :mod:`kelastic.inprocess` writes another object's private attribute (the
session set ``CallWrapper._iteration``; it calls ``CallWrapper.set_iteration`` now). That
its modules import no circle is ``tests/test_layout.py``'s graph check."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kelastic.inprocess import CallWrapper

PACKAGE = Path(__file__).resolve().parents[2] / "worker_lib" / "kelastic" / "inprocess"


def _private_writes(source: str) -> list[str]:
    """``obj._name = ...`` (plain, augmented or annotated) where ``obj`` is not
    ``self``/``cls``: a write into another object's private state."""
    written = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            if not isinstance(target, ast.Attribute) or not target.attr.startswith("_"):
                continue
            own = isinstance(target.value, ast.Name) and target.value.id in ("self", "cls")
            if not own and not target.attr.startswith("__"):
                written.append(f"{node.lineno}: {ast.unparse(target)}")
    return written


def test_the_check_sees_a_private_write() -> None:
    assert _private_writes("self.call_wrapper._iteration = 1\nself._x = 2\nobj._y += 1") == [
        "1: self.call_wrapper._iteration", "3: obj._y"]  # fmt: skip


def test_no_inprocess_module_writes_another_objects_private_attribute() -> None:
    written = {
        p.name: w for p in sorted(PACKAGE.glob("*.py")) if (w := _private_writes(p.read_text()))
    }
    assert written == {}


def test_the_iteration_is_set_through_the_public_method() -> None:
    call_wrapper = CallWrapper()
    call_wrapper.set_iteration(3)
    assert call_wrapper.iteration == 3
    with pytest.raises(ValueError, match="iteration must be >= 0"):
        call_wrapper.set_iteration(-1)
