"""Temporal workflows only: deterministic, no I/O imports. Activities are called by name."""
