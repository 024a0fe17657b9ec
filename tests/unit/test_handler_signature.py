"""A handler the slot cannot call as declared is refused at import, in one line naming the
queue and the fix, instead of failing every job until it is dead-lettered: a per-job
handler with a second required argument or none, a batch handler annotated with one
``Job``, a per-job one annotated with a list. The master then names the app's own line."""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qcluster import App, Job
from qcluster.cli_support import load_app_checked
from qcluster.errors import AppImportError, ConfigError


def thumb(job, size):
    pass


def nothing():
    pass


def one_job(job: Job) -> None:
    pass


def many_jobs(jobs: list[Job]) -> None:
    pass


def one_job_text(job: "Job") -> None:  # noqa: UP037 - as `from __future__ import annotations` leaves it
    pass


def many_jobs_text(jobs: "list[Job]") -> None:  # noqa: UP037
    pass


@pytest.mark.parametrize("decorator, handler, says", [
    ("job_queue", thumb, "queue 'q': handler thumb(job, size) cannot be called with one job, "
                         "as @app.job_queue calls it (missing a required argument: 'size'): "
                         "declare it as def thumb(job)"),
    ("job_queue", nothing, "handler nothing() cannot be called with one job"),
    ("queue", nothing, "handler nothing() cannot be called with a list of jobs, as @app.queue "
                       "calls it (too many positional arguments): declare it as def "
                       "nothing(jobs)"),
    ("queue", one_job, "queue 'q': handler one_job takes job: Job, but @app.queue calls it "
                       "with a list of jobs: use @app.job_queue (one job per call)"),
    ("queue", one_job_text, "handler one_job_text takes job: Job, but @app.queue"),
    ("job_queue", many_jobs, "queue 'q': handler many_jobs takes jobs: list[Job], but "
                             "@app.job_queue calls it with one job: use @app.queue (a list "
                             "of jobs per call)"),
    ("job_queue", many_jobs_text, "handler many_jobs_text takes jobs: list[Job]"),
])
def test_a_handler_the_slot_cannot_call_is_refused_at_import(
        decorator: str, handler: Any, says: str) -> None:
    app = App()
    with pytest.raises(ConfigError) as caught:
        getattr(app, decorator)("q")(handler)
    assert says in str(caught.value)
    assert "\n" not in str(caught.value)
    assert not app.queues


class Resizer:
    def __call__(self, job: Job) -> None:
        pass


async def async_one(job: Job) -> None:
    pass


async def async_many(jobs: list[Job]) -> None:
    pass


def with_default(job, size=128):
    pass


def loose(*args: Any, **kwargs: Any) -> None:
    pass


def two(jobs, extra):
    pass


@pytest.mark.parametrize("decorator, handler", [
    ("queue", many_jobs), ("queue", many_jobs_text), ("job_queue", one_job),
    ("job_queue", one_job_text), ("job_queue", Resizer()), ("job_queue", async_one),
    ("queue", async_many), ("job_queue", with_default), ("queue", loose),
    ("job_queue", loose), ("queue", functools.partial(two, extra=1)),
    ("queue", lambda jobs: None), ("job_queue", print),
])
def test_every_handler_the_slot_can_call_is_accepted(decorator: str, handler: Any) -> None:
    app = App()
    getattr(app, decorator)("q")(handler)
    assert "q" in app.queues


@pytest.fixture
def app_dir(tmp_path: Path) -> Iterator[Path]:
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n.startswith("sig_app_")]:
            del sys.modules[name]


@pytest.mark.parametrize(("module", "source", "said"), [
    ("sig_app_a", "@app.job_queue('thumbs')\ndef thumb(job, size):\n    pass\n",
     "ConfigError: queue 'thumbs': handler thumb(job, size) cannot be called with one job"),
    ("sig_app_b", "@app.queue('emails', max_attempt=3)\ndef emails(jobs):\n    pass\n",
     "ConfigError: queue 'emails': max_attempt"),
])
def test_the_master_names_the_apps_line_not_qclusters(
        app_dir: Path, module: str, source: str, said: str) -> None:
    """It named qcluster/app.py, where the decorator raised: the line to fix is the app's."""
    (app_dir / f"{module}.py").write_text("from qcluster import App\napp = App()\n\n" + source)
    with pytest.raises(AppImportError) as caught:
        load_app_checked(module)
    assert str(caught.value).startswith(
        f"cannot import app module {module!r}: {app_dir / module}.py:4: {said}")


def test_a_failure_hook_that_cannot_take_the_failure_is_refused_at_import() -> None:
    """It raised a TypeError, logged and ignored, at every failure it was meant to report."""
    app = App()
    with pytest.raises(ConfigError) as caught:
        app.on_failure(nothing)  # type: ignore[arg-type]
    assert str(caught.value) == (
        "on_failure: hook nothing() cannot be called with the failure (too many positional "
        "arguments): declare it as def nothing(failure)")
    with pytest.raises(ConfigError):
        app.on_failure(timeout=2.0)(thumb)
    app.on_failure(one_job)  # type: ignore[arg-type]
    app.on_failure(loose)
    assert len(app.failure_hooks) == 2


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), "2", True])
def test_a_failure_hook_timeout_that_is_no_duration_is_refused_at_import(timeout: Any) -> None:
    """NaN and infinity were accepted (the hook then had no bound of its own), and a string
    raised a TypeError instead of the ConfigError the master turns into one line."""
    with pytest.raises(ConfigError, match="on_failure: timeout must be a finite number"):
        App().on_failure(timeout=timeout)(lambda failure: None)
