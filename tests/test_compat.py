"""omni_core._compat: every CPython internal omni-core uses is present on this Python and does
what the runtime relies on. A failure here names the internal a new Python dropped or changed."""

from __future__ import annotations

import asyncio
import multiprocessing.spawn
import sys

from omni_core import _compat


def test_no_internal_is_missing_on_this_python():
    assert _compat.missing() == [], (
        f"Python {sys.version.split()[0]} lacks CPython internals omni-core uses: "
        f"{_compat.missing()}; see omni_core/_compat.py for each one's fallback and fix it there")
    assert _compat.EAGER_START


def test_a_stand_in_becomes_the_current_task_and_leaves():
    class StandIn:  # what runtime/stage.py makes current during a call's first step
        pass

    async def main() -> None:
        loop = asyncio.get_running_loop()
        outer = asyncio.current_task()
        stand_in = StandIn()
        _compat.leave_task(loop, outer)
        _compat.enter_task(loop, stand_in)
        try:
            assert asyncio.current_task() is stand_in
        finally:
            _compat.leave_task(loop, stand_in)
            _compat.enter_task(loop, outer)
        assert asyncio.current_task() is outer

    asyncio.run(main())


def test_the_ready_queue_holds_the_callbacks_of_this_turn():
    async def main() -> None:
        loop = asyncio.get_running_loop()
        ready = _compat.ready_queue(loop)
        assert ready is not None
        before = len(ready)
        loop.call_soon(lambda: None)
        assert len(ready) == before + 1

    asyncio.run(main())


def test_the_ready_queue_of_a_loop_without_one_is_none():
    class OtherLoop:  # e.g. uvloop's, which keeps its queue in C
        _ready = None

    assert _compat.ready_queue(OtherLoop()) is None  # type: ignore[arg-type]


def test_without_main_module_drops_the_parents_main_and_restores_the_patch():
    original = multiprocessing.spawn.get_preparation_data
    with _compat.without_main_module():
        data = multiprocessing.spawn.get_preparation_data("child")
        assert "init_main_from_path" not in data and "init_main_from_name" not in data
        assert "sys_path" in data  # the rest of the preparation is kept
    assert multiprocessing.spawn.get_preparation_data is original


def test_forkserver_and_resource_tracker_pids_are_ints_or_none():
    for pid in (_compat.forkserver_pid(), _compat.resource_tracker_pid()):
        assert pid is None or (isinstance(pid, int) and pid > 0)


def test_the_other_pythons_env_installs_every_dependency_but_torch():
    """tox env core-py{310,312,313} lists omni-core's dependencies itself (no CPU torch for those
    Pythons): the list must follow pyproject.toml."""
    import configparser
    from pathlib import Path

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    root = Path(__file__).resolve().parents[1]
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(root / "tox.ini")
    listed = {line.strip() for line in tox["testenv:core-py{310,312,313}"]["deps"].splitlines() if line.strip()}
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    wanted = {d for d in project["dependencies"] if not d.startswith("torch")}
    wanted |= set(project["optional-dependencies"]["test"])
    assert listed == wanted, f"tox.ini lacks {sorted(wanted - listed)}, has extra {sorted(listed - wanted)}"
