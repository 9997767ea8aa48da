"""Security: admin-request guards, (later) CA and certificates, API keys."""
