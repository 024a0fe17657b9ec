"""A master's report read from its JSON body with the CPU a report must not spend twice.

FastAPI reads a body model with ``json.loads`` and validates the Python objects: at 150
queues that is about 2 ms of the event loop's CPU per report, most of it the 150 queue
policies (each with two Python validators), which a master sends unchanged in every report
and every master of an app sends alike. ``ReportReader`` parses with pydantic-core's parser
and validates each distinct ``queues`` section once.

Only what validates is read here; anything else (``None``) goes through FastAPI's usual
path, which answers it as it always did (422 naming the fields, 400 too deeply nested)."""

from __future__ import annotations

import marshal
from typing import Any

from pydantic import TypeAdapter, ValidationError
from pydantic_core import from_json

from qcluster.messages import MAX_QUEUES, HostReport
from qcluster.policy import QueuePolicy

#: Distinct ``queues`` sections kept: the apps' versions that report at once (a rolling
#: deploy has two); past it the oldest is dropped.
KEPT_SECTIONS = 8
#: marshal's format 2 writes no references between objects: its bytes depend on the values
#: and their types alone, not on which objects happen to be shared.
_EXACT = 2

_POLICIES: TypeAdapter[dict[str, QueuePolicy]] = TypeAdapter(dict[str, QueuePolicy])


class ReportReader:
    """Reads report bodies; keeps the last ``KEPT_SECTIONS`` validated ``queues`` sections.

    A section is reused only for one whose JSON values are the same values of the same
    types (compared by their marshal bytes: ``1``, ``1.0`` and ``true`` differ, and so do
    ``0.0`` and ``-0.0``), so the report validated is the one a full validation would give.
    Used from the event loop only."""

    def __init__(self) -> None:
        self.sections: dict[bytes, dict[str, QueuePolicy]] = {}

    def read(self, body: bytes) -> HostReport | None:
        """The report in ``body``; None when it is not valid JSON of a valid report."""
        try:
            data = from_json(body)
        except ValueError:
            return None
        if not isinstance(data, dict):
            return None
        queues = data.get("queues")
        if isinstance(queues, dict) and len(queues) <= MAX_QUEUES:
            policies = self._policies(queues)
            if policies is not None:
                data["queues"] = policies
        try:
            return HostReport.model_validate(data)
        except ValidationError:
            return None

    def _policies(self, queues: dict[str, Any]) -> dict[str, QueuePolicy] | None:
        """The section validated: kept, or validated now; None when it is not valid (the
        report's validation then names what is wrong)."""
        try:
            key = marshal.dumps(queues, _EXACT)
        except ValueError:
            return None  # not the objects JSON parses to
        policies = self.sections.get(key)
        if policies is None:
            try:
                policies = _POLICIES.validate_python(queues)
            except ValidationError:
                return None
            if len(self.sections) >= KEPT_SECTIONS:
                del self.sections[next(iter(self.sections))]
            self.sections[key] = policies
        return policies
