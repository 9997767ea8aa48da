"""Errors the node worker's parts raise to each other."""

from __future__ import annotations


class ReportRefused(RuntimeError):
    """The node API refused a report (4xx): this node may not say that, and saying it again will not help
    (a shard not placed on it, an endpoint not at its address, a certificate for another node)."""
