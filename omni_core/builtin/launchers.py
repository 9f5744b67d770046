"""Built-in launchers."""

from __future__ import annotations

from ..options import Option, choice
from ..plugins import hookimpl

LOCAL_OPTIONS = {
    "start_method": choice(("forkserver", "spawn"), "forkserver",
                           "forkserver (torch preloaded once, fast starts) or spawn; never fork"),
    "preload": Option("str_list", None,
                      "more modules for the forkserver to import once (e.g. [transformers]), so stage "
                      "processes start without importing them"),
}


@hookimpl
def omni_register_launchers(register):
    register(
        "local",
        "omni_core.runtime.launcher:LocalLauncher",
        description="stage processes on this machine (forkserver with torch preloaded, or spawn)",
        options=LOCAL_OPTIONS,
    )
