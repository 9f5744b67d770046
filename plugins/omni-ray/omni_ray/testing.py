"""What tests on a Ray cluster use: a local multi-node cluster, the actors still alive (public
state API), and the relay conformance kit's cross-node mode on Ray.

- :func:`local_cluster`: a head and worker nodes on this machine (``ray.cluster_utils.Cluster``,
  each node its own raylet), every worker with a custom resource naming it; the dashboard runs
  (the state API needs it). It shares nothing with another Ray on the machine: its own temp dir,
  ports chosen by binding, and no ``RAY_ADDRESS`` while it runs.
- :func:`live_actors`: ``ray.util.state.list_actors`` of the connected cluster (its address
  passed, never auto-detected) without the dead ones.
- :class:`RayCrossNodeConformance`: :class:`omni_core.testing.relay_conformance.
  CrossNodeRelayConformance` with the receiver and the ``doomed`` peer in Ray actors pinned (by
  custom resource) to two worker nodes, the sender in the test process (the driver, on the head).
  A network relay's tests::

      from omni_ray.testing import RayCrossNodeConformance

      class TestMyRelayAcrossNodes(RayCrossNodeConformance):
          relay_name = "my_relay"      # importable on the nodes (installed, or on PYTHONPATH)

  With Ray not yet connected, the class starts :func:`local_cluster` for itself; connected to a
  cluster whose worker nodes carry ``node_resources``, it uses that one.

Importing this module imports the conformance kit (pytest, torch), not Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from omni_core.testing.peer import PeerError, PeerState, resolve_relay
from omni_core.testing.relay_conformance import CrossNodeRelayConformance

#: The custom resources of the worker nodes of :func:`local_cluster`.
NODES = ("node_a", "node_b")
STORE = 100 * 2**20
#: What points Ray's auto-detection at a cluster (unset while :func:`local_cluster` runs).
_RAY_ENV = ("RAY_TMPDIR", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")


def free_port() -> int:
    """A tcp port nobody listens on now (for Ray's own ports: they are not chosen by binding)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_cluster(
    nodes: Sequence[str] = NODES,
    *,
    head_resources: dict[str, float] | None = None,
    head_cpus: int = 2,
    node_cpus: int = 4,
    namespace: str = "omni-test",
) -> Iterator[Any]:
    """A head and one worker node per name in ``nodes`` (custom resource ``{name: 4}``) on this
    machine, the calling process connected as the driver; ``cluster.node_ids`` maps ``head`` and
    every name to its Ray node id. Small on purpose: logical CPUs, 100 MiB object stores. Shut
    down (driver disconnected, every raylet stopped) on exit, failure included.

    Another Ray instance on the machine is left alone and never found: while the cluster runs,
    ``RAY_TMPDIR`` is a private folder (Ray writes and, at shutdown, deletes its "current
    cluster" file there, not in the machine's ``/tmp/ray``) and ``RAY_ADDRESS`` /
    ``RAY_API_SERVER_ADDRESS`` are unset; every port is chosen by binding (the dashboard's from
    8265 up, the rest by the OS), none found free beforehand and bound later."""
    import ray
    from ray.cluster_utils import Cluster

    saved = {k: os.environ.pop(k, None) for k in _RAY_ENV}
    tmp = tempfile.mkdtemp(prefix="omray", dir="/tmp")  # short: Ray's unix sockets live under it
    os.environ["RAY_TMPDIR"] = tmp
    cluster = None
    try:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": head_cpus,
                "resources": {"head": 4, **(head_resources or {})},
                "object_store_memory": STORE,
                "include_dashboard": True,
                "dashboard_port": None,
                "dashboard_agent_listen_port": None,
            },
        )
        for name in nodes:
            cluster.add_node(num_cpus=node_cpus, resources={name: 4}, object_store_memory=STORE)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace=namespace, log_to_driver=False)
        cluster.node_ids = node_ids(("head", *nodes))
        yield cluster
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def node_ids(resources: Sequence[str]) -> dict[str, str]:
    """Custom resource → the id of the live node that has it (the connected cluster)."""
    import ray

    ids = {}
    for node in ray.nodes():
        if node.get("Alive"):
            for name in resources:
                if name in node["Resources"]:
                    ids[name] = node["NodeID"]
    return ids


def cluster_address() -> str:
    """The GCS address of the cluster this process is connected to, for every Ray call that would
    otherwise auto-detect one (the state API, the CLI): with another Ray on the machine,
    auto-detection finds the latest ``ray start``, not necessarily this one."""
    import ray

    if not ray.is_initialized():
        raise RuntimeError("not connected to a Ray cluster: call ray.init(address=...) or use local_cluster() first")
    return ray.get_runtime_context().gcs_address


def live_actors(**filters: str) -> list[Any]:
    """The connected cluster's actors that are not dead (``ray.util.state.list_actors`` with the
    cluster's address), e.g. ``live_actors(ray_namespace="omni")``."""
    from ray.util.state import list_actors

    wanted = [("state", "!=", "DEAD"), *((k, "=", v) for k, v in filters.items())]
    return list_actors(address=cluster_address(), filters=wanted, limit=10_000, raise_on_missing_output=False)


