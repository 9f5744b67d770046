"""Launcher ``ray``: every process of the plan in a Ray actor.

Who owns what:

- The launcher owns the actors and the placement groups. Actors are never detached: Ray ties them
  to the driver, so the driver's death (even a SIGKILL) ends them; ``close()`` (stop, failed
  start) kills every one and waits until Ray reports it dead.
- :meth:`RayLauncher.prepare` creates one actor per process (TP ranks of one replica in one
  placement group, one bundle per rank), learns the node of each, and binds the inboxes that need
  tcp (a sender on another node) on the node itself: the port is chosen by binding, so there is no
  race. It returns each process's view of the addresses (ipc to peers on its node, tcp to others).
- :meth:`RayLauncher.start` hands the process's ``Bootstrap`` to its actor, whose ``run`` calls
  the stage host (``omni_core.runtime.child.main``) on the actor's main thread. The handle watches
  that call: it ends when the host returns, or fails when Ray declares the actor dead (its
  process killed, ``ray.kill``, its node gone); the handle's sentinel becomes readable at once.
- CurveZMQ keys are generated per run in the driver and reach the actors as constructor
  arguments (through Ray), never on a command line or in an environment.

Importing this module does not import Ray (config validation loads the class).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Mapping
from typing import Any

import attrs
from omni_core.contracts import Launcher, ProcessHandle
from omni_core.errors import ConfigError, ConfigIssue, StartupError
from omni_core.runtime.channel import CurveKeys, bind_inbox, forget_trust, release_inboxes, trust

from .placement import ActorRequest, actor_request

#: The launcher's options (``launcher.options``).
OPTIONS = ("address", "namespace", "runtime_env", "placement_strategy")
#: The keys of a stage's ``launch:`` mapping.
LAUNCH_KEYS = ("resources", "num_cpus", "num_gpus", "placement_strategy")
STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
#: Hosts that cannot be reached from another machine: tcp inboxes bind the node's IP instead.
_LOCAL_HOSTS = ("127.0.0.1", "localhost", "0.0.0.0", "::", "::1", "")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def validate_launch(launch: Mapping[str, Any], path: str) -> list[ConfigIssue]:
    """The issues of one stage's ``launch:`` mapping under launcher ``ray``."""
    issues = []
    for key, value in launch.items():
        where = f"{path}.{key}"
        if key not in LAUNCH_KEYS:
            issues.append(ConfigIssue(where, f"unknown launch option {key!r} for launcher 'ray'",
                                      f"known: {', '.join(LAUNCH_KEYS)}"))
        elif key == "resources":
            if not isinstance(value, Mapping) or not all(isinstance(k, str) and _number(v) for k, v in value.items()):
                issues.append(ConfigIssue(where, f"expected a mapping of Ray resource name to amount, got {value!r}",
                                          "e.g. 'resources: {node_a: 1}'"))
            else:
                for name in ("CPU", "GPU"):
                    if name in value:
                        issues.append(ConfigIssue(f"{where}.{name}", f"{name} is not a custom resource",
                                                  f"use 'launch: {{num_{name.lower()}s: ...}}'"))
        elif key in ("num_cpus", "num_gpus"):
            if not _number(value):
                issues.append(ConfigIssue(where, f"expected a number >= 0, got {value!r}"))
        elif key == "placement_strategy" and value not in STRATEGIES:
            issues.append(ConfigIssue(where, f"unknown placement group strategy {value!r}", f"known: {', '.join(STRATEGIES)}"))
    return issues


