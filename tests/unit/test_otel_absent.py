"""Without opentelemetry-api the tracing module is off and nothing of it runs."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
sys.modules["opentelemetry"] = None  # as if the extra were not installed
from qcluster import otel
from qcluster.slot import runtime
assert otel.ENABLED is False
assert "opentelemetry" not in {m.split(".")[0] for m in sys.modules if sys.modules[m]}
print("off")
"""


def test_tracing_is_off_without_opentelemetry() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "off", out.stderr
