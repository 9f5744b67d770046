"""The ``demo`` pipeline's models and stages: an omni model in miniature (see docs/demo.md)."""
