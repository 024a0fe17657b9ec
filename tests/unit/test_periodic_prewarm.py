"""A periodic job that only the masters' app declares (the manager cannot import the app)
still gets its queue's slot before each tick: the manager learns the declaration from the
masters' reports (manager/planning/learned_periodic.py) and the round passes the seconds to its
next tick to the planner. No broker server, no thread: time is the test's clock."""

from __future__ import annotations

from typing import cast

import pytest

from qcluster.broker.base import Broker
from qcluster.manager.planning.learned_periodic import LearnedPeriodic
from qcluster.manager.planning.plan import PREWARM_S
from qcluster.manager.service import ManagerService
from qcluster.periodic import periodic_spec
from tests.unit.test_manager_service import Clock, FakeBroker
from tests.unit.test_manager_state import make_policy, state
from tests.unit.test_manager_state import report as host_report

EVERY_S = 600.0
#: No job ever comes to ``reports`` but the periodic one's: no warm slot (idle_s 0), no
#: slot at all unless a tick is near.
QUEUES = {"reports": make_policy(idle_s=0), "mail": make_policy(idle_s=0)}
#: The manager's own periodic job, on another queue, an hour apart.
OWN_JOB = '[periodic.hourly]\nqueue = "mail"\nevery = 3600\n'


@pytest.mark.parametrize("own", ["", OWN_JOB], ids=["no own job", "own job elsewhere"])
def test_a_queue_fed_only_by_a_learned_periodic_job_is_warm_before_its_tick(own: str) -> None:
    clock = Clock()
    manager = ManagerService(state(toml=own), cast(Broker, FakeBroker()), "s3cret",
                             clock=clock)
    manager.learned = LearnedPeriodic(manager, manager.state.settings)
    assert (manager.periodic is None) == (not own)
    clock.now = 10 * EVERY_S + 100.0  # 500 s before the learned job's next tick
    manager.receive(host_report("a", {}, queues=QUEUES))
    manager.learned.learn("a", {"nightly": periodic_spec(
        "nightly", {"queue": "reports", "every": EVERY_S}, where="@app.periodic")})
    manager.round()
    assert manager.state.slot_map.get("a", {}).get("reports", 0) == 0
    clock.now = 11 * EVERY_S - PREWARM_S + 1  # the tick is due within PREWARM_S
    manager.receive(host_report("a", {}, queues=QUEUES))
    manager.round()
    assert manager.state.slot_map["a"]["reports"] == 1
    assert manager.periodic is not None
    manager.periodic.stop()
