"""The mirror: its byte server, its workflow's activities, staging, the operator's client, the mirror worker."""
