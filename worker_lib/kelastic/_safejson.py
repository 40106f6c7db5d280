"""Bounded JSON decoding for data that crosses a trust boundary (etcd values, sockets, FIFOs).

:func:`json.loads` on hostile input can raise things no caller expects: ``ValueError``
from Python's limit on integer digits (a 5000-digit number), ``RecursionError`` from
deeply nested brackets, and it accepts ``NaN``, ``Infinity`` and ``1e999`` (which
becomes ``inf``). :func:`loads_bounded` checks the size first, the nesting depth with a
linear scan before parsing, and every number while parsing, and raises only
:class:`UnsafeJSONError` (a ``ValueError``). Callers then check types and ranges of the
fields they use and turn the error into their own corrupt-input error. :func:`env_map`
checks one such field both wire protocols carry, an environment map; :func:`is_int` is
the one integer check of every decoder (a bool is no integer), :func:`load_object` the
one "bounded JSON object" step of every etcd value's decoder. Stdlib only.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Final, NoReturn, TypeGuard

__all__ = [
    "MAX_DEPTH",
    "MAX_INT_DIGITS",
    "BadEnvError",
    "UnsafeJSONError",
    "env_map",
    "is_int",
    "load_object",
    "loads_bounded",
]

#: Deepest nesting of arrays/objects accepted by default.
MAX_DEPTH: Final = 32
#: Most digits of an integer literal (sign excluded) accepted by default; 2**63 has 19.
MAX_INT_DIGITS: Final = 19
#: Longest float literal in characters.
_MAX_FLOAT_CHARS: Final = 64

# A JSON string (with escapes), or a bracket. Strings are skipped so that brackets in them
# do not count. A stray quote (invalid JSON) is left to json.loads to report.
_TOKENS: Final = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
# Only a number literal with 20+ digits in a row, or a 3-digit exponent, can break a
# bound (too many digits, or overflow to inf); without one, json's C parser runs alone.
_RISKY_NUMBER: Final = re.compile(rb"\d{20}|[eE][+-]?\d{3}")


class UnsafeJSONError(ValueError):
    """The input is not JSON, or exceeds a size, depth or number bound."""


class BadEnvError(ValueError):
    """A decoded environment map is not one (see :func:`env_map`)."""


def env_map(value: object, name: str, *, ints: bool = False) -> dict[str, str]:
    """Check an environment map decoded from JSON (the ``env`` of a control protocol
    ``assign``/``respawn``, of an in-process ``go``) and return it as ``dict[str, str]``.

    Args:
        value: the decoded value.
        name: what it is, for the error message (``"go env"``, ``"respawn.env"``).
        ints: accept integer values (not bools) and return them as strings (``RANK: 0``).

    Raises:
        BadEnvError: ``value`` is not an object; a name is empty or holds ``=`` or NUL;
            a value is not a string (nor an integer, with ``ints``) or holds NUL. The
            message names ``name`` and the offending key and value.
    """
    if not isinstance(value, dict):
        raise BadEnvError(f"{name} must be an object")
    env: dict[str, str] = {}
    for key, val in value.items():
        if not key or "=" in key or "\0" in key:
            raise BadEnvError(f"{name} has an invalid name {key!r}")
        if ints and isinstance(val, int) and not isinstance(val, bool):
            val = str(val)
        if not isinstance(val, str) or "\0" in val:
            raise BadEnvError(f"{name}[{key!r}] must be a string, got {val!r}")
        env[key] = val
    return env


def is_int(value: object, low: int | None = None, high: int | None = None) -> TypeGuard[int]:
    """Whether ``value`` is an integer (``bool`` is not, though Python says it is) within
    ``low..high``, both inclusive, each bound only when given."""
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and (low is None or value >= low)
        and (high is None or value <= high)
    )


def load_object(
    raw: bytes,
    where: str,
    *,
    max_bytes: int,
    max_depth: int = MAX_DEPTH,
    error: type[Exception] = UnsafeJSONError,
) -> dict[str, Any]:
    """Decode ``raw`` as one JSON object within bounds (:func:`loads_bounded`).

    Args:
        raw: the bytes (an etcd value).
        where: what it is (its key), for the message.
        max_bytes, max_depth: as :func:`loads_bounded`.
        error: the exception class to raise (the caller's corrupt-value error), built
            from one message argument.

    Raises:
        error: not bounded JSON, or not an object; the message names ``where`` and
            the first 80 bytes. Never another exception, whatever ``raw`` holds.
    """
    try:
        doc = loads_bounded(raw, max_bytes=max_bytes, max_depth=max_depth)
    except UnsafeJSONError as exc:
        _raise(error, f"{where}: {exc}: {raw[:80]!r}")
    if not isinstance(doc, dict):
        _raise(error, f"{where}: not a JSON object: {raw[:80]!r}")
    return doc


def _raise(error: type[Exception], message: str) -> NoReturn:
    raise error(message) from None


def _depth_ok(raw: bytes, max_depth: int) -> bool:
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return True  # cannot nest deeper than the brackets it has
    depth = 0
    for match in _TOKENS.finditer(raw):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            if depth > max_depth:
                return False
        elif token in (b"]", b"}"):
            depth -= 1
    return True


def _too_deep_or_not_json(data: bytes, max_depth: int) -> str:
    """Why bytes with more than ``max_depth`` nested brackets are refused: ``not JSON``
    when they cannot be JSON however deep (not UTF-8, not starting with ``[`` or ``{``,
    brackets that do not pair up), else ``nested deeper than ...``."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"not JSON: not UTF-8 ({exc.reason} at byte {exc.start})"
    head = data.lstrip(b" \t\r\n")[:1]
    if head not in (b"[", b"{"):
        return f"not JSON: starts with {head!r}, not an array or object"
    stack: list[bytes] = []
    for match in _TOKENS.finditer(data):
        token = match.group()
        if token in (b"[", b"{"):
            stack.append(b"]" if token == b"[" else b"}")
        elif token in (b"]", b"}") and (not stack or stack.pop() != token):
            return f"not JSON: unmatched {token.decode()!r} at byte {match.start()}"
    return f"nested deeper than {max_depth}"


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise UnsafeJSONError(f"integer of {len(text)} characters")
    return int(text)


def _parse_float(text: str) -> float:
    if len(text) > _MAX_FLOAT_CHARS:
        raise UnsafeJSONError(f"number of {len(text)} characters")
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as inf
        raise UnsafeJSONError(f"number {text} is out of range")
    return value


def _reject_constant(name: str) -> Any:
    raise UnsafeJSONError(f"{name} is not a JSON number")


def loads_bounded(raw: bytes | str, *, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """Decode ``raw`` as JSON within bounds.

    Args:
        raw: UTF-8 bytes (or text) of one JSON document.
        max_bytes: longest accepted input, in bytes (characters for ``str``).
        max_depth: deepest accepted nesting of arrays and objects.

    Returns:
        The decoded value: integers have at most :data:`MAX_INT_DIGITS` digits, floats
        are finite; ``NaN``/``Infinity`` literals are refused.

    Raises:
        UnsafeJSONError: too long, too deep, not UTF-8, not JSON, or a number out of
            bounds. Nothing else (no ``RecursionError``, no digit-limit ``ValueError``).
    """
    if len(raw) > max_bytes:
        raise UnsafeJSONError(f"{len(raw)} bytes, over the {max_bytes}-byte limit")
    data = raw.encode("utf-8", errors="surrogatepass") if isinstance(raw, str) else raw
    if not _depth_ok(data, max_depth):
        raise UnsafeJSONError(_too_deep_or_not_json(data, max_depth))
    try:
        text = raw if isinstance(raw, str) else raw.decode("utf-8")
        if _RISKY_NUMBER.search(data) is None:
            return json.loads(text, parse_constant=_reject_constant)
        return json.loads(
            text,
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=_reject_constant,
        )
    except UnsafeJSONError:
        raise
    except (ValueError, RecursionError, TypeError) as exc:  # JSONDecodeError, bad UTF-8
        raise UnsafeJSONError(f"not JSON: {exc}") from None
