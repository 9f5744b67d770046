"""The typed contracts between omni-core and its plugins, in one place (:mod:`omni_core.hookspecs`
cites them):

- :class:`Register`: the ``register`` callback every ``omni_register_*`` hook receives;
- :class:`Launcher` and :class:`ProcessHandle`: what a launcher registered with
  ``omni_register_launchers`` is and returns, its optional capabilities explicit (methods with a
  default that means "not used") rather than probed for; :class:`Bootstrap`: what it is handed
  per process;
- :class:`ApiFactory`: what an API registered with ``omni_register_apis`` is;
- relays have theirs in :class:`omni_core.relay.Relay` (an ABC) and
  :class:`omni_core.relay.RelayCapabilities`; stage factories and wiring functions are plain
  callables, described in :mod:`omni_core.hookspecs`.

This module imports nothing of the runtime (the plan's types only for type checkers), so a
plugin can subclass :class:`Launcher` without importing torch or zmq.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .capabilities import RelayCapabilities
    from .errors import ConfigIssue
    from .plan.topology import Plan, ProcessSpec

import attrs

from .errors import PluginError

__all__ = ["ApiFactory", "Bootstrap", "Launcher", "ProcessHandle", "Register", "launcher_class"]


@attrs.frozen
class Bootstrap:
    """Everything a stage process needs, which a :class:`Launcher` is handed and sends it (picklable).

    ``generation`` counts the restarts of the process's group: a restarted TP group meets at a
    fresh rendezvous. A restarted process starts knowing which requests already ended (``floor``:
    every request below it; ``ended``: those at or above it), so it drops what its predecessor
    was sent for them and runs no request whose caller was told it failed."""

    run_id: str
    runtime_dir: str
    config: dict[str, Any]
    process: ProcessSpec
    addresses: dict[str, str]
    routes: dict[str, list[str]]
    edge_relays: dict[tuple[str, str, str], str]
    env: dict[str, str]
    parent_pid: int
    followers: tuple[str, ...] = ()
    cwd: str | None = None
    generation: int = 0
    floor: int = 0
    ended: tuple[int, ...] = ()
    #: The run's secret: every control message carries a MAC made with it (runtime.wire).
    secret: bytes = attrs.field(default=b"", repr=False)


class Register(Protocol):
    """The ``register`` callback of every ``omni_register_*`` hook::

        register(name, obj, *, description=None, kind=None, capabilities=None, options=None, check=None)

    ``obj`` is the object or a ``"package.module:attr"`` path imported on first use. ``kind``:
    functions only. ``capabilities``: relays only. ``options`` (an options schema, see
    :mod:`omni_core.options`): relays, placement strategies, launchers. ``check``: stage
    factories only. Anything else is refused with a :class:`omni_core.errors.PluginError`."""

    def __call__(
        self,
        name: str,
        obj: Any,
        *,
        description: str | None = None,
        kind: str | None = None,
        capabilities: RelayCapabilities | Mapping[str, Any] | None = None,
        options: Mapping[str, Any] | None = None,
        check: Callable[..., Iterable[ConfigIssue]] | str | None = None,
    ) -> None: ...


class ProcessHandle(abc.ABC):
    """One started stage process, as its launcher reports it to the runner."""

    #: The process's name in the plan.
    name: str

    @property
    @abc.abstractmethod
    def pid(self) -> int | None:
        """Its pid on its machine (None when not known)."""

    @property
    @abc.abstractmethod
    def sentinel(self) -> int:
        """A file descriptor in this process that becomes readable once the process ended."""

    @property
    @abc.abstractmethod
    def exitcode(self) -> int | None:
        """None while it runs; its exit status once ended (negative: killed by that signal)."""

    @abc.abstractmethod
    def terminate(self) -> None:
        """Ask it to stop (SIGTERM or the launcher's equivalent)."""

    @abc.abstractmethod
    def kill(self) -> None:
        """End it now (SIGKILL or the launcher's equivalent)."""

    @abc.abstractmethod
    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds for it to end."""

    # -- optional ----------------------------------------------------------------------------

    def describe_exit(self) -> str | None:
        """A sentence on how it ended (where it ran, the reason its launcher gives) that
        ``ProcessDied`` quotes; None (the default): the exit code says it all."""
        return None


class Launcher(abc.ABC):
    """Starts the planned stage processes and reports their liveness (``start``, ``close``);
    registered with ``omni_register_launchers``. The runner never knows which one it uses. The
    class is called with the config's ``launcher.options`` (a dict); it raises ConfigError for a
    bad one.

    The optional capabilities are methods whose default means "not used": a launcher that spans
    machines overrides :meth:`prepare` (and :meth:`plan_nodes` for ``omni plan --cluster``); one
    that reads a stage's ``launch:`` mapping overrides :meth:`validate_launch`.
    """

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:  # noqa: B027 - a launcher may take none
        """``options``: the config's ``launcher.options``."""

    @abc.abstractmethod
    def start(self, boot: Bootstrap) -> ProcessHandle:
        """Start one stage process that runs ``omni_core.runtime.child.main(boot)``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Called once the pipeline stopped (its processes have ended)."""

    # -- optional ----------------------------------------------------------------------------

    def prepare(self, plan: Plan, run_id: str, runtime_dir: str,
                endpoints: Any) -> tuple[Plan, dict[str, dict[str, str]]] | None:
        """Called once before any ``start``. A launcher that spans machines places every
        process, binds the inboxes that need tcp (:func:`omni_core.runtime.channel.bind_inbox`)
        and returns ``(plan, views)``: the plan with the edges that cross nodes marked
        (:func:`omni_core.plan.topology.place_on_nodes`) and the address map of the coordinator
        (key ``""``) and of each process (:func:`omni_core.plan.topology.endpoint_views`).
        None (the default): every process runs on this machine, over ipc."""
        return None

    @staticmethod
    def plan_nodes(plan: Plan, cluster: str | Mapping[str, Any] | None = None) -> Plan | None:
        """The plan with a node per process, for ``omni plan`` (``--cluster``: an inventory);
        None (the default): this launcher runs every process on this machine."""
        return None

    @staticmethod
    def validate_launch(launch: Mapping[str, Any], path: str) -> list[ConfigIssue]:
        """The issues of one stage's ``launch:`` mapping (at ``path``, e.g.
        ``stages[0].launch``); the default ignores it."""
        return []


def launcher_class(obj: Any, name: str) -> type[Launcher]:
    """``obj``, what launcher ``name`` resolved to, checked to be a :class:`Launcher` class."""
    if isinstance(obj, type) and issubclass(obj, Launcher):
        return obj
    raise PluginError(f"launcher {name!r} is {obj!r}, not a subclass of omni_core.contracts.Launcher; "
                      "its plugin must derive its launcher class from it (start, close; optionally "
                      "prepare, plan_nodes, validate_launch)")


class ApiFactory(Protocol):
    """An HTTP API ``omni serve`` can mount (``omni_register_apis``): called once in the server
    process with an :class:`omni_core.serve.ApiContext` once the pipeline runs, it returns
    Starlette routes (a list of routes, a ``Router``) or a FastAPI ``APIRouter``."""

    def __call__(self, api: Any) -> Any: ...
