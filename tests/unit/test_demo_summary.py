"""The demo's progress line reads the manager's /api/v1/cluster: whatever answers on that
port, the line is printed (the demo then names the child that could not start)."""

from __future__ import annotations

import pytest

from qcluster.demo.launcher import _summary
from tests.json_server import serving


@pytest.mark.parametrize("body", [b"{}", b'{"queues": 3}', b'{"queues": [{"name": "q"}]}',
                                  b"[]"])
def test_another_service_on_the_managers_port_reads_as_a_manager_starting(body: bytes) -> None:
    with serving(body) as url:
        assert _summary(url) == "manager starting..."


def test_the_managers_view_reads_as_slots_backlog_and_hosts() -> None:
    view = (b'{"queues": [{"name": "resize", "slots_current": 2, "slots_planned": 4, '
            b'"backlog": 120, "load": 0.5}], "hosts": [{"alive": true}, {"alive": false}]}')
    with serving(view) as url:
        assert _summary(url) == "resize 2/4 slots, backlog 120, load 50% | hosts 1"
