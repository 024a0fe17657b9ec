"""Every message that crosses a process boundary, defined once.

* slot <-> master: the per-slot control channel (a SOCK_SEQPACKET socketpair, one
  JSON message per packet), tagged by ``kind``;
* master <-> manager: the host report and the manager's reply (its row of the slot map).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter

from qcluster.periodic import PeriodicSpec
from qcluster.policy import QUEUE_NAME_PATTERN, QueuePolicy

#: 2: a master answers job lookups (HostReport.searched and held, Assignment.find_jobs);
#: a manager asks only the masters that report 2 or more.
SCHEMA_VERSION = 2
FINDS_JOBS_SINCE = 2

# Bounds on what crosses a process boundary: a report comes over the network, and one
# NaN, negative or astronomically large figure must be refused (422), not planned with.
MAX_COUNT = 1 << 53
"""Largest job/batch count (exact in a float)."""
MAX_SECONDS = 1e9
"""Largest duration summed in a report (~31 years)."""
MAX_BYTES = 1 << 60
MAX_SLOTS = 100_000
MAX_QUEUES = 1_000
"""Queues in one host report."""
MAX_REPORT_INTERVAL_S = 60.0
"""A master reports at least this often, so a host that stops reporting expires."""

Name = Annotated[str, StringConstraints(pattern=QUEUE_NAME_PATTERN)]
"""A queue or host name: the queue-name rule (1-128 of letters, digits, _ . : -)."""
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS)]
Bytes = Annotated[int, Field(ge=0, le=MAX_BYTES)]
Timestamp = Annotated[float, Field(ge=0, le=1e11)]
"""Unix or monotonic seconds."""
Load = Annotated[float, Field(ge=0, le=1e6)]


class _Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


# --- slot -> master -------------------------------------------------------------


class SlotHello(_Msg):
    kind: Literal["hello"] = "hello"
    slot_no: int
    pid: int
    queue: str


class Heartbeat(_Msg):
    kind: Literal["heartbeat"] = "heartbeat"
    queue: str
    idle: bool
    """True when the last take found nothing ready."""


class Progress:
    """A held job's state, one byte each in its slot's shared
    :class:`~qcluster.channel.TakeProgress`: not handed to the handler yet, running, done
    (to ack), ran with a retry or error outcome, failed by the handler."""

    UNSTARTED, RUNNING, DONE, RAN, FAILED = 0, 1, 2, 3, 4


class BatchStarted(_Msg):
    kind: Literal["batch_started"] = "batch_started"
    queue: str
    size: int
    deadline_mono: float
    """time.monotonic() (system-wide on Linux) after which the master kills the slot."""


class BatchCounters(_Msg):
    """What one or more batches did; summed by the master per queue."""

    done: Count = 0
    retried: Count = 0
    failed: Count = 0
    """Dead-lettered by the handler, by max_attempts, or as malformed."""
    malformed: Count = 0
    batches: Count = 0
    busy_s: Seconds = 0.0
    """Seconds spent in the handler."""
    batch_s: Seconds = 0.0
    """Seconds spent in batches, each up to its handler's return from the previous
    batch's (the slot went straight on: the round trip that settled that batch and took
    this one, decoding, the master's messages) or, after a take that may have waited for
    jobs (its oldest job came after the last batch ended), from the take's return. So
    ``batch_s - busy_s`` is what batches cost the slot beyond their handler, and no time
    the slot waited for jobs is in it. 0 from a slot older than the field."""

    def __add__(self, other: BatchCounters) -> BatchCounters:
        return BatchCounters(
            done=self.done + other.done,
            retried=self.retried + other.retried,
            failed=self.failed + other.failed,
            malformed=self.malformed + other.malformed,
            batches=self.batches + other.batches,
            busy_s=self.busy_s + other.busy_s,
            batch_s=self.batch_s + other.batch_s,
        )

    @property
    def processed(self) -> int:
        return self.done + self.retried + self.failed


class BatchDone(_Msg):
    kind: Literal["batch_done"] = "batch_done"
    queue: str
    counters: BatchCounters


class Recycling(_Msg):
    kind: Literal["recycling"] = "recycling"
    private_dirty_bytes: int
    limit_bytes: int


class GaveBack(_Msg):
    """The slot settled (or failed to settle) the master's GiveBack ``ref``: until this
    comes, the master keeps it, and hands it to another slot if this one dies first."""

    kind: Literal["gave_back"] = "gave_back"
    ref: int


class SlotRefused(_Msg):
    """The broker refused what the slot's queue needs, for good: the slot exits with
    exitcodes.BROKER_REFUSED and the master marks the queue fatal with ``reason``."""

    kind: Literal["refused"] = "refused"
    reason: Annotated[str, Field(max_length=1000)]


SlotToMaster = Annotated[
    SlotHello | Heartbeat | BatchStarted | BatchDone | Recycling | GaveBack | SlotRefused,
    Field(discriminator="kind"),
]
SLOT_TO_MASTER: TypeAdapter[SlotToMaster] = TypeAdapter(SlotToMaster)


# --- master -> slot -------------------------------------------------------------


class SwitchQueue(_Msg):
    kind: Literal["switch"] = "switch"
    queue: str


class StopSlot(_Msg):
    kind: Literal["stop"] = "stop"


class GiveBack(_Msg):
    """Settle the jobs a slot of this master held when it died, as its shared
    :class:`~qcluster.channel.TakeProgress` says (sent to any live slot, which has a
    broker connection; the master has none): each job by its state."""

    kind: Literal["give_back"] = "give_back"
    queue: str
    receipt: int
    jobs: list[tuple[str, int, float, int]]
    """(id, attempts, activate_at, TakeProgress state)."""
    ref: int = 0
    """The master's number for this part, echoed in :class:`GaveBack`."""
    slot: str = ""
    """The dead slot's number (its jobs' last error names it)."""
    died: str = ""
    """How it died, for its running job's last error ('' from an older master)."""


