"""omni_core.contracts: the launcher contract's optional capabilities have defaults that mean
"not used", a launcher that does not derive from it is refused naming it, and the built-in and
plugin launchers derive from it."""

from __future__ import annotations

import pytest

from omni_core.contracts import Launcher, ProcessHandle, launcher_class
from omni_core.errors import PluginError
from omni_core.runtime.launcher import LocalLauncher


class Minimal(Launcher):
    def start(self, boot):
        raise NotImplementedError

    def close(self) -> None:
        pass


def test_optional_capabilities_default_to_not_used():
    launcher = Minimal()
    assert launcher.prepare(None, "run", "/tmp", None) is None  # type: ignore[arg-type]
    assert Minimal.plan_nodes(None) is None  # type: ignore[arg-type]
    assert Minimal.validate_launch({"anything": 1}, "stages[0].launch") == []


def test_a_handle_without_describe_exit_says_nothing_more():
    class Handle(ProcessHandle):
        name = "p"
        pid = 1
        sentinel = 3
        exitcode = 0

        def terminate(self) -> None: ...
        def kill(self) -> None: ...
        def join(self, timeout: float | None = None) -> None: ...

    assert Handle().describe_exit() is None


def test_a_launcher_missing_start_or_close_cannot_be_made():
    class Half(Launcher):
        def close(self) -> None: ...

    with pytest.raises(TypeError, match="start"):
        Half()  # type: ignore[abstract]


def test_a_class_that_is_not_a_launcher_is_refused_naming_it():
    class Duck:
        def start(self, boot): ...
        def close(self): ...

    assert launcher_class(LocalLauncher, "local") is LocalLauncher
    with pytest.raises(PluginError, match=r"launcher 'acme' is .*Duck.*not a subclass of omni_core.contracts.Launcher"):
        launcher_class(Duck, "acme")
    with pytest.raises(PluginError, match="launcher 'acme'"):
        launcher_class(Duck(), "acme")
