"""omni-nccl as an installed distribution: its entry point registers the relay, and the omni
command lists it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from omni_core.plugins import load_plugins

import omni_nccl
from omni_nccl.relay import NcclRelay


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
    [plugin] = [p for p in json.loads(result.stdout) if p["distribution"] == "omni-nccl"]
    assert plugin["name"] == "nccl" and plugin["version"] == omni_nccl.__version__
    assert plugin["registered"] == {"relay": ["nccl"]} and plugin["error"] is None
    assert plugin["builtin"] is False


def test_tox_runs_against_the_installed_package_not_the_source_tree():
    if "TOX_ENV_NAME" not in os.environ:
        pytest.skip("a development run may use an editable install")
    assert "site-packages" in omni_nccl.__file__, omni_nccl.__file__


def test_relay_resolves_by_name_and_declares_what_it_moves():
    registry = load_plugins(env={"OMNI_LOAD_PLUGINS": "nccl"}).registry
    cls = registry.resolve("relay", "nccl")
    assert cls is NcclRelay
    caps = cls.capabilities
    assert caps.devices == {"cpu", "cuda"} and caps.scopes == {"node"}
    assert caps.priority < registry.resolve("relay", "shm").capabilities.priority, \
        "on CPU edges shm stays the automatic choice"
