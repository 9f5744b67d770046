"""``omni plugins check``: what is wrong with an installed plugin distribution, found by loading it
the way omni does, in a fresh process per distribution (``python -m omni_core.plugin_check DIST``
prints the problems as JSON; :func:`check_in_subprocess` runs that).

Checks, per plugin of the distribution: it imports and its hooks register without error; every
name it registers is namespaced by the plugin (``NAME`` or ``NAME.…``); lazily registered
(``"pkg.mod:attr"``) objects import; functions' signatures fit their kind; pipelines validate;
relays are Relay classes with declared capabilities (matching the class's) and an options
schema, a ``sweep`` that takes ``dry_run``, and pass a smoke round of the conformance kit;
placement strategies take one request, launchers are classes and API factories are callable.
A pipeline or API name outside the namespace is a warning (users type those names), any other
an error.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import attrs

from .plugins import CORE_DISTRIBUTION, PluginInfo, Plugins, load_plugins
from .registry import FUNCTION_KINDS, KIND_LABELS, Entry, normalize_distribution

#: How many positional arguments omni passes to each function kind (see hookspecs).
FUNCTION_ARITY = {"route": 2, "merge": 1, "wait_for": 3, "stream_done": 2, "project_payload": 1,
                  "project_stream": 1, "terminal_stages": 1}
_SIGNATURES = {"route": "fn(request_id, payload)", "merge": "fn(payloads)",
               "wait_for": "fn(request_id, from_stage, payload)", "stream_done": "fn(request_id, payload)",
               "project_payload": "fn(payload)", "project_stream": "fn(chunk)",
               "terminal_stages": "fn(inputs)"}


@attrs.frozen
class Problem:
    """One thing to fix: which plugin (id), which registered name (``""``: the plugin itself),
    what is wrong and how to fix it. ``severity`` is ``error`` or ``warning``."""

    plugin: str
    name: str
    problem: str
    fix: str
    severity: str = "error"

    def to_dict(self) -> dict[str, str]:
        return attrs.asdict(self)


def installed_distributions() -> list[str]:
    """omni-core (its built-ins are registered from code) and every distribution that declares
    ``omni`` entry points, omni-core first."""
    from importlib import metadata

    dists = {normalize_distribution(ep.dist.name) for ep in metadata.entry_points(group="omni") if ep.dist}
    return sorted(dists | {CORE_DISTRIBUTION}, key=lambda d: (d != CORE_DISTRIBUTION, d))


def _namespaces(info: PluginInfo) -> set[str]:
    names = {info.name}
    if info.distribution:
        short = normalize_distribution(info.distribution).removeprefix("omni-").removesuffix("-omni")
        names.add(short.replace("-", "_"))
    return names


def _namespaced(name: str, spaces: set[str]) -> bool:
    return any(name == ns or name.startswith(ns + ".") for ns in spaces)


def _entries(plugins: Plugins, info: PluginInfo) -> Iterator[Entry]:
    for kind, names in info.registered.items():
        for name in names:
            yield plugins.registry.get(kind, name)


def _load(entry: Entry, pid: str, out: list[Problem]) -> Any:
    try:
        return entry.load()
    except Exception as exc:
        out.append(Problem(pid, entry.name, str(exc),
                           f"fix the dotted path {entry.target!r} in the plugin's register() call, or the "
                           "module it names (a missing dependency belongs in the distribution's dependencies)"))
        return None


def _check_function(entry: Entry, obj: Any, pid: str, out: list[Problem]) -> None:
    n = FUNCTION_ARITY[entry.kind]
    try:
        inspect.signature(obj).bind(*([None] * n))
    except TypeError as exc:
        out.append(Problem(pid, entry.name, f"{KIND_LABELS[entry.kind]} cannot be called as "
                           f"{_SIGNATURES[entry.kind]}: {exc}",
                           f"give it the signature {_SIGNATURES[entry.kind]} (see omni_core.hookspecs)"))
    except ValueError:  # no signature (a builtin): nothing to check
        pass


def _check_pipeline(entry: Entry, plugins: Plugins, pid: str, out: list[Problem]) -> None:
    from .config import load_config
    from .errors import ConfigError, PluginError

    try:
        load_config(entry.name, registry=plugins.registry)
    except ConfigError as exc:
        for issue in exc.issues:
            out.append(Problem(pid, entry.name, f"invalid pipeline: {issue}", "fix the pipeline config the plugin ships"))
    except (PluginError, OSError, ValueError) as exc:
        out.append(Problem(pid, entry.name, f"the pipeline cannot be loaded: {exc}",
                           "register a mapping, a file path or a 'package:file.yaml' the package ships"))


def _check_relay(entry: Entry, obj: Any, pid: str, out: list[Problem], smoke: bool) -> None:
    from .relay.base import Relay

    if not (inspect.isclass(obj) and issubclass(obj, Relay)):
        out.append(Problem(pid, entry.name, f"the relay is a {type(obj).__name__}, not a subclass of omni_core.relay.Relay",
                           "register a class deriving from omni_core.relay.Relay"))
        return
    missing = sorted(m for m in getattr(obj, "__abstractmethods__", ()))
    if missing:
        out.append(Problem(pid, entry.name, f"the relay class does not implement {', '.join(missing)}",
                           "implement put() and get() (see docs/relays.md)"))
        return
    caps = entry.capabilities
    if caps is None:
        out.append(Problem(pid, entry.name, "no capabilities declared at registration: relay 'auto' never picks it",
                           "pass capabilities={'devices': [...], 'scopes': [...], 'priority': n} to register()"))
    elif "capabilities" in _class_attrs(obj) and obj.capabilities != caps:
        out.append(Problem(pid, entry.name, f"the class declares capabilities {obj.capabilities.to_dict()} but the "
                           f"registration says {caps.to_dict()}",
                           "declare them once (e.g. a CAPABILITIES constant in the plugin module) and use it in both places"))
    if entry.options is None:
        out.append(Problem(pid, entry.name, "no options schema declared at registration: its options cannot be validated "
                           "before a pipeline starts", "pass options={...: omni_core.options.Option(...)} to register() "
                           "(options={} when it takes none)"))
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(obj.sweep).parameters
    except (TypeError, ValueError):
        params = {}
    if "dry_run" not in params:
        out.append(Problem(pid, entry.name, "sweep() does not accept dry_run: `omni clean --dry-run` cannot report what "
                           "it would remove", "define `def sweep(cls, run_id=None, *, dry_run=False) -> list[str]`"))
    if smoke and caps is not None and not out_for(out, entry.name):
        _smoke(entry, obj, caps, pid, out)


def _class_attrs(cls: type) -> set[str]:
    from .relay.base import Relay

    return {name for klass in cls.__mro__ if klass not in (Relay, object) for name in vars(klass)}


def out_for(out: list[Problem], name: str) -> bool:
    return any(p.name == name and p.severity == "error" for p in out)


def _smoke(entry: Entry, cls: Any, caps: Any, pid: str, out: list[Problem]) -> None:
    """One round of the conformance kit: a put in this process, a get and release in a spawned
    receiver, close on both sides, nothing left in /dev/shm or the runtime dir."""
    if "cpu" not in caps.devices:
        import torch

        if not torch.cuda.is_available():
            out.append(Problem(pid, entry.name, "smoke round skipped: the relay moves CUDA tensors only and this "
                               "machine has no CUDA device", "run `omni plugins check` on a GPU machine", "warning"))
            return
    try:
        problem = smoke_round(cls, "cpu" if "cpu" in caps.devices else "cuda")
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}"
    if problem:
        out.append(Problem(pid, entry.name, f"conformance smoke round failed: {problem}",
                           "run the relay conformance kit (omni_core.testing.relay_conformance) against it"))


def smoke_round(cls: Any, device: str = "cpu") -> str | None:
    """Put, get, release and close one small transfer between this process and a spawned peer;
    the reason it failed, or None."""
    import asyncio
    import uuid

    import torch

    from .relay.base import RelayContext
    from .testing import peer as cmd
    from .testing.relay_conformance import open_relay_fds, remove_leaked, runtime_files

    run_id = f"check{os.getpid()}x{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory(prefix="omni-check-") as runtime_dir:
        receiver = cmd.RelayPeer.start(cls, RelayContext(run_id, "receiver", runtime_dir, {}))
        try:
            sender = cls(RelayContext(run_id, "sender", runtime_dir, {}))
            sent = torch.arange(12, dtype=torch.float32, device=device).reshape(3, 4)

            async def once():
                transfer = await sender.put(1, [sent], "receiver")
                frames = [bytearray(memoryview(f)) for f in transfer.frames]
                return await receiver.acall(cmd.get_records, bytes(transfer.handle), frames, True)

            try:
                records = asyncio.run(asyncio.wait_for(once(), 60))
            finally:
                sender.close()
            if [tuple(r[:3]) for r in records] != [cmd.tensor_record(sent.cpu())]:
                return "the tensor that arrived differs from the one put"
        finally:
            code = receiver.stop()
        if code != 0:
            return f"the receiver process exited with {code} after close()"
        leaked = remove_leaked(run_id)
        if leaked:
            return f"/dev/shm entries left after close(): {leaked}"
        if open_relay_fds(runtime_dir):
            return f"file descriptors left open after close(): {open_relay_fds(runtime_dir)}"
        files = runtime_files(runtime_dir)
        if files:
            return f"files left in the runtime dir after close(): {sorted(files)}"
    return None


#: Kinds whose names users type (``omni run demo``, ``omni serve --api openai``): a short,
#: well-known name outside the plugin's namespace is a warning there, an error elsewhere.
USER_FACING_KINDS = frozenset({"pipeline", "api", "family"})


def _check_entry(entry: Entry, plugins: Plugins, info: PluginInfo, out: list[Problem], smoke: bool) -> None:
    pid = info.id
    if not info.builtin and not _namespaced(entry.name, _namespaces(info)):
        spaces = " or ".join(sorted(_namespaces(info)))
        out.append(Problem(pid, entry.name, f"{KIND_LABELS[entry.kind]} {entry.name!r} is not namespaced by the plugin",
                           f"rename it {info.name}.{entry.name} (names start with {spaces}), so it cannot clash "
                           "with another plugin's", "warning" if entry.kind in USER_FACING_KINDS else "error"))
    if entry.kind == "pipeline":
        _check_pipeline(entry, plugins, pid, out)
        return
    obj = _load(entry, pid, out)
    if obj is None:
        return
    if entry.kind in FUNCTION_KINDS:
        _check_function(entry, obj, pid, out)
    elif entry.kind == "stage" and not callable(obj):
        out.append(Problem(pid, entry.name, "the stage factory is not callable", "register a class or a function returning a stage"))
    elif entry.kind == "relay":
        _check_relay(entry, obj, pid, out, smoke)
    elif entry.kind == "placement":
        try:
            inspect.signature(obj).bind(None)
        except TypeError as exc:
            out.append(Problem(pid, entry.name, f"the placement strategy cannot be called as fn(request): {exc}",
                               "give it the signature fn(request: omni_core.plan.PlacementRequest)"))
        except ValueError:
            pass
    elif entry.kind == "launcher" and not inspect.isclass(obj):
        out.append(Problem(pid, entry.name, "the launcher is not a class", "register a class implementing the launcher protocol"))
    elif entry.kind == "family" and entry.meta.get("pipeline") not in plugins.registry.names("pipeline"):
        out.append(Problem(pid, entry.name, f"the model family's pipeline {entry.meta.get('pipeline')!r} is not registered",
                           "register that pipeline (omni_register_pipelines) or name a registered one in pipeline="))
    elif entry.kind == "api" and not callable(obj):
        out.append(Problem(pid, entry.name, f"the API factory is a {type(obj).__name__}, not callable",
                           "register a function fn(api: omni_core.serve.ApiContext) returning Starlette routes"))


def check_distribution(distribution: str, *, smoke: bool = True) -> list[Problem]:
    """Every problem of the installed ``distribution``'s plugins, in this process."""
    dist = normalize_distribution(distribution)
    env = {k: v for k, v in os.environ.items() if k not in ("OMNI_LOAD_PLUGINS", "OMNI_DISABLED_PLUGINS")}
    plugins = load_plugins(env={**env, "OMNI_LOAD_PLUGINS": "" if dist == CORE_DISTRIBUTION else dist})
    mine = [i for i in plugins.infos if i.distribution and normalize_distribution(i.distribution) == dist]
    if not mine:
        return [Problem(dist, "", f"distribution {distribution!r} declares no omni plugin (or is not installed)",
                        "pip install it, and declare its module under [project.entry-points.omni] in pyproject.toml")]
    out: list[Problem] = []
    for info in mine:
        if info.error:
            out.append(Problem(info.id, "", info.error, _error_fix(info)))
            continue
        if not any(info.registered.values()):
            out.append(Problem(info.id, "", "the plugin registers nothing",
                               "implement an omni_register_* hook marked with @omni_core.hookimpl", "warning"))
        for entry in _entries(plugins, info):
            _check_entry(entry, plugins, info, out, smoke)
    return out


