"""The RQ job (RQ imports it by dotted name in its worker)."""

from __future__ import annotations


def noop(n: int | None = None) -> None:
    """Does nothing: what is measured is the framework and the broker."""
