"""What runs on a GPU node: the agent, supervisor, fences, readiness, inventory, the node activities."""
