"""The control worker and the node worker (agent): discovery, supervision, adoption."""