class StageActor:
    """The body of every actor (wrapped with ``ray.remote`` by the launcher)."""

    def __init__(self, name: str, keys: CurveKeys | None):
        self.name = name
        self.keys = keys
        self.made_dir: str | None = None

    def where(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"node": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "gpus": [str(g) for g in ray.get_gpu_ids()]}

    def bind(self, runtime_dir: str, ipc: str, host: str | None, port_range: tuple[int, int] | None,
             tcp: str | None, needs_tcp: bool) -> str | None:
        """Make the run's private directory on this node when it is not there (another machine),
        and bind the inbox with tcp when a sender is on another node."""
        if not os.path.isdir(runtime_dir):
            os.makedirs(runtime_dir, mode=0o700, exist_ok=True)
            self.made_dir = runtime_dir
        if not needs_tcp:
            return None
        import ray

        host = ray.util.get_node_ip_address() if host in _LOCAL_HOSTS else host
        return bind_inbox(ipc, keys=self.keys, host=host, port_range=port_range, tcp=tcp)

    def run(self, boot: Any) -> int:
        """Run the stage host; its exit status."""
        from omni_core.runtime.child import main

        trust(list(boot.addresses.values()), self.keys)
        try:
            main(_for_actor(boot))
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else 1
        finally:
            if self.made_dir:
                shutil.rmtree(self.made_dir, ignore_errors=True)
        return 0


def _for_actor(boot: Any) -> Any:
    """The Bootstrap as this actor runs it. Ray owns the process's life (the actor dies with its
    driver), so the host watches its own pid instead of the driver's, which may be on another
    machine. The environment is the Ray worker's (with the driver's ``OMNI_*`` settings) under the
    config's, under what placement forces; a GPU process keeps the GPU Ray assigned to it. The
    working directory is the worker's (``runtime_env.working_dir`` decides it)."""
    spec = boot.process
    forced = dict(spec.forced_env)
    if spec.gpu is not None:
        forced.pop("CUDA_VISIBLE_DEVICES", None)
    omni = {k: v for k, v in boot.env.items() if k.startswith("OMNI_")}
    env = {**os.environ, **omni, **spec.env, **forced}
    return attrs.evolve(boot, parent_pid=os.getpid(), env=env, cwd=None)


def _short(node: str) -> str:
    return node[:12]


def _ray_reason(exc: BaseException) -> str:
    """Ray's explanation of an actor death, condensed to what a user needs."""
    import ray

    if isinstance(exc, ray.exceptions.RayTaskError):  # the actor's call raised: say what
        cause = exc.cause
        return f"the actor's run raised {type(cause).__name__}: {cause}"
    text = str(getattr(exc, "error_msg", "") or exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    keep = [lines[0]] if lines else [type(exc).__name__]
    keep += [line for line in lines[1:] if line.startswith(("The actor is dead because", "The actor died because"))]
    return " ".join(keep)


class RayHandle(ProcessHandle):
    """A process running in an actor; liveness through Ray."""

    def __init__(self, name: str, actor: Any, where: Mapping[str, Any], run_ref: Any):
        self.name = name
        self.actor = actor
        self.node = where["node"]
        self.ip = where["ip"]
        self._pid = where["pid"]
        self._exitcode: int | None = None
        self._reason: str | None = None
        self._done = threading.Event()
        self._read, self._write = os.pipe()
        self._thread = threading.Thread(target=self._watch, args=(run_ref,), name=f"omni-ray-watch-{name}", daemon=True)
        self._thread.start()

    def _watch(self, run_ref: Any) -> None:
        import ray

        try:
            code = ray.get(run_ref)
        except Exception as exc:
            code, self._reason = 1, _ray_reason(exc)
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)  # the host returned: end the actor's process too
        self._exitcode = code if isinstance(code, int) else 1
        self._done.set()
        os.close(self._write)

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def sentinel(self) -> int:
        return self._read

    @property
    def exitcode(self) -> int | None:
        return self._exitcode

    def describe_exit(self) -> str | None:
        if self._exitcode is None:
            return None
        where = f"on node {self.ip} ({_short(self.node)})"
        if self._reason:
            return f"{where}; Ray: {self._reason}"
        return f"exit code {self._exitcode} {where}"

    def terminate(self) -> None:
        # A sync actor runs the host on its main thread: Ray can only end it by killing it. The
        # runner sends Shutdown first, so this happens only to a process that did not answer.
        self.kill()

    def kill(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._read)


@attrs.define
class _Slot:
    """One process's actor and where it runs."""

    actor: Any
    request: ActorRequest
    where: dict[str, Any] = attrs.Factory(dict)
    pg: Any = None
    bundle: int = 0
    started: bool = False


