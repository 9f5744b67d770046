"""The ``main`` of every stage process: environment, parent watch, heartbeats, then the host.

The process applies the caller's environment and working directory, starts two threads that do
not depend on its event loop — one exits when the parent dies (no orphans, even after a SIGKILL
of the parent), one sends heartbeats to the coordinator and logs the loop thread's stack when
the event loop is blocked — builds its stages (a failure travels back as ``StartFailed`` with the
child's traceback) and serves until ``Shutdown``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

import torch
import zmq

from ..config.load import structure
from ..errors import ConfigError, PluginError
from ..logs import configure_logging, get_logger
from ..plugins import get_registry
from ..relay.liveness import process_alive
from . import wire
from .channel import Outbox, connect
from .endpoint import Endpoint
from .host import Host
from .types import Bootstrap


def _watch_parent(parent_pid: int) -> None:
    """Exit when the parent dies, even if it was SIGKILLed (no orphans)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: our direct parent (the forkserver) died

    def watch() -> None:
        while process_alive(parent_pid):
            time.sleep(0.25)
        os.kill(os.getpid(), signal.SIGTERM)  # a clean shutdown frees relay memory ...
        time.sleep(3)
        os._exit(1)  # ... unless user code blocks it

    threading.Thread(target=watch, name="omni-parent-watch", daemon=True).start()


class Heart:
    """A thread of the process's own that tells the coordinator it is alive, whatever the event
    loop does, and logs the loop thread's stack when the loop has been blocked too long."""

    def __init__(self, boot: Bootstrap):
        limits: dict[str, Any] = boot.config.get("limits") or {}
        self.interval = float(limits.get("heartbeat_interval") or 2.0)
        self.block_warning = float(limits.get("loop_block_warning") or 2.0)
        self.boot = boot
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread: int | None = None
        self._beat = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="omni-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Measure ``loop``'s responsiveness from now on."""
        self.loop_thread = threading.get_ident()
        self._beat = time.monotonic()
        self.loop = loop

    def _tick(self) -> None:
        self._beat = time.monotonic()

    def _run(self) -> None:
        log = get_logger(process=self.boot.process.name)
        ctx = zmq.Context(io_threads=1)
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 16)
        connect(sock, self.boot.addresses[""])  # CurveZMQ keys when the coordinator is on another node
        name, pid, generation = self.boot.process.name, os.getpid(), self.boot.generation
        seal = wire.Sealer(self.boot.secret).seal if self.boot.secret else None
        warned = False
        try:
            while not self._stop.wait(self.interval):
                lag = 0.0
                loop = self.loop
                if loop is not None and not loop.is_closed():
                    lag = max(0.0, time.monotonic() - self._beat - self.interval)
                    with contextlib.suppress(RuntimeError):
                        loop.call_soon_threadsafe(self._tick)
                    if lag > self.block_warning and not warned:
                        warned = True
                        frame = sys._current_frames().get(self.loop_thread) if self.loop_thread is not None else None
                        stack = "".join(traceback.format_stack(frame)) if frame is not None else "?"
                        log.warning("event loop blocked", blocked_for=round(lag, 2), stack=stack)
                    elif lag <= self.block_warning:
                        warned = False
                with contextlib.suppress(zmq.ZMQError):
                    beat = wire.encode(wire.Heartbeat(name, pid, generation, lag))
                    sock.send(seal(beat) if seal is not None else beat, zmq.NOBLOCK)
        finally:
            sock.close(linger=0)
            ctx.term()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2 * self.interval + 1)


def _apply_env(boot: Bootstrap) -> None:
    """The process's environment and working directory are the caller's at start (a forkserver
    child would otherwise inherit the forkserver's), plus the plan's variables."""
    os.environ.clear()
    os.environ.update(boot.env)
    if boot.cwd:
        with contextlib.suppress(OSError):
            os.chdir(boot.cwd)
    torch.set_num_threads(max(1, boot.process.threads))


def process_title(boot: Bootstrap) -> str:
    """What ``ps`` shows for a stage process: ``omni: <pipeline>/<process>``."""
    return f"omni: {boot.config.get('name') or '?'}/{boot.process.name}"


def set_title(boot: Bootstrap) -> None:
    """Name the process in ``ps`` and ``/proc/PID/cmdline`` (:func:`process_title`), so an
    operator can tell stage processes apart; without setproctitle the thread name alone."""
    title = process_title(boot)
    try:
        import setproctitle
    except ImportError:
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6").prctl(15, title.encode()[:15], 0, 0, 0)  # PR_SET_NAME
        return
    setproctitle.setproctitle(title)


def own_session() -> None:
    """Leave the caller's session and process group: a Ctrl-C in the caller's terminal (SIGINT
    to the whole foreground group) reaches the caller alone, which drains and then stops its
    stage processes; the parent watch still ends them when the caller dies."""
    with contextlib.suppress(OSError):
        os.setsid()  # fails only for a group leader, which a forked or spawned child is not


def main(boot: Bootstrap) -> None:
    """Entry point of a stage process (called by the launcher in the child). The local
    launcher calls :func:`own_session` first; a launcher whose processes some other system
    manages (Ray's workers) leaves them where that system put them."""
    _watch_parent(boot.parent_pid)
    set_title(boot)
    _apply_env(boot)
    configure_logging(force=True)
    heart = Heart(boot)
    heart.start()

    async def run() -> None:
        host = None
        try:
            registry = get_registry()
            config = structure(boot.config)
            endpoint = Endpoint(config, registry, process=boot.process.name, origin=boot.process.name)
            endpoint.open(run_id=boot.run_id, runtime_dir=boot.runtime_dir, addresses=boot.addresses,
                          stages=boot.process.stages, secret=boot.secret)
            host = Host(boot, config, registry, endpoint)
            host.build_stages()
        except BaseException as exc:  # noqa: B902 - SystemExit from a factory is a failed start too
            await _report_start_failure(boot, exc, host)
            raise SystemExit(1) from None
        # Building stages (loading a model) holds the loop by design; it is measured from here on.
        heart.watch(asyncio.get_running_loop())
        await host.serve()

    try:
        asyncio.run(run())
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
    finally:
        heart.stop()


def failing_stage(boot: Bootstrap, host: Any) -> tuple[str, str]:
    """``(stage name, config path)`` of the stage whose construction failed, or ``("", "")``
    when no stage was being built. The path says which part of the stage's config is at fault:
    ``stages[i].factory`` when resolving (importing) the factory failed, ``stages[i].args`` when
    its arguments did not fit the factory's signature, ``stages[i]`` when the factory itself
    raised (what :attr:`Host.building` recorded); before any stage (joining a TP group), the
    first stage of the process."""
    if host is None:
        return "", ""
    name, part = host.building or (next((n for n in boot.process.stages if n not in host.stages), None), "")
    stages = [s.get("name") for s in boot.config.get("stages") or ()]
    if name is None or name not in stages:
        return "", ""
    return name, f"stages[{stages.index(name)}]{part}"


async def _report_start_failure(boot: Bootstrap, exc: BaseException, host: Any = None) -> None:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, (ConfigError, PluginError)):
        message = str(exc)
    try:
        stage, path = failing_stage(boot, host)
    except Exception:  # never let the description hide the failure itself
        stage, path = "", ""
    ctx = zmq.Context(io_threads=1)
    outbox = Outbox(ctx, boot.secret)
    try:
        failed = wire.StartFailed(boot.process.name, os.getpid(), message, tb, stage, path)
        await asyncio.wait_for(outbox.send(boot.addresses[""], failed), 2.0)
    finally:
        outbox.close(linger_ms=2000)
        ctx.term()
