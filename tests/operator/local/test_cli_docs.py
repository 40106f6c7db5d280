"""The README's synopsis of ``kelastic run`` names every option the command takes."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from kelastic_operator.cli import _build_parser

README = Path(__file__).resolve().parents[3] / "README.md"


def _run_parser() -> argparse.ArgumentParser:
    (sub,) = [a for a in _build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    parser: argparse.ArgumentParser = sub.choices["run"]
    return parser


def test_the_readme_synopsis_names_every_option_of_kelastic_run() -> None:
    (synopsis,) = re.findall(r"```\n(kelastic run job\.yaml .*?)```", README.read_text(), re.S)
    named = set(re.findall(r"--[a-z][a-z-]*", synopsis))
    options = {o for a in _run_parser()._actions for o in a.option_strings if o.startswith("--")}
    assert options - {"--help"} == named, (options, named)
