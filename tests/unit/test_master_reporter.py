"""What the master's reporter logs while the manager does not take its reports: the outage
is logged once, but a manager that comes back and refuses the reports (a token it does not
take, another broker) is a new reason, logged with its hint; the same reason is not
repeated at every report."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import httpx
import pytest

from qcluster import App, Job
from qcluster.config import load_settings
from qcluster.master.reporter import Reporter
from qcluster.master.supervisor import Supervisor

app = App("reporter-test")


@app.queue("mail")
def mail(jobs: list[Job]) -> None:
    """Never run: nothing is forked here."""


def _never_called(*_args: object) -> None:
    raise AssertionError("no slot runs in this test")


@pytest.fixture
def reporter() -> Iterator[Reporter]:
    sup = Supervisor(app, load_settings(None), host_name="host-a", fixed_row={"mail": 1},
                     run_slot=_never_called)
    yield Reporter(sup, "http://manager.test:7300", 2.0, token=None)


Answer = Callable[[httpx.Request], httpx.Response]


def refused(reason: str) -> Answer:
    def answer(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(reason, request=request)
    return answer


def status(code: int, detail: str) -> Answer:
    return lambda request: httpx.Response(code, json={"detail": detail})


def report_through(reporter: Reporter, answers: list[Answer]) -> None:
    for answer in answers:
        with httpx.Client(transport=httpx.MockTransport(answer)) as client:
            reporter.report_once(client)


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "qcluster.master.reporter"]


def test_a_manager_back_with_a_token_the_master_lacks_is_logged_with_the_hint(
    reporter: Reporter, caplog: pytest.LogCaptureFixture,
) -> None:
    """The manager restarted with a token: its first answer after the outage is a 401.
    Before, the outage's 'Connection refused' stayed the last line and the 401 (with its
    hint) was never logged: the master looked as if it waited for a manager that was up."""
    caplog.set_level(logging.INFO, logger="qcluster.master.reporter")
    report_through(reporter, [refused("[Errno 111] Connection refused")] * 3)
    assert len(lines(caplog)) == 1 and "Connection refused" in lines(caplog)[0]
    report_through(reporter, [status(401, "a valid token is required")] * 3)
    logged = lines(caplog)
    assert len(logged) == 2, logged  # once per reason, not once per report
    assert "refused the report (401 Unauthorized)" in logged[1]
    assert "set token / QCLUSTER_TOKEN" in logged[1] and "\n" not in logged[1]


def test_a_manager_back_on_another_broker_is_logged_with_its_refusal(
    reporter: Reporter, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="qcluster.master.reporter")
    report_through(reporter, [refused("[Errno 111] Connection refused"),
                              status(409, "the manager works on another broker"),
                              status(409, "the manager works on another broker")])
    logged = lines(caplog)
    assert len(logged) == 2, logged
    assert "REFUSED: the manager works on another broker" in logged[1]


def test_the_same_outage_is_logged_once(
    reporter: Reporter, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="qcluster.master.reporter")
    report_through(reporter, [refused("[Errno 111] Connection refused"),
                              refused("[Errno 111] Connection refused"),
                              status(401, "a valid token is required"),
                              status(401, "a valid token is required")])
    assert len(lines(caplog)) == 2


def test_leaving_tells_the_manager_once_and_no_report_follows(reporter: Reporter,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              ) -> None:
    """A clean stop says so (the manager then forgets the host instead of showing it DEAD);
    a report the reporter thread sends after that would bring the host back."""
    posted: list[tuple[str, str | None]] = []

    def post(url: str, **kwargs: object) -> httpx.Response:
        headers = kwargs.get("headers") or {}
        assert isinstance(headers, dict)
        posted.append((url, headers.get("Authorization")))
        return httpx.Response(200, json={"left": True},
                              request=httpx.Request("POST", url))

    monkeypatch.setattr(httpx, "post", post)
    reporter.headers["Authorization"] = "Bearer the-token"
    reporter.leave()
    assert posted == [("http://manager.test:7300/api/v1/hosts/host-a/leave", "Bearer the-token")]
    sent: list[httpx.Request] = []
    report_through(reporter, [lambda request: sent.append(request) or httpx.Response(500)])
    assert sent == []
