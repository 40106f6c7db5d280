"""The sidecar's ``/status`` is written by the document's one codec
(:func:`kelastic.last_status.encode_last_status`), the one ``kelastic run`` and the kept
last status decode: a document the readers would refuse is a 500 that says why."""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kelastic.last_status import decode_last_status
from kelastic_sidecar.http import SidecarHttpServer


def _get(port: int) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_status_answers_by_the_codec_its_readers_decode(bad: float) -> None:
    doc: dict[str, Any] = {"node": "n-0", "phase": "running", "round": 2, "age_s": 0.5}
    server = SidecarHttpServer("127.0.0.1", 0, CollectorRegistry(), lambda: True,
                               lambda: True, lambda: doc)  # fmt: skip
    server.start()
    try:
        code, body = _get(server.port)
        assert code == 200 and decode_last_status(body) == doc
        doc["step_times"] = {"slowest": {"ratio_to_node_median": bad}}
        code, body = _get(server.port)
        assert code == 500 and body.startswith(b"/status: not a JSON document: "), body
    finally:
        server.stop()
