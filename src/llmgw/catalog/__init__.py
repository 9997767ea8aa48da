"""Catalog rules: loading YAML, upgrade repairs, cross-model validation, arithmetic, engine policy."""

from llmgw.catalog.loader import CatalogError, LoadedCatalog, load_catalog, parse_catalog, read_catalog

__all__ = ["CatalogError", "LoadedCatalog", "load_catalog", "parse_catalog", "read_catalog"]
