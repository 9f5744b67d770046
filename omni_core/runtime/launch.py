"""A run's launch (caller's process): :class:`Launch` turns a plan into running processes.

It owns what is made once per run and freed at its end: the run's id and secret, its runtime
directory (after sweeping those of dead runs), the launcher, the placement (the address map of
the caller and of each process), the boot spec (:class:`~.types.Bootstrap`) of every process
and the relays' sweep. It starts a process when asked (:meth:`Launch.start`, again with the
next generation for a restart: :meth:`Launch.next_generation`); when processes start, die,
restart or stop is the supervisor's (:class:`~.runner.Runner`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile

import attrs

from ..config import PipelineConfig, to_dict
from ..contracts import Launcher, ProcessHandle, launcher_class
from ..logs import get_logger
from ..plan.topology import OBJECT_RELAY, Plan, endpoints
from ..registry import Registry
from .types import Bootstrap, caller_edges

__all__ = ["RUNTIME_DIR_PREFIX", "Launch", "sweep_stale_runtime_dirs"]

RUNTIME_DIR_PREFIX = "omni-run-"


def sweep_stale_runtime_dirs(base: str | None = None, *, dry_run: bool = False) -> list[str]:
    """Remove runtime directories of runs whose parent process is gone (after a SIGKILL).
    ``dry_run``: only list them."""
    base = base or tempfile.gettempdir()
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(base):
            if not entry.name.startswith(RUNTIME_DIR_PREFIX) or not entry.is_dir():
                continue
            try:
                pid = int(entry.name[len(RUNTIME_DIR_PREFIX):].split("-")[0])
                os.kill(pid, 0)
            except (ValueError, PermissionError):
                continue
            except ProcessLookupError:
                if not dry_run:
                    shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
    return removed


class Launch:
    """One run's set-up and its undoing (see the module docstring)."""

    def __init__(self, config: PipelineConfig, registry: Registry):
        self.config = config
        self.registry = registry
        self.log = get_logger(pipeline=config.name)
        #: The plan as launched (a launcher that spans machines marks the edges that cross nodes).
        self.plan: Plan | None = None
        self.run_id = ""
        #: The control plane's MAC key (:mod:`.wire`).
        self.secret = b""
        self.runtime_dir: str | None = None
        self.launcher: Launcher | None = None
        self._launcher_closed = False
        #: Process name → the boot spec of its current generation.
        self.boots: dict[str, Bootstrap] = {}

    def prepare(self, plan: Plan) -> dict[str, str]:
        """Make the run (id, secret, runtime dir, launcher, placement, boot specs) for ``plan``;
        returns the caller's address map (``""``: its own inbox)."""
        cfg = self.config
        self.plan = plan
        base = cfg.endpoints.ipc_dir or tempfile.gettempdir()
        sweep_stale_runtime_dirs(base)
        for relay_name in {e.relay for e in plan.edges} - {OBJECT_RELAY} | set(caller_edges(cfg).values()):
            with contextlib.suppress(Exception):
                self.registry.resolve("relay", relay_name).sweep(None)
        self.run_id = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.secret = secrets.token_bytes(32)
        self.runtime_dir = tempfile.mkdtemp(prefix=f"{RUNTIME_DIR_PREFIX}{os.getpid()}-", dir=base)
        os.chmod(self.runtime_dir, 0o700)
        launcher_cls = launcher_class(self.registry.resolve("launcher", cfg.launcher.name), cfg.launcher.name)
        self.launcher = launcher_cls(dict(cfg.launcher.options))
        plan, views = self._place(plan)
        self.plan = plan
        routes = {s.name: plan.processes_of(s.name) for s in cfg.stages}
        # every edge's relay, the caller's edges' included
        edge_relays = {(e.src, e.dst, e.kind): e.relay for e in plan.edges} | caller_edges(cfg)
        config_data = to_dict(cfg)
        for spec in plan.processes:
            self.boots[spec.name] = Bootstrap(
                run_id=self.run_id,
                runtime_dir=self.runtime_dir,
                config=config_data,
                process=spec,
                addresses=views[spec.name],
                routes=routes,
                edge_relays=edge_relays,
                env=spec.environment(os.environ),
                parent_pid=os.getpid(),
                followers=tuple(plan.followers(spec.name)),
                cwd=os.getcwd(),
                secret=self.secret,
            )
        for edge in plan.edges:
            self.log.info("edge", src=edge.src, dst=edge.dst, kind=edge.kind, relay=edge.relay)
        return views[""]

    def _place(self, plan: Plan) -> tuple[Plan, dict[str, dict[str, str]]]:
        """The plan as launched, and the address map of the coordinator (``""``) and of each
        process. ipc for all with a launcher that runs everything on this machine; a launcher
        with ``prepare`` (one that spans machines) places the processes, binds tcp inboxes where
        a sender is on another node, and returns the plan with the edges that cross nodes marked
        (their relays chosen for it) plus each process's view."""
        assert self.launcher is not None and self.runtime_dir is not None  # made by prepare
        placed = self.launcher.prepare(plan, self.run_id, self.runtime_dir, self.config.endpoints)
        if placed is not None:
            return placed
        addresses = dict(endpoints(plan, self.runtime_dir))
        return plan, dict.fromkeys(["", *(p.name for p in plan.processes)], addresses)

    def start(self, name: str) -> ProcessHandle:
        """Start process ``name`` (its current boot spec) with the run's launcher."""
        assert self.launcher is not None  # made by prepare
        return self.launcher.start(self.boots[name])

    def next_generation(self, name: str, floor: int, ended: tuple[int, ...]) -> None:
        """Process ``name`` restarts: its next boot spec is the next generation, which runs no
        request below ``floor`` nor of ``ended``."""
        boot = self.boots[name]
        self.boots[name] = attrs.evolve(boot, generation=boot.generation + 1, floor=floor, ended=ended)

    def close_launcher(self) -> None:
        """The processes are gone: close the launcher (once)."""
        if self.launcher is not None and not self._launcher_closed:
            self._launcher_closed = True
            with contextlib.suppress(Exception):
                self.launcher.close()

    def close(self) -> None:
        """The processes are gone and the caller's endpoint closed: close the launcher (if
        :meth:`close_launcher` did not), sweep the run's relay memory, remove the runtime
        directory."""
        self.close_launcher()
        if self.plan and self.run_id:
            for relay_name in {e.relay for e in self.plan.edges if e.relay != OBJECT_RELAY}:
                try:
                    self.registry.resolve("relay", relay_name).sweep(self.run_id)
                except Exception:
                    self.log.exception("relay sweep failed", relay=relay_name)
        if self.runtime_dir:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
