"""Plugin discovery and loading.

omni-core's own built-ins (:data:`BUILTIN_PLUGINS`: its functions, launchers, placements and
relays) are registered from code, as pytest's default plugins are, so they are there even where the
distribution's entry points are missing: the runtime relies on them (the caller's edges use the
built-in ``inline`` relay). Every other plugin comes through the ``omni`` entry-point group.
Loading is idempotent and cheap, because it runs again in every process omni spawns.

A plugin is identified by its distribution and entry-point name, ``dist:name`` (``omni-core:
omni.relays``, ``omni-nccl:nccl``); omni-core's built-ins are named ``omni.*`` so they cannot
clash with a third-party entry point.

Environment (read when plugins load, not at import), each a comma-separated list of plugin ids
(``dist:name``), entry-point names or distribution names:

- ``OMNI_DISABLED_PLUGINS``: never load these. A built-in the runtime needs
  (:data:`REQUIRED_BUILTINS`: ``omni.relays``) loads anyway, with a warning that says why.
- ``OMNI_LOAD_PLUGINS``: load only these third-party plugins; omni-core's built-ins still load
  unless disabled. Set it empty to load no third-party plugin at all.

A name in either variable that matches no installed plugin is a warning with the closest one
(``Plugins.warnings``, shown by ``omni plugins list``).

A plugin that fails to import or to register is recorded with its distribution, entry point and
error, not raised: listing still works, and only using a name it would have provided fails.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import os
import traceback
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
from typing import Any

import attrs
import pluggy

from . import hookspecs
from .errors import PluginError
from .registry import (
    FUNCTION_KINDS,
    HOOK_KINDS,
    KIND_LABELS,
    KIND_SPECS,
    BrokenPlugin,
    Entry,
    Registry,
    is_dotted_path,
    normalize_distribution,
    signature_text,  # noqa: F401  (re-exported: omni_core.plugins.signature_text)
)

ENTRY_POINT_GROUP = "omni"
CORE_DISTRIBUTION = "omni-core"

#: omni-core's built-in plugins, ``(name, module)``, registered from code in this order.
BUILTIN_PLUGINS: tuple[tuple[str, str], ...] = (
    ("omni.functions", "omni_core.builtin.functions"),
    ("omni.launchers", "omni_core.builtin.launchers"),
    ("omni.placements", "omni_core.builtin.placements"),
    ("omni.relays", "omni_core.builtin.relays"),
)

#: Built-ins that OMNI_DISABLED_PLUGINS cannot turn off, with why: the runtime uses them.
REQUIRED_BUILTINS: dict[str, str] = {
    "omni.relays": "the caller's edges, splits and TP copies use its 'inline' relay",
}

hookimpl = pluggy.HookimplMarker("omni")

HOOK_NAMES: tuple[str, ...] = tuple(HOOK_KINDS)


@attrs.define
class PluginInfo:
    """What ``omni plugins list`` shows for one plugin."""

    name: str
    module: str
    distribution: str | None = None
    version: str | None = None
    hooks: list[str] = attrs.Factory(list)
    registered: dict[str, list[str]] = attrs.Factory(dict)
    error: str | None = None
    builtin: bool = False
    traceback: str | None = attrs.field(default=None, repr=False)

    @property
    def id(self) -> str:
        """``distribution:entry-point`` (just the name for a plugin that is not installed)."""
        return f"{normalize_distribution(self.distribution)}:{self.name}" if self.distribution else self.name

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "module": self.module,
            "distribution": self.distribution,
            "version": self.version,
            "builtin": self.builtin,
            "hooks": list(self.hooks),
            "registered": {kind: list(names) for kind, names in self.registered.items()},
            "error": self.error,
        }


@attrs.define
class Plugins:
    """The loaded plugin manager, what each plugin contributed, and the registry."""

    pm: pluggy.PluginManager
    infos: list[PluginInfo]
    registry: Registry

    warnings: list[str] = attrs.Factory(list)

    def info(self, name: str) -> PluginInfo:
        """The plugin ``name``: its id (``dist:name``) or, when only one has it, its entry-point name."""
        for info in self.infos:
            if info.id == name:
                return info
        found = [info for info in self.infos if info.name == name]
        if len(found) == 1:
            return found[0]
        if found:
            raise PluginError(f"more than one plugin is named {name!r}: {', '.join(i.id for i in found)}; use the id")
        guess = difflib.get_close_matches(name, self.names() + [i.id for i in self.infos], n=1)
        hint = f" (did you mean {guess[0]!r}?)" if guess else ""
        raise PluginError(f"no plugin named {name!r}{hint}; loaded: {', '.join(self.names())}")

    def names(self) -> list[str]:
        return [info.name for info in self.infos]


def _split_env(value: str | None) -> set[str] | None:
    """The names in an environment variable; a distribution part (``omni_nccl:nccl``, ``Omni_NCCL``)
    is also kept normalized, so every spelling pip accepts matches."""
    if value is None:
        return None
    out: set[str] = set()
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        out.add(part)
        dist, sep, name = part.rpartition(":")
        out.add(f"{normalize_distribution(dist)}:{name}" if sep else normalize_distribution(part))
    return out


def _selectors(ep_name: str, dist: str | None) -> set[str]:
    """What an environment variable may call this entry point: its id, name or distribution."""
    if not dist:
        return {ep_name}
    dist = normalize_distribution(dist)
    return {ep_name, dist, f"{dist}:{ep_name}"}


def _matches(selectors: set[str], wanted: set[str]) -> bool:
    return bool(selectors & wanted)


def _skip_reason(
    ep_name: str, dist: str | None, enabled: set[str] | None, disabled: set[str]
) -> str | None:
    """Why the environment keeps this entry point from loading (None: load it)."""
    names = _selectors(ep_name, dist)
    if _matches(names, disabled):
        return "disabled by OMNI_DISABLED_PLUGINS"
    if dist and normalize_distribution(dist) == CORE_DISTRIBUTION:
        return None
    if enabled is None or _matches(names, enabled):
        return None
    return "not listed in OMNI_LOAD_PLUGINS"


def _unknown_selectors(variable: str, value: str | None, known: list[set[str]]) -> list[str]:
    """Warnings for names in ``variable`` that match no plugin, with the closest known one."""
    everything = sorted(set().union(*known)) if known else []
    out = []
    for part in (p.strip() for p in (value or "").split(",")):
        if not part or any(_matches(sel, _split_env(part) or set()) for sel in known):
            continue
        guess = difflib.get_close_matches(part, everything, n=1)
        ids = ", ".join(s for s in everything if ":" in s) or "(none installed)"
        hint = f"did you mean {guess[0]!r}?" if guess else f"plugins: {ids}"
        out.append(f"{variable}: no installed plugin is called {part!r} ({hint})")
    return out


def _is_core(ep: metadata.EntryPoint) -> bool:
    return ep.dist is not None and normalize_distribution(ep.dist.name) == CORE_DISTRIBUTION


def _entry_points() -> list[metadata.EntryPoint]:
    """Every third-party entry point of the ``omni`` group, by name (omni-core's own are its
    built-ins, registered from code: an older install's entry points for them are not read)."""
    found: dict[tuple[str, str], metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if _is_core(ep):
            continue
        # The same distribution can be visible twice on sys.path (e.g. an editable install and
        # a source checkout); count it once.
        dist = normalize_distribution(ep.dist.name) if ep.dist else ""
        found.setdefault((dist, ep.name), ep)
    return sorted(found.values(), key=lambda ep: ep.name)


def _core_version() -> str | None:
    try:
        return metadata.version(CORE_DISTRIBUTION)
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return None


def _builtins(disabled: set[str], registry: Registry, warnings: list[str]) -> list[tuple[PluginInfo, Callable[[], object]]]:
    """omni-core's built-ins to load: every one not disabled, and the required ones always."""
    out: list[tuple[PluginInfo, Callable[[], object]]] = []
    version = _core_version()
    for name, module in BUILTIN_PLUGINS:
        if _matches(_selectors(name, CORE_DISTRIBUTION), disabled):
            why = REQUIRED_BUILTINS.get(name)
            if why is None:
                registry.skipped.append(f"plugin {name!r} (disabled by OMNI_DISABLED_PLUGINS)")
                continue
            warnings.append(f"OMNI_DISABLED_PLUGINS: {name!r} cannot be disabled ({why}); it is loaded")
        info = PluginInfo(name=name, module=module, distribution=CORE_DISTRIBUTION, version=version, builtin=True)
        out.append((info, functools.partial(importlib.import_module, module)))
    return out


def _error_text(exc: BaseException) -> str:
    if isinstance(exc, PluginError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _hook_guess(name: str) -> str:
    guess = difflib.get_close_matches(name, HOOK_NAMES, n=1)
    return f" (did you mean {guess[0]!r}?)" if guess else ""


def _hook_problems(plugin: object) -> list[str]:
    """Marked functions that are not omni hooks (pluggy would only notice at ``check_pending``,
    failing every plugin at once), and ``omni_register_*`` functions left unmarked (pluggy would
    silently ignore them)."""
    problems = []
    for attr in dir(plugin):
        fn = getattr(plugin, attr, None)
        if not inspect.isroutine(fn):  # what pluggy looks at: functions and methods
            continue
        marked = isinstance(getattr(fn, "omni_impl", None), dict)
        if marked and attr not in HOOK_NAMES:
            problems.append(f"unknown hook {attr!r}{_hook_guess(attr)}; hooks are: {', '.join(HOOK_NAMES)}")
        elif not marked and attr.startswith("omni_register_"):
            known = "" if attr in HOOK_NAMES else f"; it is not a hook either{_hook_guess(attr)}"
            problems.append(
                f"function {attr!r} looks like a hook but is not marked with @omni_core.hookimpl{known}"
            )
    return problems


#: The registration keywords of an API naming an OpenAI-style route the console has a tab for.
CONSOLE_ROUTES = {"chat": "chat completions route (like '/v1/chat/completions')",
                  "speech": "speech route (like '/v1/audio/speech')",
                  "transcription": "transcriptions route (like '/v1/audio/transcriptions')"}


def _metadata(kind: str, name: str, obj: Any, given: dict[str, Any], where: str) -> dict[str, Any]:
    """The checked registration metadata of one entry; a class registered as an object may carry
    it as class attributes instead (``capabilities``, ``options_schema``)."""
    from .capabilities import RelayCapabilities, as_capabilities
    from .options import as_schema

    allowed = KIND_SPECS[kind].metadata
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        takes = f"; a {KIND_LABELS[kind]} takes {', '.join(allowed)}" if allowed else ""
        raise PluginError(f"{where}: unexpected keyword(s) {', '.join(unknown)} for {name!r}{takes}")
    meta: dict[str, Any] = {}
    if "capabilities" in allowed:
        value = given.get("capabilities")
        if value is None and isinstance(getattr(obj, "capabilities", None), RelayCapabilities):
            value = obj.capabilities
        if value is not None:
            try:
                meta["capabilities"] = as_capabilities(value)
            except (TypeError, ValueError) as exc:
                raise PluginError(f"{where}: {KIND_LABELS[kind]} {name!r}: {exc}") from None
    if given.get("check") is not None:
        value = given["check"]
        if not (callable(value) or (isinstance(value, str) and is_dotted_path(value))):
            raise PluginError(f"{where}: {KIND_LABELS[kind]} {name!r}: check= takes a function or a "
                              f"'package.module:function' path, got {value!r}")
        meta["check"] = value
    # An API's OpenAI-style routes the console has a tab for: chat completions, speech, transcriptions.
    for key, route in CONSOLE_ROUTES.items():
        if given.get(key) is None:
            continue
        value = given[key]
        if not isinstance(value, str) or not (value.startswith("/") or is_dotted_path(value)):
            raise PluginError(f"{where}: {KIND_LABELS[kind]} {name!r}: {key}= takes the path of its OpenAI-style "
                              f"{route}, or a 'package.module:function' path of fn(options) -> that path or None "
                              f"(when the route depends on the pipeline's options), got {value!r}")
        meta[key] = value
    if kind == "family":  # what serving a checkpoint folder decides from, without importing the family
        types, pipeline = given.get("model_types"), given.get("pipeline")
        if isinstance(types, str) or not types or not all(isinstance(t, str) and t for t in types):
            raise PluginError(f"{where}: model family {name!r} needs model_types=[...], the config.json "
                              f"model_type values it serves, got {types!r}")
        if not isinstance(pipeline, str) or not pipeline:
            raise PluginError(f"{where}: model family {name!r} needs pipeline='NAME', the registered pipeline "
                              f"that serves its checkpoints, got {pipeline!r}")
        meta["model_types"], meta["pipeline"] = tuple(types), pipeline
    if "options" in allowed:
        value = given.get("options")
        if value is None and not isinstance(obj, str):
            value = getattr(obj, "options_schema", None)
        if value is not None:
            try:
                meta["options"] = as_schema(value)
            except ValueError as exc:
                raise PluginError(f"{where}: {KIND_LABELS[kind]} {name!r}: {exc}") from None
    return meta


class _Collector:
    """The ``register`` callback handed to one plugin's hook: checks each call and keeps the
    entries until the plugin finished registering (a plugin that fails registers nothing)."""

    def __init__(self, plugin: str, hook: str, distribution: str | None = None):
        self.plugin = plugin
        self.hook = hook
        self.distribution = distribution
        self.entries: list[Entry] = []

    def __call__(self, name: str, obj: Any, *, description: str | None = None, kind: str | None = None, **extra: Any) -> None:
        kinds = HOOK_KINDS[self.hook]
        where = f"plugin {self.plugin!r}, hook {self.hook}"
        if not isinstance(name, str) or not name or name != name.strip() or ":" in name:
            raise PluginError(f"{where}: invalid name {name!r}; use a non-empty string without ':' or surrounding spaces")
        if self.hook == "omni_register_functions":
            if kind not in FUNCTION_KINDS:
                raise PluginError(
                    f"{where}: function {name!r} needs kind= one of {', '.join(FUNCTION_KINDS)}, got {kind!r}"
                )
        elif kind is not None and kind not in kinds:
            raise PluginError(f"{where}: {name!r} cannot take kind={kind!r} here")
        else:
            kind = kinds[0]
        meta = _metadata(kind, name, obj, extra, where)
        if obj is None:
            raise PluginError(f"{where}: {name!r} registered None")
        if isinstance(obj, str) and kind != "pipeline" and ":" not in obj:
            raise PluginError(
                f"{where}: {name!r} registered the string {obj!r}; pass the object or a 'package.module:attr' path"
            )
        if kind == "pipeline":
            if not isinstance(obj, (str, os.PathLike, Mapping)) and not callable(obj):
                raise PluginError(
                    f"{where}: pipeline {name!r} must be a mapping, a file path, a 'package:file.yaml' "
                    f"string or a callable returning one, got {type(obj).__name__}"
                )
        elif kind != "family" and not isinstance(obj, str) and not callable(obj):
            raise PluginError(f"{where}: {name!r} must be callable, got {type(obj).__name__}")
        if any(e.kind == kind and e.name == name for e in self.entries):
            raise PluginError(f"{where}: {KIND_LABELS[kind]} {name!r} is registered twice")
        self.entries.append(Entry(kind=kind, name=name, target=obj, plugin=self.plugin, description=description,
                                  meta=meta, distribution=self.distribution))


def _register_plugin(pm: pluggy.PluginManager, registry: Registry, info: PluginInfo, plugin: object) -> None:
    """Register one plugin's hooks and collect what it contributes; raises if it is broken.

    A name another plugin already registered is not added: it becomes ambiguous (using it is an
    error naming both plugins) and this plugin's ``error`` says so."""
    problems = _hook_problems(plugin)
    if problems:
        raise PluginError("; ".join(problems))
    pm.register(plugin, name=info.id)
    info.hooks = [name for name in HOOK_NAMES if _implements(pm, plugin, name)]
    collected: list[Entry] = []
    for hook_name in info.hooks:
        collector = _Collector(info.name, hook_name, info.distribution)
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            if impl.plugin is not plugin:
                continue
            try:
                impl.function(register=collector)
            except PluginError:
                raise
            except Exception as exc:
                raise PluginError(f"hook {hook_name} raised {type(exc).__name__}: {exc}") from exc
        collected += collector.entries
    clashes = []
    for entry in collected:
        clash = registry.add(entry)
        if clash is None:
            info.registered.setdefault(entry.kind, []).append(entry.name)
        else:
            clashes.append(f"{entry.kind} {entry.name!r} is also registered by plugin {clash.plugin!r}")
    if clashes:
        info.error = (
            "name conflict: " + "; ".join(clashes)
            + "; uninstall one of them or disable one with OMNI_DISABLED_PLUGINS"
        )


def _implements(pm: pluggy.PluginManager, plugin: object, hook_name: str) -> bool:
    return any(impl.plugin is plugin for impl in getattr(pm.hook, hook_name).get_hookimpls())


def _given(obj: object) -> Callable[[], object]:
    """The loader of a plugin handed in already loaded (``extra``)."""
    return lambda: obj


def load_plugins(
    *,
    env: Mapping[str, str] | None = None,
    extra: Iterable[tuple[str, object]] = (),
) -> Plugins:
    """Discover and load every plugin; never raises for a broken plugin (it is recorded).

    ``extra`` adds ``(name, module_or_object)`` plugins that are not installed (tests, scripts);
    spawned stage processes do not see them, so anything a stage process needs must come from an
    entry point or a dotted path.
    """
    env = os.environ if env is None else env
    enabled = _split_env(env.get("OMNI_LOAD_PLUGINS"))
    disabled = _split_env(env.get("OMNI_DISABLED_PLUGINS")) or set()

    pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
    pm.add_hookspecs(hookspecs)
    registry = Registry()
    infos: list[PluginInfo] = []

    required: list[str] = []
    candidates = _builtins(disabled, registry, required)
    known: list[set[str]] = [_selectors(name, CORE_DISTRIBUTION) for name, _ in BUILTIN_PLUGINS]
    for ep in _entry_points():
        dist = ep.dist.name if ep.dist else None
        known.append(_selectors(ep.name, dist))
        reason = _skip_reason(ep.name, dist, enabled, disabled)
        if reason is not None:
            registry.skipped.append(f"plugin {ep.name!r} ({reason})")
            continue
        info = PluginInfo(
            name=ep.name,
            module=ep.value,
            distribution=dist,
            version=ep.dist.version if ep.dist else None,
        )
        candidates.append((info, ep.load))
    for name, obj in extra:
        known.append({name})
        if name in disabled:
            registry.skipped.append(f"plugin {name!r} (disabled by OMNI_DISABLED_PLUGINS)")
            continue
        info = PluginInfo(name=name, module=getattr(obj, "__name__", repr(obj)))
        candidates.append((info, _given(obj)))

    warnings = required + (_unknown_selectors("OMNI_LOAD_PLUGINS", env.get("OMNI_LOAD_PLUGINS"), known)
                + _unknown_selectors("OMNI_DISABLED_PLUGINS", env.get("OMNI_DISABLED_PLUGINS"), known))
    for info, load in candidates:
        infos.append(info)
        if pm.has_plugin(info.id):
            other = next(i for i in infos if i.id == info.id and i is not info)
            info.error = (
                f"another plugin is already loaded under the name {info.id!r}"
                f" (module {other.module}, distribution {other.distribution or '-'})"
            )
            registry.broken.append(BrokenPlugin(info.name, info.distribution, info.error))
            continue
        try:
            plugin = load()
            _register_plugin(pm, registry, info, plugin)
        except (Exception, SystemExit) as exc:  # a broken plugin is recorded, never fatal
            info.error = _error_text(exc)
            info.registered = {}
            if pm.has_plugin(info.id):
                pm.unregister(name=info.id)
            registry.broken.append(BrokenPlugin(info.name, info.distribution, info.error))
            info.traceback = traceback.format_exc()
    pm.check_pending()
    return Plugins(pm=pm, infos=infos, registry=registry, warnings=warnings)


_loaded: Plugins | None = None


def get_plugins() -> Plugins:
    """The process-wide plugins, loaded on first use."""
    global _loaded
    if _loaded is None:
        _loaded = load_plugins()
    return _loaded


def get_registry() -> Registry:
    return get_plugins().registry


def reset_plugins() -> None:
    """Forget the loaded plugins (tests; after installing a package at run time)."""
    global _loaded
    _loaded = None
