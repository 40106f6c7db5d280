"""What a test needs beyond ``pip install -e ".[dev]"`` (torch, which the set-up command
installs beside it): where it is missing, the test skips on a developer's machine and
fails under ``CI=true``, where ``.ci/run`` has installed everything (README,
Development: CI runs every test)."""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest


def missing(what: str) -> NoReturn:
    """Skip (also at module level), or fail under ``CI=true``, saying ``what`` is missing."""
    if os.environ.get("CI"):
        pytest.fail(f"{what}; CI must run every test (.ci/run installs it)", pytrace=False)
    pytest.skip(what, allow_module_level=True)


def require_module(name: str, install: str = 'pip install "torch==2.13.0"') -> ModuleType:
    """The module ``name``, imported; if it cannot be, :func:`missing` (naming ``install``)."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing(f"{name} cannot be imported ({exc}): {install}")
