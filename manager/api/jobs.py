"""Jobs by id and by state: the lookup (``GET /api/v1/jobs/{id}``), a page of a queue's
running, delayed, retrying or dead jobs, and dead letters requeued or deleted by id
(token-guarded, like every change). Each route is one or a few broker round trips: a page
of a million dead letters is one ranged read."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, HTTPException, Path, Query
from pydantic import BaseModel, ConfigDict, Field, model_validator

from qcluster.errors import BrokerError
from qcluster.jobs import MAX_PAGE, JobInfo, JobPage
from qcluster.manager.api.deps import GUARDED, NamePath, ServiceDep
from qcluster.manager.job_reads import JobReadsBusy
from qcluster.manager.service import ManagerService
from qcluster.names import MAX_JOB_ID_CHARS

router = APIRouter(tags=["jobs"])

T = TypeVar("T")
#: A job id in a path: what producers make (32 hex digits) and any id a broker keeps.
JobIdPath = Annotated[str, Path(min_length=1, max_length=MAX_JOB_ID_CHARS)]
#: The most ids one request may name.
MAX_IDS = 10_000


JobIds = Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_JOB_ID_CHARS)]],
                   Field(max_length=MAX_IDS)]


class RequeueIds(BaseModel):
    """``{"ids": [...]}`` or ``{"all": true}``, never both: a misspelt field is refused
    (422), so it cannot fall through to "every dead letter"."""

    model_config = ConfigDict(extra="forbid")
    ids: JobIds | None = None
    all: bool = False

    @model_validator(mode="after")
    def _one_choice(self) -> RequeueIds:
        if (self.ids is not None) == self.all:
            raise ValueError('give either "ids" (a list of job ids) or "all": true')
        return self


class RequiredIds(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ids: JobIds


def on_broker(service: ManagerService, call: Callable[[], T], *, shared: bool = True) -> T:
    """A broker call, under the service's broker lock when ``shared`` (the job reads
    take their own: manager/job_reads.py); 503 when the broker fails, 501 when the
    backend cannot do it, 429 when too many job reads run."""
    try:
        if not shared:
            return call()
        with service.broker_lock:
            return call()
    except JobReadsBusy as exc:
        raise HTTPException(429, str(exc), headers={"Retry-After": "1"}) from None
    except NotImplementedError as exc:
        raise HTTPException(501, str(exc)) from None
    except BrokerError as exc:
        raise HTTPException(503, f"the broker did not answer: {exc}") from None


def known_queues(service: ManagerService) -> list[str]:
    """The queues the apps declare and the broker holds (RabbitMQ cannot list a broker's
    queues: the apps' are the ones looked in)."""
    view = service.cluster_view()
    names = {queue.name for queue in view.queues}
    names |= {queue.name for queue in view.undeclared_queues}
    names |= service.job_reads.queues()
    return sorted(names | set(on_broker(service, service.broker.queues)))


@router.get("/api/v1/jobs/{job_id}")
def job(job_id: JobIdPath, service: ServiceDep) -> JobInfo:
    """Where the job is and since when; 404 when no queue holds it (nor a record of it).
    State ``unknown`` with a note where the backend cannot tell (RabbitMQ)."""
    found = on_broker(service, lambda: service.find_job(job_id), shared=False)
    if found is None:
        raise HTTPException(404, f"no job {job_id} in any queue (finished jobs are "
                                 "remembered for their queue's keep_finished_s only)")
    return found


def placed(service: ManagerService, jobs: list[JobInfo]) -> list[JobInfo]:
    """Running jobs with the host and slot that hold them and since when: each master
    reports the lock token of every slot's current take (SlotInfo.take), and a running
    job's lock carries the same token; the take started one lock_timeout before it."""
    tokens = {job.lock_token for job in jobs if job.lock_token is not None}
    if not tokens:
        return jobs
    with service.lock:
        now = service.clock()
        holders: dict[tuple[str, int | None], tuple[str, str]] = {
            (slot.queue, slot.take): (host, str(slot.slot_no))
            for host, entry in service.state.reporting_hosts(now).items()
            for slot in entry.report.slots if slot.take in tokens}
        policies = service.state.policies(now)
    out = []
    for job in jobs:
        where = holders.get((job.queue or "", job.lock_token))
        policy = policies.get(job.queue or "")
        if job.lock_token is None or where is None:
            out.append(job if job.lock_token is None else job.model_copy(update={
                "note": "no master reports the slot holding it (yet)"}))
            continue
        started = job.lock_token / 1000 - policy.lock_timeout if policy else None
        out.append(job.model_copy(update={"host": where[0], "slot": where[1],
                                          "started_at": started, "since": started}))
    return out


@router.get("/api/v1/queues/{queue}/jobs")
def jobs(queue: NamePath, service: ServiceDep,
         state: Annotated[str, Query(pattern="^(running|delayed|retrying|dead)$")],
         offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
         limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50) -> JobPage:
    """A page of the queue's jobs in ``state``; dead letters newest first (RabbitMQ:
    oldest first, the page's note says so)."""
    return on_broker(service, lambda: service.job_page(queue, state, offset, limit),
                     shared=False)


@router.post("/api/v1/queues/{queue}/dead/requeue", dependencies=GUARDED)
def requeue(queue: NamePath, service: ServiceDep, body: RequeueIds) -> dict[str, Any]:
    """Requeue the dead letters ``ids``, or every one with ``{"all": true}``: ready now,
    attempts reset."""
    ids = None if body.all else body.ids
    return {"requeued": on_broker(service, lambda: service.broker.requeue_dead(queue, ids))}


@router.post("/api/v1/queues/{queue}/dead/delete", dependencies=GUARDED)
def delete(queue: NamePath, service: ServiceDep, body: RequiredIds) -> dict[str, Any]:
    """Delete the dead letters ``ids``."""
    return {"deleted": on_broker(service, lambda: service.broker.delete_dead(queue, body.ids))}