MasterToSlot = Annotated[SwitchQueue | StopSlot | GiveBack, Field(discriminator="kind")]
MASTER_TO_SLOT: TypeAdapter[MasterToSlot] = TypeAdapter(MasterToSlot)


# --- master <-> manager ---------------------------------------------------------


class HostFacts(_Msg):
    cpus: Annotated[float, Field(ge=0, le=MAX_SLOTS)]
    """CPUs usable here (cgroup cpu.max taken into account)."""
    loadavg: tuple[Load, Load, Load]
    mem_total_bytes: Bytes
    mem_available_bytes: Bytes
    pss_total_bytes: Bytes
    """PSS of the master and all its slots."""
    avg_slot_pss_bytes: Bytes


SlotState = Literal["starting", "idle", "busy", "stopping"]
"""A slot's state (master/slots.py moves it); a queue waiting on its restart backoff has no
slot to show."""


class SlotInfo(_Msg):
    slot_no: Annotated[int, Field(ge=0, le=MAX_SLOTS)]
    pid: Annotated[int, Field(ge=0, le=1 << 32)]
    queue: Name
    state: SlotState
    started_at: Timestamp
    """Wall-clock unix seconds."""
    jobs_done: Count = 0
    pss_bytes: Bytes = 0
    private_dirty_bytes: Bytes = 0
    take: int | None = None
    """The lock token of the jobs the slot holds now (Redis: their lock's expiry, ms),
    which a lookup matches to say where a running job runs; None: none, or not followed."""


#: The most job ids one report reply asks the masters about (see Assignment.find_jobs).
MAX_FIND_JOBS = 64
JobId = Annotated[str, StringConstraints(min_length=1, max_length=200)]


