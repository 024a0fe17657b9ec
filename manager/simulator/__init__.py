"""``qcluster simulate``: the manager's real planning and placement on a trace of load.

A deterministic discrete-time simulation (same trace and seed, same figures): simulated
masters fork and drain slots with delays, queues receive jobs and run them, hosts die and
return, and each policy (``qcluster``, ``hpa``, ``static``) is judged on the same arrivals.
See docs/simulator.md.
"""

from qcluster.manager.simulator.engine import SimulationResult, simulate
from qcluster.manager.simulator.trace import Trace, TraceError, load_trace

__all__ = ["SimulationResult", "Trace", "TraceError", "load_trace", "simulate"]
