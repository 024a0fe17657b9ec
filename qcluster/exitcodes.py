"""Exit codes of every qcluster command; each one means one thing.

``qcluster pause|resume|drain|undrain|reload|controls`` add 10-14 (qcluster.controls_cli).
"""

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
#: An address to listen on is taken: the message names the flag that changes it.
ADDRESS_IN_USE = 7
#: This process and the manager use different brokers (the cluster identity stored in
#: each broker differs): one line names both URLs, masked.
WRONG_BROKER = 8
#: ``qcluster broker stop`` refused: other qcluster processes use the embedded broker.
BROKER_IN_USE = 9
#: The broker refused what the slot's queue needs, a mistake no retry can fix (the queue
#: exists with another type, a declaration or a permission refused). The slot logs why
#: once and tells its master, which stops forking the queue (fatal, in /api/v1/host).
BROKER_REFUSED = 20
#: The slot's private memory (Private_Dirty) passed its limit; it finished its batch
#: and exited so the master can fork a fresh copy from the clean pre-imported image.
RECYCLE = 75
