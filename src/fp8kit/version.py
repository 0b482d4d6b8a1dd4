"""fp8kit's version (its own module, so that subpackages can name it without importing the package root)."""

__version__ = "0.1.0"
