"""omni-core's built-in plugins. Each module here is declared in omni-core's own
``[project.entry-points.omni]`` and loads exactly like a third-party plugin."""
