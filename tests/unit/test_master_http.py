"""The master's /metrics registry (master/http.py) on a multiprocess directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from qcluster.master.http import build_registry
from qcluster.master.snapshot import SupervisorSnapshot


def test_a_metric_file_being_created_does_not_break_the_scrape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slot forked this instant has its file created empty, sized a moment later; the
    scrape read it empty, raised struct.error and answered nothing (seen in
    test_leaking_slot_recycles_and_metrics_files_stay_bounded: 'Remote end closed
    connection'). Regression: fails on the collector before."""
    from prometheus_client import generate_latest

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    (tmp_path / "counter_slot3.db").write_bytes(b"")  # created, not yet sized
    registry = build_registry(lambda: SupervisorSnapshot(), "h")
    text = generate_latest(registry).decode()
    assert "qcluster_host_capacity_slots" in text


def test_the_endpoint_answers_get_and_refuses_the_rest() -> None:
    import http.client
    import json

    from qcluster.master.http import serve
    from qcluster.security import ListenAddress

    snap = SupervisorSnapshot(capacity_slots=7, fatal={"q": "5 boot errors in a row"})
    server = serve(ListenAddress("127.0.0.1", 0), lambda: snap, "h")
    port = server.server_address[1]
    try:
        def get(method: str, path: str, host: str = "127.0.0.1") -> tuple[int, bytes]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request(method, path, headers={"Host": host})
            response = conn.getresponse()
            body = response.read()
            conn.close()
            return response.status, body

        status, body = get("GET", "/api/v1/host")
        assert status == 200
        host = json.loads(body)
        assert host["capacity_slots"] == 7 and host["fatal"] == {"q": "5 boot errors in a row"}
        assert get("GET", "/healthz") == (200, b'{"status": "ok", "host": "h"}')
        assert get("GET", "/api/v1/slots") == (200, b"[]")
        status, body = get("GET", "/metrics")
        assert status == 200 and b"qcluster_host_capacity_slots 7.0" in body
        assert get("POST", "/metrics")[0] == 405
        assert get("GET", "/nope")[0] == 404
        assert get("GET", "/healthz", host="evil.example")[0] == 400
    finally:
        server.shutdown()
