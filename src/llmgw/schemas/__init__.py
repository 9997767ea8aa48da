"""Pydantic models shared across processes: catalog, inventory, workflow/activity payloads, API bodies."""
