"""The queue-name rule, in one place.

A queue name is 1-128 characters: a letter or digit, then letters, digits, ``_``, ``.``,
``:`` or ``-``. No spaces, brackets, braces or slashes: a name is part of Redis keys
(``qc:{NAME}:ready``; a brace would move it out of its hash tag), of RabbitMQ queue
names, and is printed by rich (brackets are markup). Every entry point checks it:
``App.queue``, ``Client`` enqueue and the brokers.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from functools import lru_cache

from qcluster.errors import InvalidJobId, InvalidQueueName

QUEUE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
_QUEUE_NAME = re.compile(QUEUE_NAME_PATTERN)
#: The longest job id looked up: producers make 32 hex digits; a broker may keep others.
MAX_JOB_ID_CHARS = 200


@lru_cache(maxsize=4096)
def _checked(name: str) -> str:
    # fullmatch: "$" alone would accept a trailing newline.
    if not _QUEUE_NAME.fullmatch(name):
        raise InvalidQueueName(
            f"invalid queue name {name!r}: use 1-128 letters, digits, '_', '.', ':' or '-', "
            "starting with a letter or digit"
        )
    return name


def check_queue_name(name: str) -> str:
    """``name`` if it is a valid queue name; :class:`InvalidQueueName` (a ValueError) if not.

    Cached: brokers call it on every publish and take.
    """
    if not isinstance(name, str):
        raise InvalidQueueName(f"queue name must be a string, not {type(name).__name__}")
    return _checked(name)


def check_job_id(job_id: str) -> str:
    """``job_id`` if a job could have it; :class:`InvalidJobId` (a ValueError) if it is
    empty, blank or longer than MAX_JOB_ID_CHARS (a lookup would only say "no job")."""
    if not isinstance(job_id, str) or not job_id.strip() or len(job_id) > MAX_JOB_ID_CHARS:
        raise InvalidJobId(f"invalid job id {job_id!r}: give the id enqueue returned "
                           f"(1-{MAX_JOB_ID_CHARS} characters)")
    return job_id


def closest(name: str, known: Iterable[str], *, cutoff: float = 0.6) -> str | None:
    """The known name ``name`` most likely misspells (for a "did you mean"), or None. A
    higher ``cutoff`` for a warning nobody asked for: a near miss only, not a neighbour.
    A name that differs only by case is always one (``EMAILS`` for ``emails``, whose
    letters all differ to difflib): queue names are case-sensitive on every broker."""
    names = sorted(known)
    same = [one for one in names if one != name and one.casefold() == name.casefold()]
    if same:
        return same[0]
    found = difflib.get_close_matches(name, names, n=1, cutoff=cutoff)
    return found[0] if found else None
