"""The repository's layering: docs/architecture.md's packages and what they may import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_stdlib_operator_module_is_not_shadowed() -> None:
    # A root-level ``operator`` package would shadow the stdlib module for pytest and
    # everything else started from the repo root.
    out = subprocess.run(
        [sys.executable, "-c", "import operator, sys; print(operator.__file__); "
         "print(operator.itemgetter(1)([0, 7]))"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    path, value = out.stdout.split()
    assert value == "7"
    assert "site-packages" not in path and str(ROOT) not in path, path
    assert not (ROOT / "operator" / "__init__.py").exists()


def test_worker_library_imports_only_the_stdlib() -> None:
    code = """
import importlib, json, pkgutil, sys
before = set(sys.modules)  # what site/.pth files imported already
import kelastic
names = [m.name for m in pkgutil.iter_modules(kelastic.__path__, "kelastic.")]
for name in names:
    if name != "kelastic.__main__":
        importlib.import_module(name)
top = sorted({m.split(".")[0] for m in set(sys.modules) - before})
std = set(sys.stdlib_module_names) | {"kelastic", "__main__", "_distutils_hack", "__mp_main__"}
third = [m for m in top if m not in std and not m.startswith("_")]
print(json.dumps({"modules": names, "third_party": third}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    doc = json.loads(out.stdout)
    assert "kelastic.contract" in doc["modules"]
    assert doc["third_party"] == []


def test_packages_live_one_level_down() -> None:
    for folder, pkg in (("worker_lib", "kelastic"), ("sidecar", "kelastic_sidecar"),
                        ("operator", "kelastic_operator")):  # fmt: skip
        assert (ROOT / folder / pkg / "__init__.py").exists()
        assert (ROOT / folder / pkg / "py.typed").exists()
