"""The package version (its own module: the artifact writer records it without importing the package)."""

__version__ = "0.1.0"
