"""Benchmarks: qcluster beside the raw-broker limit, in the same run (`make bench`)."""
