"""``rallyrl schema``: the JSON Schema of the config, now ``rallyrl.config.schema`` (kept importable here)."""

from .config.schema import CONSTRAINTS, DRAFT, REQUIRED, add_parser, config_schema, main

__all__ = ["CONSTRAINTS", "DRAFT", "REQUIRED", "add_parser", "config_schema", "main"]
