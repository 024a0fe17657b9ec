"""arq running the async benchmark's job: a 10 ms await (``asyncio.sleep``) per job, up to
100 jobs at once, 10 ms polling, no result kept. Registered as ``noop``, the name the
peers' publisher enqueues."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from arq import func
from arq.connections import RedisSettings

QUEUE = os.environ.get("QB_QUEUE", "bench")
URL = os.environ.get("QB_BROKER", "redis://127.0.0.1:6379/9")
MAX_JOBS = int(os.environ.get("QB_CONCURRENCY", "100"))
IO_S = float(os.environ.get("QB_IO_S", "0.01"))


async def wait_for_io(ctx: dict[str, Any], n: int | None = None) -> None:
    await asyncio.sleep(IO_S)


class WorkerSettings:
    functions = [func(wait_for_io, name="noop")]
    redis_settings = RedisSettings.from_dsn(URL)
    queue_name = QUEUE
    burst = True
    keep_result = 0
    max_jobs = MAX_JOBS
    poll_delay = 0.01
    log_results = False
