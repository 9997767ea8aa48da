"""Weights: source naming, the cache, the fetcher, and the mirror."""
