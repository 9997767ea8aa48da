"""The control plane: admin API and its services, node API and fleet service, control activities, the control worker."""
