"""Rolling code reload: the pure sequencing (``rollout``) and the service's driver (``driver``)."""
