"""Security shared by every process: the CA and certificates, the admin token, API keys' form and hash, safe log
text, a node's own addresses."""
