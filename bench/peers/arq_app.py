"""arq, tuned for throughput: no result kept, up to 100 jobs at once, 10 ms polling."""

from __future__ import annotations

import os
from typing import Any

from arq.connections import RedisSettings

QUEUE = os.environ.get("QB_QUEUE", "bench")
URL = os.environ.get("QB_BROKER", "redis://127.0.0.1:6379/9")


async def noop(ctx: dict[str, Any], n: int | None = None) -> None:
    """Does nothing: what is measured is the framework and the broker."""


class WorkerSettings:
    functions = [noop]
    redis_settings = RedisSettings.from_dsn(URL)
    queue_name = QUEUE
    burst = True
    keep_result = 0
    max_jobs = 100
    poll_delay = 0.01
    log_results = False


#: arq logs every job at INFO; quiet, as a tuned deployment runs it
QUIET_LOGS = {"version": 1, "disable_existing_loggers": False,
              "loggers": {"arq": {"level": "WARNING"}}}
