"""A Ctrl-C during ``kelastic run``'s start-up exits 130 with one line, however Python
wraps the interrupt: raised inside a class body's ``__set_name__`` (pydantic's import
runs thousands of them), it comes out as a ``RuntimeError`` whose cause is the interrupt
(seen in CI: a Ctrl-C 1 s after the start, on a loaded machine, printed a traceback and
exited 1)."""

from __future__ import annotations

import pytest

from kelastic_operator import cli


class _Slot:
    def __set_name__(self, owner: type, name: str) -> None:
        raise cli.StartUpInterrupted()  # what the start-up's SIGINT handler raises


def _import_while_interrupted(argv: list[str] | None) -> int:
    cli._start_up_sigint.fired = True  # the handler ran
    type("Namespace", (), {"data": _Slot()})  # Python wraps it: RuntimeError from it
    raise AssertionError("not reached")


def test_an_interrupt_wrapped_by_python_exits_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(RuntimeError) as wrapped:  # the precondition: Python wraps it
        type("Namespace", (), {"data": _Slot()})
    assert isinstance(wrapped.value.__cause__, cli.StartUpInterrupted)
    monkeypatch.setattr(cli, "_main", _import_while_interrupted)
    assert cli.main(["run", "job.yaml"]) == 130
    assert capsys.readouterr().err == "kelastic: interrupted\n"


def test_an_error_that_is_not_the_interrupt_still_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(argv: list[str] | None) -> int:
        cli._start_up_sigint.fired = True  # a Ctrl-C came, but this error is not its doing
        raise RuntimeError("a real bug")

    monkeypatch.setattr(cli, "_main", broken)
    with pytest.raises(RuntimeError, match="a real bug"):
        cli.main(["run", "job.yaml"])
