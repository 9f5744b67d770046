"""tox's project-local plugin: every env builds this tree (omni-core, the plugins) in a setuptools
build folder of its own.

Under ``tox p`` several envs install ``{toxinidir}`` and ``plugins/*`` at once; setuptools builds
a source folder in place (``build/``, ``*.egg-info``), and two builds of one folder at the same
moment fail (``[Errno 17] File exists: 'build/bdist.linux-x86_64/wheel/omni_core-0.1.0.dist-info'``).
Before an env installs anything, this writes a setuptools config into the env's folder that moves
those folders under it, and points ``DIST_EXTRA_CONFIG`` (read by setuptools) at it; every pip run
of the env, and what its tests build, inherit it.
"""

from __future__ import annotations

from typing import Any

from tox.plugin import impl


@impl
def tox_on_install(tox_env: Any, arguments: Any, section: str, of_type: str) -> None:
    folder = tox_env.env_dir / "setuptools-build"
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "setup.cfg"
    config.write_text(f"[build]\nbuild_base = {folder / 'build'}\n[egg_info]\negg_base = {folder}\n")
    tox_env.environment_variables["DIST_EXTRA_CONFIG"] = str(config)
