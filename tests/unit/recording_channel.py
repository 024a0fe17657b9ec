"""A slot's channel to its master, for tests that run a ``SlotRunner`` in-process: it
records what the slot sends and never has anything for it."""

from __future__ import annotations


class RecordingChannel:
    closed = False

    def __init__(self) -> None:
        self.sent: list[object] = []

    def send(self, message: object) -> None:
        self.sent.append(message)

    def receive(self) -> list[object]:
        return []
