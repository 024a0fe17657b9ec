"""Issue 15, defect 1, on real ``qcluster manager`` / ``qcluster master`` processes: what
is refused at start (one line, no traceback), the Host check whatever the loopback form of
``--listen``, and reports that need the token."""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import QCLUSTER, ROOT, free_port, qcluster_env, wait_until
from tests.e2e.cluster import Procs, try_json

TOKEN = "e2e-1d3f5b7a9c2e4f6a8b0c"
APP = "tests.apps.master_apps"


def refused(*args: str, **env: str) -> str:
    """Run a role that must refuse to start; its stderr."""
    environment = qcluster_env()
    environment.pop("QCLUSTER_TOKEN", None)
    environment.update(env)
    done = subprocess.run([*QCLUSTER, *args], cwd=ROOT, env=environment, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    return " ".join(done.stderr.split())  # one line, however the terminal wraps it


@pytest.mark.parametrize(("listen", "token", "says"), [
    ("0.0.0.0:{port}", None, "without a token"),
    ("[::]:{port}", None, "without a token"),
    ("127.0.0.1:{port}", "change-me", "well-known"),
    ("0.0.0.0:{port}", "change-me", "well-known"),
    ("0.0.0.0:{port}", "secret", "well-known"),
    ("0.0.0.0:{port}", "short-one", "shorter than 16"),
    ("127.0.0.1", TOKEN, "--listen"),
    ("host:port", TOKEN, "--listen"),
    ("::1:{port}", TOKEN, "--listen"),
])
def test_manager_refuses_to_start(listen: str, token: str | None, says: str) -> None:
    env = {"QCLUSTER_TOKEN": token} if token is not None else {}
    stderr = refused("manager", "--listen", listen.format(port=free_port()), **env)
    assert says in stderr


@pytest.mark.parametrize("interval", ["nan", "inf", "1e12", "0", "-1"])
def test_manager_refuses_a_bad_interval(interval: str) -> None:
    """``--interval`` is the masters' report interval too: a NaN made every reply a 500."""
    stderr = refused("manager", "--listen", str(free_port()), "--interval", interval)
    assert "interval_s" in stderr


def test_master_refuses_a_host_name_the_manager_would_refuse() -> None:
    stderr = refused("master", "--app", APP, "--host-name", "my host", "--manager",
                     "http://127.0.0.1:9", "--listen", str(free_port()))
    assert "--host-name" in stderr


def test_master_refuses_a_public_listen_without_a_token() -> None:
    stderr = refused("master", "--app", APP, "--slots", "x-work=1",
                     "--listen", f"0.0.0.0:{free_port()}")
    assert "without a token" in stderr


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    running = Procs(tmp_path, {"QC_TEST_PREFIX": f"s{uuid.uuid4().hex[:8]}",
                               "QC_TEST_LOG_DIR": str(tmp_path),
                               "QCLUSTER_METRICS_DIR": str(tmp_path / "metrics")})
    yield running
    running.stop_all()


def test_listen_port_alone_binds_loopback_with_the_host_check(
    procs: Procs, redis_url: str
) -> None:
    port = free_port()
    procs.env["QCLUSTER_TOKEN"] = TOKEN
    procs.start("manager", "manager", "--broker", redis_url, "--listen", str(port))
    wait_until(lambda: try_json(port, "/healthz"), timeout_s=60, message="manager up")
    base = f"http://127.0.0.1:{port}"
    assert httpx.get(base + "/api/v1/cluster", headers={"Host": "evil.example"}).status_code == 400
    assert httpx.get(base + "/api/v1/cluster", headers={"Host": f"[::1]:{port}"}).status_code == 200


def test_a_master_without_the_token_is_not_heard(procs: Procs, redis_url: str) -> None:
    """The manager has a token: a report without it gets 401 and the master says why; the
    same master with the token is alive at once."""
    port = free_port()
    procs.env["QCLUSTER_TOKEN"] = TOKEN
    procs.start("manager", "manager", "--broker", redis_url, "--listen", f"127.0.0.1:{port}",
                "--interval", "0.5")
    wait_until(lambda: try_json(port, "/healthz"), timeout_s=60, message="manager up")
    prefix = procs.env["QC_TEST_PREFIX"]
    master_port = free_port()
    procs.env.pop("QCLUSTER_TOKEN")
    procs.start("master-anon", "master", "--app", APP, "--broker", redis_url,
                "--manager", f"http://127.0.0.1:{port}", "--host-name", "anon",
                "--listen", f"127.0.0.1:{master_port}")
    wait_until(lambda: "token" in procs.log("master-anon"), timeout_s=60,
               message="the master says the manager wants its token")
    assert "anon" not in {h["name"] for h in try_json(port, "/api/v1/cluster")["hosts"]}
    master = httpx.get(f"http://127.0.0.1:{master_port}/healthz")
    assert master.status_code == 200 and prefix  # the master itself keeps running
    assert httpx.post(f"http://127.0.0.1:{master_port}/api/v1/slots").status_code == 405
    assert httpx.get(f"http://127.0.0.1:{master_port}/api/v1/slots",
                     headers={"Host": "evil.example"}).status_code == 400


def start_manager(procs: Procs, redis_url: str) -> int:
    """A manager with the token, planning every half second; its port once it answers."""
    port = free_port()
    procs.env["QCLUSTER_TOKEN"] = TOKEN
    procs.start("manager", "manager", "--broker", redis_url, "--listen", f"127.0.0.1:{port}",
                "--interval", "0.5")
    wait_until(lambda: try_json(port, "/healthz"), timeout_s=60, message="manager up")
    return port


def start_master(procs: Procs, redis_url: str, port: int, name: str, *,
                 host: str) -> subprocess.Popen[bytes]:
    """``master-NAME`` reporting to the manager on ``port`` as ``host``, with a metrics
    directory of its own (masters of one machine here)."""
    procs.env["QCLUSTER_METRICS_DIR"] = str(procs.workdir / f"metrics-{name}")
    return procs.start(f"master-{name}", "master", "--app", APP, "--broker", redis_url,
                       "--manager", f"http://127.0.0.1:{port}", "--host-name", host,
                       "--listen", f"127.0.0.1:{free_port()}")


def test_a_master_stopped_cleanly_leaves_and_a_killed_one_stays_dead(
    procs: Procs, redis_url: str,
) -> None:
    """A host retired on purpose stayed DEAD (qcluster_host_up 0, the critical
    QclusterHostNotReporting alert) for as long as the manager ran; now a SIGTERM-stopped
    master leaves at once, and only a master that died without a clean stop is DEAD."""
    port = start_manager(procs, redis_url)
    masters = {name: start_master(procs, redis_url, port, name, host=name)
               for name in ("kept", "stopped", "killed")}

    def hosts() -> dict[str, bool]:
        view = try_json(port, "/api/v1/cluster") or {"hosts": []}
        return {h["name"]: h["alive"] for h in view["hosts"]}

    wait_until(lambda: hosts() == {"kept": True, "stopped": True, "killed": True},
               timeout_s=90, message="three hosts reporting")
    masters["stopped"].terminate()
    masters["killed"].kill()
    assert masters["stopped"].wait(60) == 0
    wait_until(lambda: hosts() == {"kept": True, "killed": False}, timeout_s=60,
               message="the stopped host gone, the killed one dead")
    assert "host stopped left: its master stopped" in procs.log("manager")
    wait_until(lambda: "host killed stopped reporting" in procs.log("manager"), timeout_s=30,
               message="the manager logs the killed host's silence")


def test_two_masters_under_one_host_name_are_told_apart(procs: Procs, redis_url: str) -> None:
    """Two machines with one hostname (or a copied unit without --host-name) each reported
    as the same host, and the manager planned it from their alternating reports without a
    word. Now the newer master holds the name, the other's reports are refused naming
    both (the manager's log and the refused master's), and once the holder stops the
    other is heard again."""
    port = start_manager(procs, redis_url)
    masters = {}
    for name in ("first", "second"):
        masters[name] = start_master(procs, redis_url, port, name, host="twin")
        wait_until(lambda: "twin" in {h["name"] for h in (try_json(port, "/api/v1/cluster")
                                                          or {"hosts": []})["hosts"]},
                   timeout_s=60, message="host twin reporting")
    said = "host name 'twin' is reported by two masters"
    wait_until(lambda: said in procs.log("master-first"), timeout_s=30,
               message="the replaced master told why its reports are refused")
    assert said in procs.log("manager") and "--host-name" in procs.log("manager")
    assert procs.log("manager").count(said) == 1  # once, not every report
    assert said not in procs.log("master-second")
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    assert 'qcluster_reports_refused{host="twin",reason="two_masters"} 1.0' in metrics
    (refusal,) = try_json(port, "/api/v1/cluster")["refused_reports"]
    assert refusal["host"] == "twin" and refusal["reason"] == "two_masters"
    assert said in refusal["detail"]
    page = httpx.get(f"http://127.0.0.1:{port}/").text
    assert '<li data-refused="twin" data-reason="two_masters">' in page
    time.sleep(2.0)  # four report intervals: the first stays refused while the second reports
    assert "reachable again" not in procs.log("master-first")
    masters["second"].terminate()
    assert masters["second"].wait(60) == 0
    wait_until(lambda: "reachable again" in procs.log("master-first"), timeout_s=30,
               message="the first master heard again once the second left")
