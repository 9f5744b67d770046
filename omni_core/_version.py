"""omni-core's version (pyproject.toml's), in a module that imports nothing."""

__version__ = "0.1.0"
