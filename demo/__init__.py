"""``qcluster demo`` (what ``make demo`` runs): a process launcher beside the roles, not in
the core. It starts a manager and two masters as ``python -m qcluster`` children and feeds
them jobs; see :mod:`qcluster.demo.launcher`."""

from qcluster.demo.launcher import RECORDING, RESIZE_EDGE_S, arrival_rates

__all__ = ["RECORDING", "RESIZE_EDGE_S", "arrival_rates"]
