"""A master's report read by the report route's own reader (manager/api/report_body.py):
the same report and the same answers as FastAPI's reading, each distinct section of queue
policies validated once, and a report's queues stored without new tracks."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from qcluster.manager import state as state_module
from qcluster.manager.api import report_body
from qcluster.manager.api.app import create_app
from qcluster.manager.api.report_body import KEPT_SECTIONS, ReportReader
from qcluster.messages import HostReport
from tests.unit.test_manager_service import service
from tests.unit.test_manager_state import report, state

AUTH = {"Authorization": "Bearer s3cret"}


def body(host: str = "a", **policies: dict[str, Any]) -> dict[str, Any]:
    """A report's JSON as a master sends it, its policies replaced by ``policies``."""
    sent: dict[str, Any] = json.loads(report(host, {"mail": 1}).model_dump_json())
    sent["queues"].update(policies)
    return sent


def full(sent: dict[str, Any]) -> HostReport:
    """What FastAPI's reading gives: json.loads, then the whole report validated."""
    return HostReport.model_validate(json.loads(json.dumps(sent)))


def test_the_report_read_is_the_one_fastapi_reads() -> None:
    reader = ReportReader()
    for sent in (body("a"), body("b"), body("a")):
        read = reader.read(json.dumps(sent).encode())
        assert read == full(sent)
        assert read is not None and read.model_dump_json() == full(sent).model_dump_json()


def test_a_section_of_policies_is_validated_once_for_every_host() -> None:
    reader = ReportReader()
    first = reader.read(json.dumps(body("a")).encode())
    second = reader.read(json.dumps(body("b")).encode())
    assert first is not None and second is not None
    assert all(second.queues[name] is policy for name, policy in first.queues.items())
    assert len(reader.sections) == 1


@pytest.mark.parametrize(("one", "other"), [
    ({"batch_timeout": True}, {"batch_timeout": 1}),  # a bool is no number to derive from
    ({"idle_s": -0.0}, {"idle_s": 0.0}),  # kept as given: the views show -0.0
    ({"batch_size": 1.0}, {"batch_size": 1}),
])
def test_sections_equal_in_python_but_not_in_json_are_not_mixed_up(
        one: dict[str, Any], other: dict[str, Any]) -> None:
    """``==`` holds between each pair; a section kept for one must not answer the other."""
    reader = ReportReader()
    for policy in (one, other, one):
        sent = body("a", extra=policy)
        read = reader.read(json.dumps(sent).encode())
        assert read is not None
        assert read.queues["extra"].model_dump_json() == full(sent).queues[
            "extra"].model_dump_json()


@pytest.mark.parametrize("sent", [
    b'{"host": ', b"", b"[1, 2]", b'"a"', b'{"host": "a"}',
    json.dumps(body(bad={"min_slots": 9, "max_slots": 1})).encode(),
    json.dumps(body(bad={"unknown": 1})).encode(),
    json.dumps({**body(), "queues": [1]}).encode(),
    json.dumps({**body(), "sent_at": float("nan")}).encode(),
    b"[" * 300 + b"]" * 300,
])
def test_what_does_not_validate_is_left_to_fastapi(sent: bytes) -> None:
    assert ReportReader().read(sent) is None


def test_the_sections_kept_are_bounded() -> None:
    reader = ReportReader()
    for n in range(KEPT_SECTIONS + 3):
        assert reader.read(json.dumps(body(extra={"priority": n})).encode()) is not None
    assert len(reader.sections) == KEPT_SECTIONS


def test_the_route_answers_as_fastapi_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """A report read by the route's reader gets the bytes and headers FastAPI's handler
    sends (the one a ``charset`` content type still goes through)."""
    read: list[HostReport | None] = []
    original = ReportReader.read

    def counted(self: ReportReader, sent: bytes) -> HostReport | None:
        read.append(original(self, sent))
        return read[-1]

    monkeypatch.setattr(report_body.ReportReader, "read", counted)
    manager, _, _ = service()
    manager.tokens["token"] = "s3cret"
    client = TestClient(create_app(manager), base_url="http://127.0.0.1")
    content = json.dumps(body("a")).encode()
    answers = []
    for content_type in ("application/json", "application/json; charset=utf-8"):
        reply = client.post("/api/v1/reports", content=content,
                            headers={**AUTH, "Content-Type": content_type})
        answers.append((reply.status_code, reply.content, sorted(reply.headers.items())))
    assert len(read) == 1 and read[0] is not None  # only the first was the reader's
    assert answers[0] == answers[1] and answers[0][0] == 200
    refused = client.post("/api/v1/reports", content=content,
                          headers={"Content-Type": "application/json"})
    assert refused.status_code == 401 and len(read) == 1  # nothing read without the token


def test_a_report_of_known_queues_makes_no_track(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every report names all its app's queues: a new QueueTrack (a deque, a history ring
    and an arrivals ledger) for each of them, thrown away, was most of a report's work at
    150 queues."""
    s = state()
    s.receive(report("a", {"mail": 1}), 1.0)
    tracks = dict(s.tracks)
    made: list[object] = []

    class Counted(state_module.QueueTrack):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    monkeypatch.setattr(state_module, "QueueTrack", Counted)
    s.receive(report("b", {"mail": 2}), 2.0)
    assert made == [] and s.tracks == tracks
    assert all(s.tracks[name] is track for name, track in tracks.items())
    assert s.tracks["mail"].samples[-1].host == "b"
