"""Typed registries of everything plugins contribute, and name resolution for configs.

A config refers to a thing either by its registered name (``factory: acme.upper``) or by a dotted
path (``factory: acme_omni.stages:Upper``). Both resolve here. An unknown name is a
:class:`~omni_core.errors.PluginError` that suggests the closest known name and lists the rest;
a name that a broken plugin might have provided says which plugin failed and why.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Iterable
from typing import Any

import attrs

from .errors import PluginError

#: Function kinds, each with the signature omni calls it with (see hookspecs).
FUNCTION_KINDS: tuple[str, ...] = (
    "route",
    "merge",
    "wait_for",
    "stream_done",
    "project_payload",
    "project_stream",
    "terminal_stages",
)

@attrs.frozen
class KindSpec:
    """One kind of registered thing: its name in the registry, the words for it in messages,
    the hook that registers it, and the metadata keywords ``register`` accepts for it besides
    ``description`` (for example a relay's ``capabilities`` and ``options`` schema). A new kind
    is one entry of :data:`KINDS` plus its hook in :mod:`omni_core.hookspecs`."""

    name: str
    label: str
    hook: str
    metadata: tuple[str, ...] = ()


#: Every registry kind, in the order tools show them.
KINDS: tuple[KindSpec, ...] = (
    KindSpec("stage", "stage factory", "omni_register_stages", ("check",)),
    *(KindSpec(kind, f"{kind} function", "omni_register_functions") for kind in FUNCTION_KINDS),
    KindSpec("relay", "relay", "omni_register_relays", ("capabilities", "options")),
    KindSpec("placement", "placement strategy", "omni_register_placements", ("options",)),
    KindSpec("launcher", "launcher", "omni_register_launchers", ("options",)),
    KindSpec("pipeline", "pipeline", "omni_register_pipelines"),
    KindSpec("api", "API", "omni_register_apis", ("options", "chat", "speech", "transcription")),
    KindSpec("family", "model family", "omni_register_families", ("model_types", "pipeline")),
)

KIND_SPECS: dict[str, KindSpec] = {spec.name: spec for spec in KINDS}

#: Every registry kind, mapped to the words used for it in messages.
KIND_LABELS: dict[str, str] = {spec.name: spec.label for spec in KINDS}

#: Which hook registers which kinds.
HOOK_KINDS: dict[str, tuple[str, ...]] = {}
for _spec in KINDS:
    HOOK_KINDS[_spec.hook] = (*HOOK_KINDS.get(_spec.hook, ()), _spec.name)
del _spec


#: Names that omni's own distributions provide, so that an unknown one can say what to install:
#: ``(kind, name or "prefix.")`` → ``(distribution, its folder in the omni repository)``.
KNOWN_PROVIDERS: dict[tuple[str, str], tuple[str, str]] = {
    ("relay", "nccl"): ("omni-nccl", "plugins/omni-nccl"),
    ("relay", "cuda_ipc"): ("omni-cuda-ipc", "plugins/omni-cuda-ipc"),
    ("launcher", "ray"): ("omni-ray", "plugins/omni-ray"),
    ("placement", "ray"): ("omni-ray", "plugins/omni-ray"),
    ("stage", "transformers."): ("omni-transformers", "plugins/omni-transformers"),
    ("*", "contrib."): ("omni-contrib-stages", "contrib_stages"),
    ("pipeline", "demo"): ("omni-contrib-stages", "contrib_stages"),
}


def known_provider(kind: str, name: str) -> tuple[str, str] | None:
    """The omni distribution that provides ``name`` of ``kind``, when omni knows one."""
    for (k, ref), provider in KNOWN_PROVIDERS.items():
        if k in (kind, "*") and (name == ref or (ref.endswith(".") and name.startswith(ref))):
            return provider
    return None


def normalize_distribution(name: str) -> str:
    """A distribution name as packaging compares them: lower case, runs of ``-_.`` as ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def is_dotted_path(ref: str) -> bool:
    """``pkg.mod:attr`` (a module, a colon, an attribute path) rather than a registered name."""
    module, sep, attr = ref.partition(":")
    return bool(sep and module and attr)


def import_ref(ref: str) -> Any:
    """Import ``pkg.mod:attr.sub`` and return the attribute; errors say which part is missing."""
    module_name, _, attr_path = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginError(f"cannot import module {module_name!r} of {ref!r}: {exc}") from exc
    except Exception as exc:  # the module itself raised while being imported
        raise PluginError(
            f"importing module {module_name!r} of {ref!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginError(
                f"module {module_name!r} has no attribute {attr_path!r} (from {ref!r}); "
                "check the spelling, or that the installed version provides it"
            ) from None
    return obj


def check_dotted_path(ref: str) -> str | None:
    """Check that the module of a dotted path can be found, without importing it (and, when it
    is imported already, that it has the attribute).

    Returns None when it looks importable, else the reason it is not."""
    module_name = ref.partition(":")[0]
    if module_name in sys.modules:
        try:
            import_ref(ref)
        except PluginError as exc:
            return str(exc)
        return None
    try:
        spec = importlib.util.find_spec(module_name)
    except Exception as exc:  # a parent package failed to import, or the name is malformed
        return f"cannot find module {module_name!r} of {ref!r}: {type(exc).__name__}: {exc}"
    if spec is None:
        return f"cannot find module {module_name!r} of {ref!r}; is its package installed?"
    return None


@attrs.define
class Entry:
    """One registered thing: a stage factory, a function, a relay, a strategy, a launcher or a
    pipeline, with the plugin that contributed it."""

    kind: str
    name: str
    target: Any
    plugin: str
    description: str | None = None
    #: Registration metadata (``capabilities``, ``options`` schema ...), read without importing
    #: ``target``: planning and validation decide from it.
    meta: dict[str, Any] = attrs.field(factory=dict)
    #: The plugin's distribution (None for plugins that are not installed).
    distribution: str | None = None
    _loaded: Any = attrs.field(default=None, repr=False)

    @property
    def capabilities(self) -> Any:
        """A relay's declared :class:`~omni_core.relay.RelayCapabilities` (None: undeclared)."""
        return self.meta.get("capabilities")

    @property
    def options(self) -> Any:
        """The declared options schema (name → :class:`~omni_core.options.Option`; None:
        undeclared, options are then checked only when the object reads them)."""
        return self.meta.get("options")

    def load_check(self) -> Any:
        """A stage factory's argument check (``register(..., check=fn)``), imported when it was
        registered as a dotted path; None when it has none."""
        check = self.meta.get("check")
        if isinstance(check, str):
            try:
                check = self.meta["check"] = import_ref(check)
            except PluginError as exc:
                raise PluginError(f"the argument check of {KIND_LABELS[self.kind]} {self.name!r} of {self.owner} "
                                  f"cannot be loaded: {exc}") from exc
        return check

    @property
    def owner(self) -> str:
        """``plugin 'x' (distribution d)``, for messages."""
        dist = f" (distribution {self.distribution})" if self.distribution else ""
        return f"plugin {self.plugin!r}{dist}"

    def load(self) -> Any:
        """The registered object, importing it first when it was registered as a dotted path.

        A pipeline's string is returned as it is: it may name a file shipped in a package
        (``"acme_omni:demo.yaml"``), which the config loader reads."""
        if self._loaded is None:
            if isinstance(self.target, str) and is_dotted_path(self.target) and self.kind != "pipeline":
                try:
                    self._loaded = import_ref(self.target)
                except PluginError as exc:
                    raise PluginError(
                        f"{KIND_LABELS[self.kind]} {self.name!r} of {self.owner} "
                        f"cannot be loaded: {exc}"
                    ) from exc
            else:
                self._loaded = self.target
        return self._loaded


@attrs.define
class BrokenPlugin:
    """What the registry knows of a plugin that failed: enough to explain a missing name."""

    name: str
    distribution: str | None
    error: str

    def describe(self) -> str:
        dist = f" (distribution {self.distribution})" if self.distribution else ""
        return f"plugin {self.name!r}{dist} failed to load: {self.error}"


def _closest(name: str, known: Iterable[str]) -> str | None:
    matches = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return matches[0] if matches else None


class Registry:
    """Everything plugins registered, by kind and name."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], Entry] = {}
        self._conflicts: dict[tuple[str, str], list[Entry]] = {}
        self.broken: list[BrokenPlugin] = []
        #: Plugins the environment kept from loading, each as "plugin 'x' (why)".
        self.skipped: list[str] = []

    # -- filling ------------------------------------------------------------------------------

    def add(self, entry: Entry) -> Entry | None:
        """Add an entry. Returns the entry it clashes with (same kind and name, another plugin),
        in which case the name becomes ambiguous and using it is an error naming both."""
        key = (entry.kind, entry.name)
        existing = self._entries.get(key)
        if existing is None:
            self._entries[key] = entry
            return None
        self._conflicts.setdefault(key, [existing]).append(entry)
        return existing

    # -- reading ------------------------------------------------------------------------------

    def names(self, kind: str) -> list[str]:
        return sorted(name for (k, name) in self._entries if k == kind)

    def entries(self, kind: str | None = None) -> list[Entry]:
        return [e for (k, _), e in sorted(self._entries.items()) if kind is None or k == kind]

    def kind_of(self, name: str, kinds: Iterable[str]) -> str | None:
        """The first of ``kinds`` under which ``name`` is registered, if any."""
        return next((k for k in kinds if (k, name) in self._entries), None)

    def get(self, kind: str, name: str) -> Entry:
        """The entry registered as ``name`` of ``kind``; a clear PluginError otherwise."""
        key = (kind, name)
        if key in self._conflicts:
            raise PluginError(self.conflict_message(kind, name))
        entry = self._entries.get(key)
        if entry is None:
            raise PluginError(self.unknown_message(kind, name))
        return entry

    def resolve(self, kind: str, ref: str) -> Any:
        """A registered name or a ``pkg.mod:attr`` path, resolved to the object."""
        if is_dotted_path(ref):
            return import_ref(ref)
        return self.get(kind, ref).load()

    def problem(self, kind: str, ref: str) -> str | None:
        """Why ``ref`` cannot be resolved as ``kind`` (None when it can), without importing
        anything that is not already imported."""
        if is_dotted_path(ref):
            return check_dotted_path(ref)
        try:
            self.get(kind, ref)
        except PluginError as exc:
            return str(exc)
        return None

    # -- messages -----------------------------------------------------------------------------

    def conflict_message(self, kind: str, name: str) -> str:
        owners = " and ".join(repr(e.plugin) for e in self._conflicts[(kind, name)])
        return (
            f"{KIND_LABELS[kind]} {name!r} is registered by more than one plugin: {owners}; "
            "uninstall one of them or disable one with OMNI_DISABLED_PLUGINS"
        )

    def unknown_message(self, kind: str, name: str) -> str:
        label = KIND_LABELS[kind]
        known = self.names(kind)
        suspects = [b for b in self.broken if self._might_provide(b, name)]
        if suspects:
            return f"{label} {name!r} is not available: " + "; ".join(
                b.describe() for b in suspects
            )
        text = f"unknown {label} {name!r}"
        other = self._other_function_kind(name, kind) if kind in FUNCTION_KINDS else None
        guess = _closest(name, known)
        if other:
            text += f" ({name!r} is registered as a {other} function, not a {kind} function)"
        elif guess:
            text += f" (did you mean {guess!r}?)"
        text += f"; known: {', '.join(known) if known else '(none registered)'}"
        provider = known_provider(kind, name)
        if provider:
            text += (f"; {name!r} is provided by the distribution {provider[0]}: install it from its "
                     f"folder in the omni repository (pip install ./{provider[1]})")
        if self.broken:
            text += "; note: " + "; ".join(b.describe() for b in self.broken)
        if self.skipped:
            text += "; not loaded: " + ", ".join(self.skipped)
        return text

    def _other_function_kind(self, name: str, kind: str) -> str | None:
        return self.kind_of(name, [k for k in FUNCTION_KINDS if k != kind])

    @staticmethod
    def _might_provide(broken: BrokenPlugin, name: str) -> bool:
        owners = {broken.name.lower()}
        if broken.distribution:
            dist = normalize_distribution(broken.distribution)
            short = dist.removeprefix("omni-").removesuffix("-omni")
            owners |= {dist, dist.replace("-", "_"), short, short.replace("-", "_")}
        head = name.split(".", 1)[0].lower()
        return name.lower() in owners or head in owners


def signature_text(obj: Any) -> str:
    """``Name(a, b=1)``, for messages about arguments."""
    name = getattr(obj, "__qualname__", repr(obj))
    try:
        return f"{name}{inspect.signature(obj, eval_str=True)}"
    except Exception:  # string annotations that do not evaluate: show them as written
        pass
    try:
        return f"{name}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        return repr(obj)