def _error_fix(info: PluginInfo) -> str:
    text = info.error or ""
    if text.startswith(("ModuleNotFoundError", "ImportError")):
        return f"the module {info.module} (entry point {info.name}) does not import: add the missing dependency to the distribution or fix the entry point"
    if "unknown hook" in text or "looks like a hook" in text:
        return "rename or mark the function: hooks are listed in omni_core.hookspecs"
    if text.startswith("name conflict"):
        return "rename the clashing names into the plugin's namespace"
    return "fix the hook: a plugin that fails registers nothing"


def check_in_subprocess(distribution: str, *, smoke: bool = True, timeout: float = 300) -> list[Problem]:
    """:func:`check_distribution` in a fresh interpreter (nothing another plugin imported leaks in)."""
    cmd = [sys.executable, "-m", "omni_core.plugin_check", distribution] + ([] if smoke else ["--no-smoke"])
    env = {**os.environ, "OMNI_LOG_LEVEL": os.environ.get("OMNI_LOG_LEVEL", "WARNING")}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return [Problem(distribution, "", f"checking took more than {timeout:g} s", "look for a hook or import that hangs")]
    try:
        return [Problem(**p) for p in json.loads(done.stdout.strip().splitlines()[-1])]
    except (ValueError, IndexError, TypeError):
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        return [Problem(distribution, "", f"the check process failed (exit {done.returncode}): {tail[0]}",
                        "run `python -m omni_core.plugin_check " + distribution + "` to see the traceback")]


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    smoke = "--no-smoke" not in args
    args = [a for a in args if a != "--no-smoke"]
    problems = [p for dist in args for p in check_distribution(dist, smoke=smoke)]
    sys.stdout.flush()
    print(json.dumps([p.to_dict() for p in problems]))


if __name__ == "__main__":
    main()
