"""What an API error says, for Events and logs (one plain function)."""

from __future__ import annotations

import json

from kubernetes.client.exceptions import ApiException

__all__ = ["api_message"]


def api_message(exc: ApiException) -> str:
    """The ``message`` of the Status object in an API error (e.g. a webhook's or the
    API server's refusal), else ``"<status> <reason>"``."""
    try:
        doc = json.loads(exc.body or "")
    except (TypeError, ValueError):
        doc = None
    if isinstance(doc, dict) and doc.get("message"):
        return str(doc["message"])
    return f"{exc.status} {exc.reason}"
