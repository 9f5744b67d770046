"""Built-in launchers."""

from __future__ import annotations

from ..options import choice
from ..plugins import hookimpl

LOCAL_OPTIONS = {
    "start_method": choice(("forkserver", "spawn"), "forkserver",
                           "forkserver (torch preloaded once, fast starts) or spawn; never fork"),
}


@hookimpl
def omni_register_launchers(register):
    register(
        "local",
        "omni_core.runtime.launcher:LocalLauncher",
        description="stage processes on this machine (forkserver with torch preloaded, or spawn)",
        options=LOCAL_OPTIONS,
    )
