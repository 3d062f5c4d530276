"""The package version (one place: `rallyrl --version`, the JSON schema title, the model card)."""

__version__ = "0.1.0"
