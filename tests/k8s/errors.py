"""API errors, rendered as Kubernetes ``Status`` objects (``kind: Status``)."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error the API server answers with: an HTTP code, a reason and a message."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def _qualified(plural: str, group: str) -> str:
    return f"{plural}.{group}" if group else plural


def not_found(plural: str, group: str, name: str) -> ApiError:
    return ApiError(
        404,
        "NotFound",
        f'{_qualified(plural, group)} "{name}" not found',
        {"name": name, "group": group, "kind": plural},
    )


def already_exists(plural: str, group: str, name: str) -> ApiError:
    return ApiError(
        409,
        "AlreadyExists",
        f'{_qualified(plural, group)} "{name}" already exists',
        {"name": name, "group": group, "kind": plural},
    )


def conflict(plural: str, group: str, name: str, why: str) -> ApiError:
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {_qualified(plural, group)} "{name}": {why}',
        {"name": name, "group": group, "kind": plural},
    )


def stale(plural: str, group: str, name: str) -> ApiError:
    return conflict(
        plural,
        group,
        name,
        "the object has been modified; please apply your changes to the latest version "
        "and try again",
    )


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def forbidden(message: str) -> ApiError:
    return ApiError(403, "Forbidden", message)


def method_not_allowed(message: str) -> ApiError:
    return ApiError(405, "MethodNotAllowed", message)


def gone(message: str) -> ApiError:
    return ApiError(410, "Expired", message)


def unsupported_media_type(message: str) -> ApiError:
    return ApiError(415, "UnsupportedMediaType", message)


def not_acceptable(message: str) -> ApiError:
    return ApiError(406, "NotAcceptable", message)


class FieldError:
    """One cause of an ``Invalid`` (422) error: ``<field>: <type>: <detail>``."""

    def __init__(self, field: str, kind: str, detail: str, value: Any = None) -> None:
        self.field = field  # dotted path, e.g. "spec.replicas"; "<nil>" for the root
        self.kind = kind  # FieldValueInvalid, FieldValueRequired, FieldValueNotSupported, ...
        self.detail = detail
        self.value = value

    _LABELS = {
        "FieldValueInvalid": "Invalid value",
        "FieldValueRequired": "Required value",
        "FieldValueNotSupported": "Unsupported value",
        "FieldValueForbidden": "Forbidden",
        "FieldValueDuplicate": "Duplicate value",
        "FieldValueTypeInvalid": "Invalid value",
        "FieldValueTooMany": "Too many",
    }

    def text(self) -> str:
        label = self._LABELS.get(self.kind, "Invalid value")
        if self.kind in ("FieldValueRequired", "FieldValueForbidden"):
            return f"{self.field}: {label}" + (f": {self.detail}" if self.detail else "")
        return f"{self.field}: {label}: {_go_repr(self.value)}: {self.detail}"

    def cause(self) -> dict[str, Any]:
        # kubectl prints "<field>: <message>" for each cause, so the message omits the field.
        message = self.text().removeprefix(f"{self.field}: ")
        return {"reason": self.kind, "message": message, "field": self.field}


def _go_repr(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return '"object"'
    if isinstance(value, list):
        return '"array"'
    if value is None:
        return "null"
    return str(value)


def invalid(kind: str, group: str, name: str, errors: list[FieldError]) -> ApiError:
    """422 Unprocessable Entity, worded like the real API server."""
    qualified = f"{kind}.{group}" if group else kind
    texts = [e.text() for e in errors]
    joined = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
    return ApiError(
        422,
        "Invalid",
        f'{qualified} "{name}" is invalid: {joined}',
        {"name": name, "group": group, "kind": kind, "causes": [e.cause() for e in errors]},
    )


def no_such_resource() -> ApiError:
    """404 for a URL that names no served resource (as the real server words it)."""
    return ApiError(404, "NotFound", "the server could not find the requested resource")