class RayLauncher(Launcher):
    """``launcher: {name: ray, options: {address, namespace, runtime_env, placement_strategy}}``.

    ``address``: ``"auto"`` (the cluster this machine belongs to), ``"ray://host:port"`` (Ray
    client), a GCS address ``host:port``, or null: start a local Ray of the run's own (default;
    never another Ray that ``ray.init()`` would auto-detect on the machine). ``namespace``:
    the Ray namespace of the run's actors (default ``omni``). ``runtime_env``: passed to
    ``ray.init`` (e.g. ``{working_dir: ., pip: [...]}``). ``placement_strategy``: of TP groups'
    placement groups (``STRICT_PACK`` default). When Ray is already initialised in this process
    (an application or a test that connected itself) the launcher uses that connection and leaves
    it open."""

    validate_launch = staticmethod(validate_launch)

    def __init__(self, options: Mapping[str, Any] | None = None):
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ConfigError(f"launcher.options: unknown option(s) {', '.join(unknown)} for launcher 'ray' (known: {', '.join(OPTIONS)})")
        self.strategy = options.get("placement_strategy", "STRICT_PACK")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"launcher.options.placement_strategy: {self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        import ray

        self.options = options
        self._owns_ray = False
        self.keys = CurveKeys.generate()
        self.slots: dict[str, _Slot] = {}
        self.handles: list[RayHandle] = []
        self.pgs: list[Any] = []
        self.run_id = ""
        self.runtime_dir = ""
        self.ipc: dict[str, str] = {}
        self.tcp: dict[str, str] = {}
        self.needs_tcp: set[str] = set()
        self.host: str | None = None
        self.port_range: tuple[int, int] | None = None
        self.timeout = 120.0
        self._actor_cls = ray.remote(max_restarts=0, max_concurrency=1)(StageActor)

    @staticmethod
    def plan_nodes(plan: Any, cluster: str | Mapping[str, Any] | None = None) -> Any:
        """``plan`` with the node of every process and the edges that cross nodes, from a
        described inventory (``cluster``: a ``cluster.yaml`` path or mapping; else
        ``placement.options.cluster``; else this machine as the only node). Starts nothing: what
        ``omni plan --launcher ray [--cluster cluster.yaml]`` shows."""
        from omni_core.plan.topology import place_on_nodes
        from omni_core.plugins import get_registry

        from .placement import Inventory, Node, assign_nodes, load_inventory

        cluster = cluster if cluster is not None else plan.config.placement.options.get("cluster")
        if cluster is None:  # one node, sized for the plan like the local Ray the launcher starts
            inventory = Inventory((Node("local", float("inf"), len(plan.devices)),), "local")
        else:
            inventory = load_inventory(cluster)
        return place_on_nodes(plan, assign_nodes(plan, inventory), get_registry())

    # -- placement ---------------------------------------------------------------------------------

    def _options(self, name: str, slot: _Slot, *, node: str | None = None) -> dict[str, Any]:
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        req = slot.request
        opts: dict[str, Any] = {"num_cpus": req.num_cpus, "num_gpus": req.num_gpus, "name": f"omni:{self.run_id}:{name}"}
        if slot.pg is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(slot.pg, placement_group_bundle_index=slot.bundle)
        elif node is not None:
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        if req.resources and slot.pg is None:
            opts["resources"] = req.resources
        return opts

    def _placement_groups(self, plan: Any) -> dict[str, tuple[Any, int]]:
        """One placement group per TP replica, one bundle per rank: process name → (pg, bundle)."""
        import ray
        from ray.util.placement_group import placement_group

        out: dict[str, tuple[Any, int]] = {}
        replicas: dict[tuple[str, int], list[Any]] = {}
        for spec in plan.processes:
            if spec.tp_size > 1:
                replicas.setdefault((spec.group, spec.replica), []).append(spec)
        for (group, replica), ranks in replicas.items():
            bundles = []
            for spec in ranks:
                req = actor_request(plan, spec)
                bundle = {"CPU": req.num_cpus, **req.resources}
                if req.num_gpus:
                    bundle["GPU"] = req.num_gpus
                bundles.append({k: v for k, v in bundle.items() if v})
            strategy = plan.config.stage(ranks[0].stages[0]).launch.get("placement_strategy", self.strategy)
            pg = placement_group(bundles, strategy=strategy, name=f"omni:{self.run_id}:{group}#{replica}")
            self.pgs.append(pg)
            try:
                ray.get(pg.ready(), timeout=self.timeout)
            except ray.exceptions.GetTimeoutError:
                raise StartupError(
                    f"Ray could not reserve placement group {strategy} {bundles} for TP stage group {group!r} "
                    f"replica {replica} within {self.timeout:g} s: no node (or set of nodes) has those resources"
                ) from None
            for spec in ranks:
                out[spec.name] = (pg, spec.tp_rank)
        return out

    def prepare(self, plan: Any, run_id: str, runtime_dir: str, endpoints_cfg: Any) -> tuple[Any, dict[str, dict[str, str]]]:
        """Create the actors, learn their nodes, bind the tcp inboxes. Returns the plan with the
        edges that cross nodes marked (relays chosen for them) and every process's view of the
        addresses (see the module docstring)."""
        import ray
        from omni_core.plan.topology import endpoint_views, endpoints, place_on_nodes, tcp_receivers
        from omni_core.plugins import get_registry

        self._connect(plan)
        self.run_id, self.runtime_dir = run_id, runtime_dir
        self.timeout = plan.config.limits.startup_timeout
        self.host = endpoints_cfg.host
        self.port_range = tuple(endpoints_cfg.port_range) if endpoints_cfg.port_range else None
        pgs = self._placement_groups(plan)
        pinned = self._pinned_nodes(plan)
        for spec in plan.processes:
            slot = _Slot(None, actor_request(plan, spec))
            slot.pg, slot.bundle = pgs.get(spec.name, (None, 0))
            options = self._options(spec.name, slot, node=pinned.get(spec.name))
            slot.actor = self._actor_cls.options(**options).remote(spec.name, self.keys)
            self.slots[spec.name] = slot
        self._wait_scheduled(list(self.slots))
        nodes = {"": ray.get_runtime_context().get_node_id(), **{n: s.where["node"] for n, s in self.slots.items()}}
        plan = place_on_nodes(plan, nodes, get_registry())
        self.needs_tcp = tcp_receivers(plan, nodes)
        self.ipc = dict(endpoints(plan, runtime_dir))
        if "" in self.needs_tcp:
            host = ray.util.get_node_ip_address() if self.host in _LOCAL_HOSTS else self.host
            self.tcp[""] = bind_inbox(self.ipc[""], keys=self.keys, host=host, port_range=self.port_range)
        refs = {n: s.actor.bind.remote(runtime_dir, self.ipc[n], self.host, self.port_range, None, n in self.needs_tcp)
                for n, s in self.slots.items()}
        for name, address in zip(refs, ray.get(list(refs.values()), timeout=self.timeout), strict=True):
            if address is not None:
                self.tcp[name] = address
        trust(list(self.tcp.values()), self.keys)
        self.nodes = nodes
        return plan, endpoint_views(plan, runtime_dir, nodes, self.tcp)

    def _connect(self, plan: Any) -> None:
        """Connect to the cluster (``address``), or start a local Ray with enough logical CPUs for
        the plan (``address: null``); keep a connection this process already has. Null is Ray's
        ``"local"``: a plain ``ray.init()`` would join the latest ``ray start`` on the machine
        (or ``RAY_ADDRESS``) instead of starting one."""
        import ray

        if ray.is_initialized():
            return
        address = self.options.get("address")
        extra = {}
        if address is None:
            need = sum(actor_request(plan, spec).num_cpus for spec in plan.processes)
            extra = {"num_cpus": max(float(os.cpu_count() or 1), need), "include_dashboard": False}
            address = "local"
        ray.init(address=address, namespace=self.options.get("namespace", "omni"),
                 runtime_env=self.options.get("runtime_env"), **extra)
        self._owns_ray = True

    @staticmethod
    def _pinned_nodes(plan: Any) -> dict[str, str]:
        """Under placement ``ray``: process name → Ray node id from the live cluster's inventory
        (:func:`omni_ray.placement.assign_nodes`); the actors are pinned there. Otherwise Ray's
        scheduler chooses within each stage's ``launch:`` request."""
        if plan.config.placement.strategy != "ray":
            return {}
        from .placement import assign_nodes, live_inventory

        inventory = live_inventory()
        ids = {n.name: n.node_id for n in inventory.nodes}
        return {name: ids[node] for name, node in assign_nodes(plan, inventory).items() if name}

    def _wait_scheduled(self, names: list[str]) -> None:
        """Wait until Ray placed the actors of ``names`` (their ``where`` answered)."""
        import ray

        refs = {self.slots[n].actor.where.remote(): n for n in names}
        ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=self.timeout)
        if pending:
            late = [refs[r] for r in pending]
            wanted = "; ".join(f"{n}: {attrs.asdict(self.slots[n].request)}" for n in late)
            raise StartupError(
                f"Ray did not place process(es) {', '.join(map(repr, late))} within limits.startup_timeout ({self.timeout:g} s): "
                f"no node has the resources they ask for ({wanted}); check 'ray status' and the stages' launch: mappings"
            )
        for ref in ready:
            try:
                self.slots[refs[ref]].where = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                raise StartupError(f"the actor of process {refs[ref]!r} died before it started: {_ray_reason(exc)}",
                                   process=refs[ref]) from None

    # -- processes -----------------------------------------------------------------------------------

    def start(self, boot: Any) -> RayHandle:
        name = boot.process.name
        slot = self.slots[name]
        if slot.started:
            slot = self._replace(name)
        slot.started = True
        handle = RayHandle(name, slot.actor, slot.where, slot.actor.run.remote(boot))
        self.handles.append(handle)
        return handle

    def _replace(self, name: str) -> _Slot:
        """A new actor for a restarted process: on the node of the one it replaces (its peers
        know its addresses), bound to the same addresses."""
        import ray

        old = self.slots[name]
        with contextlib.suppress(Exception):
            ray.kill(old.actor, no_restart=True)
        slot = _Slot(None, old.request, pg=old.pg, bundle=old.bundle)
        slot.actor = self._actor_cls.options(**self._options(name, slot, node=old.where["node"])).remote(name, self.keys)
        self.slots[name] = slot
        self._wait_scheduled([name])
        ray.get(slot.actor.bind.remote(self.runtime_dir, self.ipc[name], self.host, self.port_range,
                                       self.tcp.get(name), name in self.needs_tcp), timeout=self.timeout)
        return slot

    def close(self) -> None:
        """Kill every actor, wait until Ray reports each one dead, remove the placement groups."""
        import ray

        if not ray.is_initialized():
            return
        for slot in self.slots.values():
            with contextlib.suppress(Exception):
                ray.kill(slot.actor, no_restart=True)
        deadline = time.monotonic() + 30
        for handle in self.handles:
            handle.join(max(0.0, deadline - time.monotonic()))
            handle.close()
        unwatched = [s.actor for s in self.slots.values() if not any(h.actor is s.actor for h in self.handles)]
        _wait_dead(unwatched, deadline)
        from ray.util.placement_group import remove_placement_group

        for pg in self.pgs:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        self.slots.clear()
        self.pgs.clear()
        release_inboxes([a for a in (self.ipc.get(""), self.tcp.get("")) if a])
        forget_trust(self.keys)
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False


def _wait_dead(actors: list[Any], deadline: float) -> None:
    """Poll until each killed actor answers as dead (a call on it fails), up to ``deadline``."""
    import ray

    for actor in actors:
        while time.monotonic() < deadline:
            try:
                ray.get(actor.where.remote(), timeout=max(0.1, deadline - time.monotonic()))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                break
            except Exception:
                break
