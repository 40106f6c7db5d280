"""The simple JSONPaths of CRDs (``.spec.replicas``, ``.status.conditions[0].type``)."""

from __future__ import annotations

import re
from typing import Any

_STEP = re.compile(r"\.([^.\[\]]+)|\[(\d+)\]")


def _steps(path: str) -> list[str | int]:
    path = path.strip()
    if path.startswith("{") and path.endswith("}"):
        path = path[1:-1]
    steps: list[str | int] = []
    pos = 0
    while pos < len(path):
        match = _STEP.match(path, pos)
        if not match:
            raise ValueError(f"unsupported JSONPath {path!r} (use .field and [index] steps)")
        steps.append(match[1] if match[1] is not None else int(match[2]))
        pos = match.end()
    return steps


def get(obj: Any, path: str) -> Any:
    """The value at ``path``, or None when any step is missing."""
    node = obj
    for step in _steps(path):
        if isinstance(step, int):
            if not isinstance(node, list) or step >= len(node):
                return None
        elif not isinstance(node, dict) or step not in node:
            return None
        node = node[step]
    return node


def put(obj: dict[str, Any], path: str, value: Any) -> None:
    """Set the value at a path of field steps, creating intermediate objects."""
    steps = _steps(path)
    node: Any = obj
    for step in steps[:-1]:
        node = node.setdefault(step, {})
    node[steps[-1]] = value


def validate(path: str) -> str | None:
    """An error message when ``path`` is not a supported JSONPath, else None."""
    try:
        _steps(path)
    except ValueError as exc:
        return str(exc)
    return None