class HeldJob(_Msg):
    """A job a slot holds now (its take's shared TakeProgress), as its master answers a
    lookup the broker cannot answer (RabbitMQ cannot search its queues or see who holds
    an unacked message)."""

    id: JobId
    queue: Name
    attempts: Annotated[int, Field(ge=0, le=1 << 31)]
    taken_at: Timestamp
    """Wall-clock unix seconds of the take that holds it."""
    started: bool
    """Handed to the handler (False: taken, waiting its turn in the batch)."""
    slot_no: Annotated[int, Field(ge=-1, le=MAX_SLOTS)] = -1
    """The slot holding it (-1 until its master names it)."""


class QueueCounters(_Msg):
    """One queue on one host since the previous report."""

    counters: BatchCounters = BatchCounters()
    alive_s: Seconds = 0.0
    """Sum over this queue's slots of the seconds they existed in the interval."""


ReloadState = Literal["idle", "loading", "rolling", "failed"]
"""A master's code reload: none under way (idle), the new app importing in a fresh
template (loading), slots being replaced a few at a time (rolling), or the last reload
refused (failed: the old slots keep serving; ``error`` says why)."""
ShortText = Annotated[str, StringConstraints(max_length=2000)]


class CodeInfo(_Msg):
    """Which code a master's slots run, and its reloads (SIGHUP or the manager's request)."""

    version: Annotated[str, StringConstraints(max_length=128)] = ""
    """The app's ``App(version=...)`` when given, else a short hash of the app's files."""
    generation: Count = 0
    """0: the code the master started with; +1 at every reload that took."""
    state: ReloadState = "idle"
    error: ShortText = ""
    """Why the last reload was refused (its import error, or its first slot's boot error);
    empty when the last reload took."""
    reload_id: Annotated[str, StringConstraints(max_length=64)] = ""
    """The last manager reload request (Assignment.reload_id) this master acted on."""
    old_slots: Annotated[int, Field(ge=0, le=MAX_SLOTS)] = 0
    """Slots still running an older generation (0 once a rolling reload is done)."""


class ClusterClaim(_Msg):
    """Which broker a process works on: the cluster identity stored in it (written once by
    the first manager or master, qcluster.cluster_identity) and its masked URL to name it."""

    id: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{8,64}$")]
    broker: Annotated[str, StringConstraints(max_length=1000)]


class HostReport(_Msg):
    """Every field bounded and finite: the manager plans with these numbers."""

    schema_version: Annotated[int, Field(ge=1, le=1000)] = SCHEMA_VERSION
    host: Name
    sent_at: Timestamp
    """Master wall-clock unix seconds."""
    interval_s: Annotated[float, Field(gt=0, le=MAX_REPORT_INTERVAL_S)]
    """Seconds to the next report; bounded so a host that stops reporting expires."""
    facts: HostFacts
    capacity_slots: Annotated[int, Field(ge=0, le=MAX_SLOTS)]
    queues: Annotated[dict[Name, QueuePolicy], Field(max_length=MAX_QUEUES)]
    """Queues this host can serve, with their policies as declared in code."""
    slots: Annotated[list[SlotInfo], Field(max_length=MAX_SLOTS)]
    counters: Annotated[dict[Name, QueueCounters], Field(max_length=MAX_QUEUES)]
    generation: Count = 0
    """Generation of the row the master is applying (0: none received yet)."""
    code: CodeInfo = CodeInfo()
    """The code the slots run and the state of its reload."""
    cluster: ClusterClaim | None = None
    """The broker the master works on (None: not read yet); the manager refuses a report
    from another broker than its own (409)."""
    periodic: Annotated[dict[Name, PeriodicSpec], Field(max_length=MAX_QUEUES)] = {}
    """The app's ``@app.periodic`` declarations: the manager runs them without importing
    the app (manager/planning/learned_periodic.py)."""
    fatal: Annotated[dict[Name, Annotated[str, Field(max_length=2000)]],
                     Field(max_length=MAX_QUEUES)] = {}
    """Queues this master no longer forks, with why (boot errors, a broker refusal)."""
    searched: Annotated[list[JobId], Field(max_length=MAX_FIND_JOBS)] = []
    """The ids of the last Assignment.find_jobs, looked for in every slot's take."""
    held: Annotated[list[HeldJob], Field(max_length=MAX_FIND_JOBS)] = []
    """Those of ``searched`` that a slot of this host holds now."""
    master: Annotated[str, Field(max_length=200)] = ""
    """This master process, in words (its PID, machine and start): two masters reporting
    under one host name are told apart and the second is refused (manager/host_owners.py).
    Empty from an older master."""