def wait_until(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns a truthy value (returned); AssertionError after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


# -- a relay peer in a Ray actor -------------------------------------------------------------------


class PeerActor:
    """The body of a peer actor: the relay and an event loop, running commands like
    :class:`omni_core.testing.peer.RelayPeer`'s process."""

    def __init__(self, relay_ref: Any, ctx: Any):
        import torch

        torch.set_num_threads(1)
        self.made_dir = None
        if not os.path.isdir(ctx.runtime_dir):  # another machine: the run's dir is made here
            os.makedirs(ctx.runtime_dir, mode=0o700, exist_ok=True)
            self.made_dir = ctx.runtime_dir
        self.loop = asyncio.new_event_loop()
        self.state = PeerState(resolve_relay(relay_ref)(ctx), self.loop)

    def where(self) -> dict[str, Any]:
        import ray

        return {
            "node": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
        }

    def call(self, fn: Callable[..., Any], args: tuple) -> Any:
        import inspect

        result = fn(self.state, *args)
        if inspect.isawaitable(result):
            result = self.loop.run_until_complete(result)
        return result

    def close(self) -> None:
        try:
            self.state.close()
        finally:
            self.loop.close()
            if self.made_dir:
                shutil.rmtree(self.made_dir, ignore_errors=True)


def _sweep(relay_ref: Any, run_id: str) -> list[str]:
    return resolve_relay(relay_ref).sweep(run_id)


class RayRelayPeer:
    """A relay in a Ray actor on the node that has custom resource ``resource``; the methods of
    :class:`omni_core.testing.peer.RelayPeer`, plus ``node`` (Ray node id) and ``ip``."""

    def __init__(self, actor: Any, where: dict[str, Any], resource: str):
        self.actor = actor
        self.node, self.ip, self.pid = where["node"], where["ip"], where["pid"]
        self.resource = resource

    @classmethod
    def start(cls, relay: Any, ctx: Any, resource: str, *, timeout: float = 120) -> RayRelayPeer:
        import ray

        remote = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=1)(PeerActor)
        actor = remote.options(
            resources={resource: 0.01}, name=f"relay-peer:{ctx.run_id}:{ctx.process}"
        ).remote(relay, ctx)
        try:
            where = ray.get(actor.where.remote(), timeout=timeout)
        except Exception as exc:
            ray.kill(actor, no_restart=True)
            raise PeerError(
                f"relay peer {ctx.process!r} did not start on the node with {resource!r}: {exc}"
            ) from None
        return cls(actor, where, resource)

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = 30) -> Any:
        import ray

        try:
            return ray.get(self.actor.call.remote(fn, args), timeout=timeout)
        except ray.exceptions.RayTaskError as exc:
            raise PeerError(f"relay peer command failed:\n{exc}") from None
        except ray.exceptions.RayActorError as exc:
            raise PeerError(f"relay peer died: {exc}") from None

    async def acall(self, fn: Callable[..., Any], *args: Any, timeout: float = 30) -> Any:
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.call(fn, *args, timeout=timeout)
        )

    def alive(self) -> bool:
        import ray

        try:
            ray.get(self.actor.where.remote(), timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False
        return True

    def kill(self) -> None:
        """End the actor's process at once (a crash: its relay never closes); wait until Ray
        reports it dead."""
        import ray

        ray.kill(self.actor, no_restart=True)
        wait_until(lambda: not self.alive(), 30, f"the peer actor on {self.resource} to die")

    def stop(self, timeout: float = 30) -> int:
        """Close the relay in the actor, then end the actor: 0 when it closed cleanly."""
        import ray

        code = 0
        try:
            ray.get(self.actor.close.remote(), timeout=timeout)
        except Exception:
            code = 1
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)
        wait_until(lambda: not self.alive(), 30, f"the peer actor on {self.resource} to die")
        return code


# -- the conformance kit across nodes ----------------------------------------------------------------


class RayCrossNodeConformance(CrossNodeRelayConformance):
    """The conformance kit across Ray nodes (see the module docstring). ``node_resources``: the
    custom resources of the receiver's node and of the ``doomed`` peer's node (two nodes other
    than the driver's)."""

    node_resources: tuple[str, str] = NODES

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def ray_cluster(cls):
        """The connected Ray cluster, or a :func:`local_cluster` of this class's own."""
        import ray

        if ray.is_initialized():
            yield None
            return
        with local_cluster(cls.node_resources) as cluster:
            yield cluster

    @classmethod
    def this_node(cls) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    @classmethod
    def this_ip(cls) -> str:
        import ray

        return ray.util.get_node_ip_address()

    @classmethod
    def spawn_peer(cls, ctx: Any) -> RayRelayPeer:
        receiver, doomed = cls.node_resources
        return RayRelayPeer.start(
            cls.relay_ref(), ctx, receiver if ctx.process == "receiver" else doomed
        )

    @classmethod
    def sweep_after_crash(cls, peer: RayRelayPeer, run_id: str) -> None:
        import ray
        from omni_core.relay.base import Relay

        if resolve_relay(cls.relay_ref()).sweep.__func__ is Relay.sweep.__func__:
            return  # nothing to sweep: spare the node a worker process
        task = ray.remote(num_cpus=0)(_sweep).options(resources={peer.resource: 0.01})
        ray.get(task.remote(cls.relay_ref(), run_id), timeout=60)
