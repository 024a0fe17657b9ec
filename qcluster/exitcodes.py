"""Exit codes shared by slots and the master; each one means one thing."""

from __future__ import annotations

#: Normal exit: stopped on request or a --burst run found nothing left to do.
OK = 0
#: Generic failure (an unexpected exception escaped the process).
FAILURE = 1
#: Command-line usage error (click's own code).
USAGE = 2
#: The process could not boot (e.g. the queue has no handler). The master counts a slot
#: that exits with this code (or APP_IMPORT) as a ``boot_error`` restart, backs off, and
#: after 5 in a row stops forking the queue (fatal, reported in /api/v1/host).
BOOT_ERROR = 3
#: The application module could not be imported.
APP_IMPORT = 4
#: The broker could not be reached within the retry budget.
BROKER_CONNECT = 5
#: Configuration is invalid: nothing was started.
CONFIG = 6
#: The broker refused what the slot's queue needs, a mistake no retry can fix (the queue
#: exists with another type, a declaration or a permission refused). The slot logs why
#: once and tells its master, which stops forking the queue (fatal, in /api/v1/host).
BROKER_REFUSED = 7
#: The slot's private memory (Private_Dirty) passed its limit; it finished its batch
#: and exited so the master can fork a fresh copy from the clean pre-imported image.
RECYCLE = 75
