"""Pure decision functions: a `Snapshot` in, decisions with reasons out. No database, no network."""
