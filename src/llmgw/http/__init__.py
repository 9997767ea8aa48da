"""What every listener shares: the hardened server, response heads, bounded JSON bodies, the one error module."""
