"""Which manager a master reports to when none is named: the manager's default address on
this machine, unless the manager there works on another broker (master/cli.py)."""

from __future__ import annotations

import json
import logging

import pytest

from qcluster.cluster_identity import WrongBroker
from qcluster.config import Settings, load_settings
from qcluster.master.cli import _checked_manager
from qcluster.messages import ClusterClaim
from tests.json_server import serving


def settings(manager_url: str | None = None) -> Settings:
    return load_settings(None).model_copy(update={"manager_url": manager_url})


MINE = ClusterClaim(id="a1" * 8, broker="redis://prod:6379/0")
THEIRS = {"cluster": {"id": "b2" * 8, "broker": "embedded:///home/me/.qcluster"}}


def test_the_default_manager_on_another_broker_is_not_this_masters(
        caplog: pytest.LogCaptureFixture) -> None:
    """A local demo's manager on the default port beside a master of --broker PROD: with
    the default URL the master reports to no manager and says so (it does not refuse to
    start: the user named no manager); named, that manager is refused as before."""
    with serving(json.dumps(THEIRS).encode()) as url:
        with caplog.at_level(logging.WARNING, logger="qcluster.master"):
            assert _checked_manager(url, settings(), MINE, "web-1") is None
        assert "they are different brokers" in caplog.text
        assert "this master reports to no manager (--manager names one)" in caplog.text
        with pytest.raises(WrongBroker):
            _checked_manager(url, settings(url), MINE, "web-1")


def test_a_manager_on_the_same_broker_or_not_answering_is_reported_to() -> None:
    same = {"cluster": MINE.model_dump()}
    with serving(json.dumps(same).encode()) as url:
        assert _checked_manager(url, settings(), MINE, "web-1") == url
    assert _checked_manager("http://127.0.0.1:1", settings(), MINE, "web-1") == \
        "http://127.0.0.1:1"
