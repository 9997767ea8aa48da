"""Catalog rules: loading YAML, cross-model validation, engine policy."""

from llmgw.catalog.loader import CatalogError, load_catalog, parse_catalog

__all__ = ["CatalogError", "load_catalog", "parse_catalog"]
