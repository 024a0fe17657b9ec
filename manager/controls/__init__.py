"""Pause and drain: kept in the broker (``store``) and changed by the service (``desk``)."""
