"""`llmgw dev`: every llmgw process and its dependencies on one machine, with embedded defaults."""
