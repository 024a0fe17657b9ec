"""The peers' side of the benchmarks: Celery, Dramatiq, RQ and arq apps doing the same no-op
job as ``bench.apps``, and a publisher. Each peer runs in its own virtualenv under
``bench/.peers/<name>`` (made by ``bench.peer_runs``), so these modules import only that peer
and the standard library; the broker URL and queue come from ``QB_BROKER`` and ``QB_QUEUE``."""
