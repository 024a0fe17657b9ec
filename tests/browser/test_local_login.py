"""Local controls without friction: a manager on loopback started with no token writes a local
token, ``qcluster pause`` uses it, and ``qcluster login``'s one-time link signs Chromium in so
the page's buttons work. Real processes on the embedded broker, in a directory of their own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, expect

from tests.brokers import free_port
from tests.conftest import QCLUSTER, qcluster_env, wait_until

APP = ("import qcluster\napp = qcluster.App('shop')\n\n"
       "@app.queue('emails')\ndef emails(jobs):\n    pass\n")


def _env() -> dict[str, str]:
    return {k: v for k, v in qcluster_env().items() if not k.startswith("QCLUSTER_")}


def run(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*QCLUSTER, *args], cwd=directory, env=_env(), capture_output=True,
                          text=True, timeout=60)


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """One manager and master for the module's tests: each test leaves no pause behind."""
    tmp_path = tmp_path_factory.mktemp("local")
    (tmp_path / "shop_app.py").write_text(APP)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs = []
    for name, args in (("manager", ["manager", "--listen", f"127.0.0.1:{port}"]),
                       ("master", ["master", "--app", "shop_app", "--no-metrics", "--manager",
                                   url, "--host-name", "h1", "--listen", str(free_port())])):
        with (tmp_path / f"{name}.log").open("wb") as log:
            procs.append(subprocess.Popen([*QCLUSTER, *args], cwd=tmp_path, env=_env(),
                                          stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))

    def emails_known() -> bool:
        try:
            view = httpx.get(f"{url}/api/v1/cluster", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return False
        return any(q["name"] == "emails" for q in view["queues"])

    try:
        wait_until(emails_known, timeout_s=90, message="the master's queue at the manager")
        yield tmp_path, url
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(procs):
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_pause_works_with_no_token_configured(local_cluster: tuple[Path, str]) -> None:
    directory, url = local_cluster
    token_file = directory / ".qcluster" / "token"
    assert token_file.stat().st_mode & 0o777 == 0o600
    paused = run(directory, "pause", "emails", "--manager", url)
    assert paused.returncode == 0, paused.stderr
    assert "queue emails paused by local" in paused.stdout
    resumed = run(directory, "resume", "emails", "--manager", url)
    assert resumed.returncode == 0, resumed.stderr
    # masters still report without any token (the fixture waited for the master's queue to
    # reach the manager through its reports): the local token is for controls only
    log = (directory / "master.log").read_text()
    assert "401" not in log and "unreachable" not in log


def test_the_one_time_login_makes_the_buttons_work(page: Page,
                                                   local_cluster: tuple[Path, str]) -> None:
    directory, url = local_cluster
    link = login_link(directory, url)
    page.goto(link)
    expect(page.locator("#actions input[name=token]")).to_have_attribute("placeholder",
                                                                          "signed in")
    assert page.url == f"{url}/"
    assert page.context.cookies() == []  # no cookie: every port of the host would get it
    session = page.evaluate("window.localStorage.getItem('qcluster_session')")
    assert session and token_not_in(session, directory)
    assert session not in httpx.get(url, timeout=10).text  # the page anyone may read
    page.locator('tr[data-queue="emails"] button[data-action="pause"]').click()
    expect(page.locator("#action-done")).to_have_text("Queue emails paused.")
    assert controls(directory, url) == [("pause", "emails", "local")]
    page.locator('tr[data-queue="emails"] button[data-action="resume"]').first.click()
    expect(page.locator("#action-done")).to_have_text("Queue emails resumed.")
    page.goto(f"{url}/queues/emails")  # another page's form (its token field is required)
    page.locator("#dead-letter button[type=submit]").click()
    expect(page.locator("#requeued")).to_have_text("Requeued 0 dead job(s).")
    # the link is spent; a session is for the page's forms from its own origin, never the API
    assert httpx.get(link, timeout=10).status_code == 401
    forged = httpx.post(f"{url}/queues/emails/pause", timeout=10,
                        data={"token": "", "session": session},
                        headers={"Origin": "http://127.0.0.1:1"})
    assert forged.status_code == 401
    assert httpx.post(f"{url}/api/v1/login", timeout=10,
                      data={"session": session}).status_code == 401
    assert controls(directory, url) == []


def test_what_another_port_of_the_host_receives_authorises_nothing(
        page: Page, local_cluster: tuple[Path, str]) -> None:
    """Another web server on this host (another user's, on another port) that the signed-in
    browser visits gets nothing that changes state when replayed, nor a new login."""
    directory, url = local_cluster
    page.goto(login_link(directory, url))
    expect(page.locator("#actions input[name=token]")).to_have_attribute("placeholder",
                                                                          "signed in")
    with recording_server() as (foreign, received):
        page.goto(f"{foreign}/")
        expect(page.locator("body")).to_have_text("hello")
    assert received, "the browser visited the other port"
    for sent in received:
        kept = {k: v for k, v in sent.items() if k.lower() not in ("host", "content-length")}
        for origin in (None, url):
            headers = {**kept, **({"Origin": origin} if origin else {})}
            for path in ("/queues/emails/pause", "/queues/emails/requeue"):
                replayed = httpx.post(f"{url}{path}", timeout=10, data={"token": ""},
                                      headers=headers)
                assert replayed.status_code == 401, (path, replayed.status_code)
            assert httpx.post(f"{url}/api/v1/login", timeout=10,
                              headers=headers).status_code == 401
    assert controls(directory, url) == []
    # the browser itself is still signed in
    page.goto(url)
    page.locator('tr[data-queue="emails"] button[data-action="pause"]').click()
    expect(page.locator("#action-done")).to_have_text("Queue emails paused.")
    page.locator('tr[data-queue="emails"] button[data-action="resume"]').first.click()
    expect(page.locator("#action-done")).to_have_text("Queue emails resumed.")


def login_link(directory: Path, url: str) -> str:
    login = run(directory, "login", "--manager", url)
    assert login.returncode == 0, login.stderr
    link = login.stdout.strip()
    assert link.startswith(f"{url}/login?code=")
    return link


def controls(directory: Path, url: str) -> list[tuple[str, str, str]]:
    shown = json.loads(run(directory, "controls", "--manager", url, "--json").stdout)
    return [(c["kind"], c["name"], c["by"]) for c in shown]


@contextmanager
def recording_server() -> Iterator[tuple[str, list[dict[str, str]]]]:
    """A web server on another port of 127.0.0.1 that keeps the headers of each request."""
    received: list[dict[str, str]] = []

    class Recorder(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            received.append(dict(self.headers.items()))
            body = b"hello"
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


def token_not_in(value: str, directory: Path) -> bool:
    return (directory / ".qcluster" / "token").read_text().strip() not in value
