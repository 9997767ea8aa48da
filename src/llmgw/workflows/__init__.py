"""Temporal workflows only: deterministic, no I/O imports. Activities are called through their typed stubs (activities.py), never by a string name."""
