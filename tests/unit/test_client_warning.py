"""What a producer says of a queue the apps it knows do not declare: a near miss names
the queue meant; a producer given its app names what the app has, ten names at most."""

from __future__ import annotations

from qcluster import App
from qcluster.client import _undeclared


def app_of(name: str, queues: list[str]) -> App:
    app = App(name)
    for queue in queues:
        app.queue(queue)(lambda jobs: None)
    return app


def test_a_producer_given_its_app_names_ten_of_its_queues_at_most() -> None:
    fleet = app_of("fleet", [f"fleet-{n:03d}" for n in range(150)])
    said = _undeclared("bench-host", [fleet], feeds_only=True)
    assert said == ("enqueue to 'bench-host': no queue of app 'fleet' has that name, so no "
                    "slot will run these jobs (known: fleet-000, fleet-001, fleet-002, "
                    "fleet-003, fleet-004, fleet-005, fleet-006, fleet-007, fleet-008, "
                    "fleet-009 and 140 more)")


def test_without_its_app_only_a_near_miss_is_said() -> None:
    shop = app_of("shop", ["emails", "thumbnails"])
    assert _undeclared("reports", [shop], feeds_only=False) == ""
    assert _undeclared("emials", [shop], feeds_only=False).endswith("(did you mean emails?)")
    assert _undeclared("emials", [], feeds_only=False) == ""


def test_a_name_differing_only_by_case_is_a_near_miss() -> None:
    """Another queue on every broker, so its jobs would wait forever; before, only a
    name whose letters difflib matched (``Emails``) was said, ``EMAILS`` was not."""
    shop = app_of("shop", ["emails", "abc"])
    assert _undeclared("EMAILS", [shop], feeds_only=False).endswith("(did you mean emails?)")
    assert _undeclared("ABC", [shop], feeds_only=False).endswith("(did you mean abc?)")
