"""Metric names used by deploy/ (dashboard, alert rules) versus what qcluster exports."""

from __future__ import annotations

import re

from qcluster.metrics import MANAGER_METRICS, MASTER_METRICS

#: Names the slots write (qcluster.metrics.slot_metrics), with histogram/counter suffixes.
SLOT_METRICS = (
    "qcluster_jobs_total", "qcluster_job_failures_total", "qcluster_batch_duration_seconds",
    "qcluster_batch_size", "qcluster_job_wait_seconds", "qcluster_published_jobs_total",
    "qcluster_slot_busy", "qcluster_slot_self_private_dirty_bytes",
)
SUFFIXES = ("", "_bucket", "_sum", "_count", "_created")
METRIC = re.compile(r"\b(qcluster_[a-z_]+)\b")


def exported_names() -> set[str]:
    return {name + suffix for name in (*MASTER_METRICS, *MANAGER_METRICS, *SLOT_METRICS)
            for suffix in SUFFIXES}


def names_in(expression: str) -> set[str]:
    return set(METRIC.findall(expression))