class Assignment(_Msg):
    """The manager's reply: this host's row of the slot map."""

    schema_version: int = SCHEMA_VERSION
    generation: int
    row: dict[str, int]
    report_interval_s: float = 2.0
    reload_id: str = ""
    """A reload this host should do: the master reloads when the id differs from the last one
    it saw (the first id a master sees after it starts is taken as done, not reloaded)."""
    find_jobs: Annotated[list[JobId], Field(max_length=MAX_FIND_JOBS)] = []
    """Jobs a lookup wants found: the master reports at once which of its slots hold them
    (HostReport.searched and held)."""


# --- manager API views (GET /api/v1/cluster and the admin UI) -------------------


class QueueView(_Msg):
    name: str
    priority: int
    min_slots: int
    max_slots: int
    slots_current: int
    """Slots running for the queue now, over all live hosts."""
    slots_planned: int
    slots_avg: float
    """Average running slots over the planning window (below min when slots restart often)."""
    load: float | None
    """(busy time + estimated backlog time) / slot time over the window; 1.0 = 100%.
    None when undefined: work waits and no slot ran in the window."""
    about_to_resize: bool
    """The load is outside the queue's tolerance band: the next round changes its slots."""
    backlog: int
    locked: int
    delayed: int
    dead: int
    rate_in: float
    """Jobs/s arriving (estimated from backlog change plus processed)."""
    rate_out: float
    """Jobs/s processed."""
    mean_job_seconds: float
    paused: bool = False


class HostView(_Msg):
    name: str
    alive: bool
    capacity_slots: int
    slots: dict[str, int]
    """Running slots per queue (from the host's last report)."""
    planned: dict[str, int]
    """This host's row of the slot map."""
    mem_available_bytes: int
    pss_total_bytes: int
    loadavg: tuple[float, float, float]
    last_report_at: float
    """Wall-clock unix seconds of the last report received."""
    code: CodeInfo = CodeInfo()
    """The code the host's slots run, from its last report."""
    fatal: dict[str, str] = {}
    """Queues the host no longer forks, with why (from its last report)."""


class DecisionView(_Msg):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    at: float
    queue: str
    from_slots: int = Field(alias="from")
    to_slots: int = Field(alias="to")
    reason: str


class UndeclaredQueueView(_Msg):
    """A queue holding jobs that no live host's app declares: they wait until one does."""

    name: str
    ready: int
    delayed: int


#: Why the manager refuses a master's reports (409).
RefusalReason = Literal["two_masters", "another_broker"]


class RefusedReportView(_Msg):
    """Reports under a host name that the manager refuses (409), lately."""

    host: str
    reason: RefusalReason
    detail: str
    """The refusal's one line, naming both masters or both brokers."""
    at: float
    """Wall-clock unix seconds of the last refusal."""


class ClusterView(_Msg):
    generated_at: float
    queues: list[QueueView]
    hosts: list[HostView]
    slot_map: dict[str, dict[str, int]]
    """host -> queue -> planned slots."""
    decisions: list[DecisionView]
    """Newest first."""
    undeclared_queues: list[UndeclaredQueueView] = Field(default_factory=list)
    """Queues with ready or delayed jobs that no live host's app declares (by name)."""
    broker_durability: list[str] = Field(default_factory=list)
    """The broker's durability notes (``Broker.durability()``); empty: nothing to say."""
    refused_reports: list[RefusedReportView] = Field(default_factory=list)
    """Host names whose reports the manager refused within a host's expiry."""


class HistoryPoint(_Msg):
    at: float
    backlog: int
    slots_planned: int
    slots_current: int
    load: float | None
    """As QueueView.load; None when undefined."""
    rate_out: float
