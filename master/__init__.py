"""The per-host supervisor: forks slots copy-on-write, sizes the host, watches and recycles."""
