"""Built-in launchers."""

from __future__ import annotations

from ..plugins import hookimpl


@hookimpl
def omni_register_launchers(register):
    register(
        "local",
        "omni_core.runtime.launcher:LocalLauncher",
        description="stage processes on this machine (forkserver with torch preloaded, or spawn)",
    )
