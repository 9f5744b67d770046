from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from plugin_fixtures import AcmePlugin, forget_test_modules, make_plugin_site

from omni_core.plugins import load_plugins, reset_plugins
from omni_core.registry import Registry
from omni_core.testing.cuda import pytest_configure, pytest_runtest_setup  # noqa: F401 - the cuda marker


@pytest.fixture(autouse=True)
def _isolated_plugins(monkeypatch):
    """Hermetic plugins: every test (and every process it starts) loads omni-core's built-ins
    only, whatever else is installed, unless it selects plugins itself; no test sees the
    plugin selection of the shell that runs pytest, nor a registry loaded by an earlier test."""
    monkeypatch.delenv("OMNI_DISABLED_PLUGINS", raising=False)
    monkeypatch.setenv("OMNI_LOAD_PLUGINS", "")
    reset_plugins()
    yield
    reset_plugins()


@pytest.fixture(scope="session")
def plugin_site_dir(tmp_path_factory) -> Path:
    """A site directory with every test distribution of ``plugin_fixtures`` installed."""
    return make_plugin_site(tmp_path_factory.mktemp("site"))


@pytest.fixture
def plugin_site(plugin_site_dir, monkeypatch) -> Path:
    """The test distributions, visible to ``importlib.metadata`` in this process."""
    forget_test_modules()
    monkeypatch.syspath_prepend(str(plugin_site_dir))
    importlib.invalidate_caches()
    yield plugin_site_dir
    forget_test_modules()


@pytest.fixture
def load(plugin_site):
    """``load("good,broken")``: load omni-core's plugins plus the named test distributions."""

    def _load(selected: str = "", **env: str):
        return load_plugins(env={"OMNI_LOAD_PLUGINS": selected, **env})

    return _load


@pytest.fixture
def registry() -> Registry:
    """omni-core's built-ins plus the in-tree 'acme' plugin; no third-party plugin."""
    plugins = load_plugins(env={"OMNI_LOAD_PLUGINS": ""}, extra=[("acme", AcmePlugin())])
    assert not [i.error for i in plugins.infos if i.error]
    return plugins.registry
