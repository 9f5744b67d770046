"""omni-cuda-ipc as an installed distribution: its entry point registers the relay, and the omni
command lists it (no GPU needed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from omni_core.plugins import load_plugins

import omni_cuda_ipc
from omni_cuda_ipc.relay import CudaIpcRelay


def omni_command() -> list[str]:
    """The installed ``omni`` script beside this interpreter (or the CLI through it)."""
    script = os.path.join(os.path.dirname(sys.executable), "omni")
    if os.path.exists(script):
        return [script]
    found = shutil.which("omni")
    return [found] if found else [sys.executable, "-c", "from omni_core.cli import main; main()"]


def test_omni_plugins_list_shows_the_distribution_and_its_relay():
    env = {k: v for k, v in os.environ.items() if k not in ("OMNI_LOAD_PLUGINS", "OMNI_DISABLED_PLUGINS")}
    result = subprocess.run([*omni_command(), "plugins", "list", "--json"], capture_output=True,
                            text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    [plugin] = [p for p in json.loads(result.stdout) if p["distribution"] == "omni-cuda-ipc"]
    assert plugin["name"] == "cuda_ipc" and plugin["version"] == omni_cuda_ipc.__version__
    assert plugin["registered"] == {"relay": ["cuda_ipc"]} and plugin["error"] is None
    assert plugin["builtin"] is False


def test_tox_runs_against_the_installed_package_not_the_source_tree():
    if "TOX_ENV_NAME" not in os.environ:
        pytest.skip("a development run may use an editable install")
    assert "site-packages" in omni_cuda_ipc.__file__, omni_cuda_ipc.__file__


def test_relay_resolves_by_name_and_declares_cuda_only():
    registry = load_plugins(env={"OMNI_LOAD_PLUGINS": "cuda_ipc"}).registry
    cls = registry.resolve("relay", "cuda_ipc")
    assert cls is CudaIpcRelay
    assert cls.capabilities.devices == {"cuda"} and cls.capabilities.scopes == {"node"}
