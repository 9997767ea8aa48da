"""Engine adapters (argv + env + readiness for each engine) and the built-in sim engine."""
