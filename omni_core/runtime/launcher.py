"""Launchers start stage processes and report their liveness; the runner never knows which one
it uses. omni-core's ``local`` launcher runs them on this machine with multiprocessing.

A launcher is a subclass of :class:`omni_core.contracts.Launcher` registered with
``omni_register_launchers``: ``start(boot)`` returns a :class:`omni_core.contracts.ProcessHandle`,
``close()`` ends it; ``prepare``, ``plan_nodes`` and ``validate_launch`` are its optional
capabilities (see there). This module holds the ``local`` launcher and the forkserver it uses.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
from typing import Any

from .._compat import forkserver_pid, stop_forkserver, without_main_module
from ..contracts import Launcher, ProcessHandle
from ..errors import ConfigError
from .types import Bootstrap

#: Modules the forkserver imports once, so each stage process starts without paying for them.
PRELOAD = ["torch", "omni_core.runtime.child"]

# The forkserver is one per parent process and its stage processes die with it (PDEATHSIG), so
# what it preloaded can only change while no local launcher of this process is open.
_forkserver_preload: list[str] | None = None
_open_launchers = 0


@contextlib.contextmanager
def _passive_openmp():
    """Start the forkserver with OMP_WAIT_POLICY=PASSIVE unless the operator chose otherwise:
    OpenMP reads it once when torch loads, and spinning workers starve sibling processes (docs/performance.md)."""
    if "OMP_WAIT_POLICY" in os.environ:
        yield
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        yield
    finally:
        os.environ.pop("OMP_WAIT_POLICY", None)


def _preload_option(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(m, str) and m.strip() for m in value):
        raise ConfigError(f"launcher.options.preload: {value!r} is not a list of module names; "
                          "give importable modules, e.g. preload: [transformers]")
    return [m.strip() for m in value]


def _ensure_forkserver(preload: list[str]) -> None:
    """Start the forkserver with ``PRELOAD`` plus ``preload``; restart it when it lacks some of
    them and no launcher of this process is open (else the modules load in each stage process)."""
    global _forkserver_preload
    wanted = list(dict.fromkeys(PRELOAD + preload))
    running = forkserver_pid() is not None
    if running and _forkserver_preload is not None and set(wanted) <= set(_forkserver_preload):
        return
    if running and _open_launchers == 0:
        running = not stop_forkserver()
    if running:
        return
    multiprocessing.forkserver.set_forkserver_preload(wanted)
    with _passive_openmp(), without_main_module():
        multiprocessing.forkserver.ensure_running()
    _forkserver_preload = wanted


def run_stage_process(boot: Bootstrap) -> None:
    """The local launcher's process: in a session of its own (a Ctrl-C in the caller's terminal
    reaches the caller alone, which drains, then stops its processes; the parent watch still ends
    them if the caller dies), then the stage host."""
    from .child import main, own_session  # torch and the stage host: only where processes start

    own_session()
    main(boot)


def prestart(launcher: str, options: Any) -> bool:
    """Start the forkserver of a ``local`` launcher with these options now, in the background,
    before the caller imports torch itself: the two imports then overlap instead of following
    each other (the forkserver's is on the path of every stage process's start). Returns whether
    it started one; any problem with the options is left for the launcher to report."""
    if launcher not in ("local", "omni.local"):
        return False
    options = dict(options or {})
    if options.get("start_method", "forkserver") != "forkserver":
        return False
    try:
        preload = _preload_option(options.get("preload"))
        _ensure_forkserver(preload)
    except Exception:
        return False
    return True


class LocalLauncher(Launcher):
    """Stage processes on this machine: a forkserver that preloaded torch and omni (default), or
    plain ``spawn`` (``launcher: {name: local, options: {start_method: spawn}}``). Never fork.

    ``options.preload``: more modules for the forkserver to import once (``[transformers]``), so
    stage processes that import them start in milliseconds. The forkserver is shared by every
    pipeline of the parent process: it is restarted with the new modules only while none of them
    runs; otherwise each stage process imports what is missing itself.
    """

    def __init__(self, options: dict[str, Any] | None = None):
        global _open_launchers
        options = dict(options or {})
        method = options.pop("start_method", "forkserver")
        if method not in ("forkserver", "spawn"):
            raise ConfigError(f"launcher.options.start_method: {method!r} is not supported; use 'forkserver' or 'spawn'")
        preload = _preload_option(options.pop("preload", None))
        if options:
            raise ConfigError(f"launcher.options: unknown option(s) {', '.join(sorted(options))} for launcher 'local' "
                              "(known: start_method, preload)")
        if preload and method != "forkserver":
            raise ConfigError("launcher.options.preload needs start_method: forkserver (spawn preloads nothing)")
        self.ctx = multiprocessing.get_context(method)
        self._open = False
        if method == "forkserver":
            _ensure_forkserver(preload)
            _open_launchers += 1
            self._open = True

    def start(self, boot: Bootstrap) -> ProcessHandle:
        proc = self.ctx.Process(target=run_stage_process, args=(boot,), name=f"omni:{boot.process.name}",
                                daemon=False)
        with without_main_module():
            proc.start()
        return _MpHandle(boot.process.name, proc)

    def close(self) -> None:
        global _open_launchers
        if self._open:
            self._open = False
            _open_launchers -= 1


class _MpHandle(ProcessHandle):
    def __init__(self, name: str, proc: multiprocessing.process.BaseProcess):
        self.name = name
        self.proc = proc

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    @property
    def sentinel(self) -> int:
        return self.proc.sentinel

    @property
    def exitcode(self) -> int | None:
        return self.proc.exitcode

    def terminate(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.terminate()

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.kill()

    def join(self, timeout: float | None = None) -> None:
        self.proc.join(timeout)
