"""The local launcher's ``preload`` option: modules the forkserver imports once for every stage
process (checked in the stage process itself), and the errors for a bad option."""

from __future__ import annotations

import sys

import pytest
from runtime_helpers import arun

from omni_core import Pipeline
from omni_core.errors import ConfigError
from omni_core.runtime.launcher import LocalLauncher
from omni_core.testing.leaks import no_leaks  # noqa: F401 - a fixture

# Stdlib modules that neither torch nor omni import.
PROBES = ["xml.dom.minidom", "wave"]


class Modules:
    """Reports which probe modules were already imported when its process built it."""

    def __init__(self):
        self.loaded = [m for m in PROBES if m in sys.modules]

    def __call__(self, payload, ctx):
        return {"loaded": self.loaded}


def config(**options) -> dict:
    return {"name": "preload", "launcher": {"name": "local", "options": options},
            "stages": [{"name": "m", "factory": "test_launcher_preload:Modules", "terminal": True}]}


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_leaks")
def test_preloaded_modules_are_in_every_stage_process_and_others_are_not():
    async def go(cfg):
        async with Pipeline(cfg) as p:
            return (await p.submit({}))["loaded"]

    assert arun(go(config(start_method="spawn"))) == []
    assert arun(go(config(preload=["wave", "xml.dom.minidom"]))) == ["xml.dom.minidom", "wave"]


@pytest.mark.parametrize("options, message", [
    ({"preload": 3}, "launcher.options.preload: 3 is not a list of module names"),
    ({"preload": ["wave", ""]}, "is not a list of module names"),
    ({"preload": ["wave"], "start_method": "spawn"}, "preload needs start_method: forkserver"),
    ({"preloads": ["wave"]}, "unknown option(s) preloads for launcher 'local' (known: start_method, preload)"),
])
def test_bad_preload_options_are_config_errors(options, message):
    with pytest.raises(ConfigError) as info:
        LocalLauncher(options)
    assert message in str(info.value)
