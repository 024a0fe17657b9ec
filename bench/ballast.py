"""The memory suite's "big application": ``QB_BALLAST_MB`` MiB allocated and touched at
import. Standard library only, so that the peers' apps import the same thing."""

from __future__ import annotations

import os

BALLAST = bytearray(int(os.environ.get("QB_BALLAST_MB", "0")) << 20)
for _page in range(0, len(BALLAST), 4096):
    BALLAST[_page] = 1  # touched, so it is really resident
