"""What a slot logs while its broker fails: the first failure, a reminder a minute, the
recovery. Each slot used to log every failed attempt (one a second per slot: hundreds of
lines a minute on a busy host) and nothing once the broker answered again."""

from __future__ import annotations

from dataclasses import dataclass

#: While the broker keeps failing, one reminder this often (with the attempts so far).
REMIND_EVERY_S = 60.0


@dataclass
class BrokerOutage:
    """One slot's view of its broker's failures. Pure: the caller passes the clock and
    logs the lines it gets."""

    since: float | None = None
    """When the current run of failures began (None: the broker answers)."""
    attempts: int = 0
    reminded_at: float = 0.0
    said: str = ""
    """The error last logged: a different one is logged at once."""

    def failed(self, error: str, now: float) -> str | None:
        """A line to log for this failure, or None (the same error, logged recently)."""
        self.attempts += 1
        if self.since is None:
            self.since, self.reminded_at, self.said = now, now, error
            return f"broker error: {error} (trying again every second; logged once a minute)"
        if error != self.said or now - self.reminded_at >= REMIND_EVERY_S:
            self.reminded_at, self.said = now, error
            return (f"broker still failing after {self.attempts} attempts in "
                    f"{now - self.since:.0f} s: {error}")
        return None

    def answered(self, now: float) -> str | None:
        """A line to log when the broker answers after failing, else None."""
        if self.since is None:
            return None
        line = f"broker answers again after {self.attempts} failed attempts in " \
               f"{now - self.since:.0f} s"
        self.since, self.attempts, self.said = None, 0, ""
        return line
