"""Temporal activities: control-plane ones (database) and node ones (fetch, launch, ready, drain, stop)."""
