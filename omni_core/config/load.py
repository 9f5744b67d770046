"""Load a pipeline config from a YAML/TOML file, a mapping, or a registered pipeline name.

Structure errors (unknown keys, wrong types, missing fields) are all collected, each with its path
(``stages[2].tp_size``); then the whole-graph rules run (``validate.py``). Either way the caller
gets one :class:`~omni_core.errors.ConfigError` listing everything.
"""

from __future__ import annotations

import difflib
import importlib.resources
import io
import json
import os
import re
import sys
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import cattrs
import yaml
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError

from ..errors import ConfigError, ConfigIssue, PluginError
from ..registry import Registry, import_ref, is_dotted_path
from .schema import (
    EndpointsConfig,
    LauncherConfig,
    LimitsConfig,
    PipelineConfig,
    PlacementConfig,
    RelayConfig,
    RestartConfig,
    RetryConfig,
    ServeConfig,
    StageConfig,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, reading numbers like YAML 1.2 does: ``2.5e9`` and ``1e9`` are
    floats (YAML 1.1 wants ``2.5e+9`` and reads ``1e9`` as a string)."""


_YamlLoader.yaml_implicit_resolvers = {
    key: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:float"]
    for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)

_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


class _TypeMismatch(TypeError):
    def __init__(self, expected: str, value: Any):
        self.expected = expected
        self.value = value
        super().__init__(f"expected {expected}, got {_show(value)}")


def _show(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def _strict(tp: type):
    def hook(value: Any, _: Any) -> Any:
        if tp is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, bool) and tp is not bool:
            raise _TypeMismatch(_TYPE_WORDS[tp], value)
        if not isinstance(value, tp):
            raise _TypeMismatch(_TYPE_WORDS[tp], value)
        return value

    return hook


def _directory(value: Any, _: Any) -> str | None:
    """``serve.allow_local_files``: a directory, or null."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise _TypeMismatch("the directory requests may name files in (a path), or null for none", value)
    return value


def _names(value: Any, _: Any) -> tuple[str, ...]:
    """A stage name or a list of them."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise _TypeMismatch("a stage name or a list of stage names", value)


def _gpus(value: Any, _: Any) -> tuple[int, ...] | None:
    """A GPU id, a list of ids (one per tensor-parallel rank), or null (CPU)."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, (list, tuple)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return tuple(value)
    raise _TypeMismatch("a GPU id, a list of GPU ids, or null", value)


def _env(value: Any, _: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise _TypeMismatch("a mapping of environment variables", value)
    out = {}
    for key, val in value.items():
        if not isinstance(val, (str, int, float)) or isinstance(val, bool):
            raise _TypeMismatch(f"a string value for environment variable {key!r}", val)
        out[str(key)] = str(val)
    return out


def _mapping(value: Any, _: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise _TypeMismatch("a mapping", value)
    return dict(value)


def _port_range(value: Any, _: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        and 0 < value[0] <= value[1] < 65536
    ):
        return (value[0], value[1])
    raise _TypeMismatch("[first_port, last_port] with 0 < first <= last < 65536", value)


def _section(conv: cattrs.Converter, cls: type[Any], what: str, shorthand: str | None = None, **overrides: Any):
    """Structure hook of one config section: a mapping with only the keys of ``cls``.

    With ``shorthand``, a plain string means ``{shorthand: string}`` (``relay: shm`` is short for
    ``relay: {backend: shm}``; likewise for launcher and restart)."""
    from_dict = cattrs.gen.make_dict_structure_fn(
        cls, conv, _cattrs_forbid_extra_keys=True, _cattrs_detailed_validation=True, **overrides
    )

    def hook(value: Any, tp: Any) -> Any:
        if shorthand is not None and isinstance(value, str):
            value = {shorthand: value}
        if not isinstance(value, Mapping):
            expected = f"a {shorthand} name or a mapping" if shorthand else f"a mapping ({what})"
            raise _TypeMismatch(expected, value)
        return from_dict(dict(value), cls)

    return hook


def _function_map(value: Any, _: Any) -> dict[str, str]:
    """``project_payload`` / ``project_stream``: target stage → function name."""
    if not isinstance(value, Mapping):
        raise _TypeMismatch("a mapping of target stage to function name", value)
    for key, val in value.items():
        if not isinstance(val, str):
            raise _TypeMismatch(f"a function name for target {key!r}", val)
    return {str(k): v for k, v in value.items()}


def _api_options(value: Any, _: Any) -> dict[str, dict[str, Any]]:
    """``serve.options``: API name → that API's options (a mapping)."""
    if not isinstance(value, Mapping):
        raise _TypeMismatch("a mapping of API name to its options", value)
    for key, val in value.items():
        if not isinstance(val, Mapping):
            raise _TypeMismatch(f"a mapping of options for API {key!r}", val)
    return {str(k): dict(v) for k, v in value.items()}


def _stage_list(conv: cattrs.Converter):
    items = conv.get_structure_hook(tuple[StageConfig, ...])

    def hook(value: Any, tp: Any) -> tuple[StageConfig, ...]:
        if not isinstance(value, (list, tuple)):
            raise _TypeMismatch("a list of stages", value)
        return items(value, tp)

    return hook


def _is(tp: Any) -> Callable[[Any], bool]:
    """The predicate of a structure hook for exactly the type ``tp``."""
    return lambda t: t == tp


def _literal(value: Any, tp: Any) -> Any:
    allowed = typing.get_args(tp)
    if value not in allowed:
        raise _TypeMismatch(f"one of {', '.join(repr(a) for a in allowed)}", value)
    return value


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    conv.register_structure_hook_func(lambda t: typing.get_origin(t) is typing.Literal, _literal)
    for tp in (int, float, bool, str):
        conv.register_structure_hook(tp, _strict(tp))
    exact: dict[Any, Callable[[Any, Any], Any]] = {
        tuple[str, ...]: _names,
        tuple[int, ...] | None: _gpus,
        tuple[int, int] | None: _port_range,
        dict[str, str]: _env,
        dict[str, Any]: _mapping,
        RelayConfig | None: lambda v, _: None if v is None else conv.structure(v, RelayConfig),
    }
    for tp, hook in exact.items():
        conv.register_structure_hook_func(_is(tp), hook)
    # One GPU id goes out as a single id, the form that means "consecutive GPUs" for a TP stage,
    # so a config survives to_dict and back (a one-element list is an error for tp_size > 1).
    conv.register_unstructure_hook_func(
        lambda t: t == tuple[int, ...] | None,
        lambda v: v if v is None else v[0] if len(v) == 1 else list(v),
    )
    # Sections, leaves first: each generated hook binds the hooks of its fields when it is made.
    conv.register_structure_hook(RelayConfig, _section(conv, RelayConfig, "relay", shorthand="backend"))
    conv.register_structure_hook(LauncherConfig, _section(conv, LauncherConfig, "launcher", shorthand="name"))
    conv.register_structure_hook(RestartConfig, _section(conv, RestartConfig, "restart", shorthand="policy"))
    conv.register_structure_hook(RetryConfig, _section(conv, RetryConfig, "attempts, on"))
    conv.register_structure_hook(PlacementConfig, _section(conv, PlacementConfig, "strategy, gpus, ..."))
    conv.register_structure_hook(EndpointsConfig, _section(conv, EndpointsConfig, "ipc_dir, host, port_range"))
    conv.register_structure_hook(LimitsConfig, _section(conv, LimitsConfig, "max_in_flight, timeouts, ..."))
    conv.register_structure_hook(
        ServeConfig,
        _section(conv, ServeConfig, "apis, options", options=cattrs.gen.override(struct_hook=_api_options),
                 allow_local_files=cattrs.gen.override(struct_hook=_directory)),
    )
    conv.register_structure_hook(
        StageConfig,
        _section(
            conv, StageConfig, "a stage with at least name and factory",
            project_payload=cattrs.gen.override(struct_hook=_function_map),
            project_stream=cattrs.gen.override(struct_hook=_function_map),
        ),
    )
    stage_list = _stage_list(conv)
    conv.register_structure_hook_func(lambda t: t == tuple[StageConfig, ...], stage_list)
    conv.register_structure_hook(PipelineConfig, _section(conv, PipelineConfig, "a pipeline"))
    return conv


converter = _make_converter()


# -- turning cattrs' exception tree into issues with paths --------------------------------------


def _field_names(cls: type) -> list[str]:
    return [a.alias if hasattr(a, "alias") and a.alias else a.name for a in attrs.fields(cls)]


def _walk(exc: BaseException, path: str, issues: list[ConfigIssue], raw: Any) -> None:
    if isinstance(exc, (ClassValidationError, IterableValidationError, cattrs.BaseValidationError)):
        with_notes, without = exc.group_exceptions()
        for sub, note in with_notes:
            if isinstance(note, cattrs.AttributeValidationNote):
                sub_path, sub_raw = f"{path}.{note.name}" if path else note.name, _child(raw, note.name)
            elif isinstance(note, cattrs.IterableValidationNote):
                sub_path, sub_raw = f"{path}[{note.index}]", _child(raw, note.index)
            else:
                sub_path, sub_raw = path, raw
            _walk(sub, sub_path, issues, sub_raw)
        for sub in without:
            _walk(sub, path, issues, raw)
        return
    issues.extend(_issues(exc, path, raw))


def _child(raw: Any, key: Any) -> Any:
    try:
        return raw[key]
    except (KeyError, IndexError, TypeError):
        return None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _issues(exc: BaseException, path: str, raw: Any) -> list[ConfigIssue]:
    if isinstance(exc, ForbiddenExtraKeysError):
        known = _field_names(exc.cl)
        issues = []
        for key in sorted(exc.extra_fields, key=str):
            guess = difflib.get_close_matches(str(key), known, n=1)
            issues.append(ConfigIssue(
                _join(path, str(key)),
                "unknown key" + (f" (did you mean {guess[0]!r}?)" if guess else ""),
                f"allowed keys here: {', '.join(known)}",
            ))
        return issues
    if isinstance(exc, KeyError):
        key = path.rsplit(".", 1)[-1]
        return [ConfigIssue(path, "required key is missing", f"add '{key}: ...'")]
    if isinstance(exc, _TypeMismatch):
        return [ConfigIssue(path, str(exc))]
    return [ConfigIssue(path, f"invalid value {_show(raw)}: {exc}")]


def structure(data: Mapping[str, Any], *, source: str | None = None) -> PipelineConfig:
    """Turn a plain mapping into a :class:`PipelineConfig`; every structural error at once."""
    if not isinstance(data, Mapping):
        raise ConfigError([ConfigIssue("", f"expected a mapping at the top level, got {_show(data)}")], source=source)
    try:
        cfg = converter.structure(dict(data), PipelineConfig)
    except Exception as exc:  # cattrs wraps everything it found in one exception group
        issues: list[ConfigIssue] = []
        _walk(exc, "", issues, data)
        raise ConfigError(issues, source=source) from None
    issues = _gpu_list_issues(data)
    if issues:
        raise ConfigError(issues, source=source)
    return cfg


def structure_checked(data: Mapping[str, Any]) -> tuple[PipelineConfig | None, list[ConfigIssue], tuple[str, ...]]:
    """Structure ``data`` for a whole check: ``(config, structural issues, replaced paths)``.

    Without structural issues the config is ``data``'s. With some, the config is a repaired copy,
    so that the whole-graph rules can run in the same pass: unknown keys dropped, values of the
    wrong type left to their defaults, missing names and factories given placeholders; the
    replaced paths say which values the config does not hold (a rule's finding there, above or
    below is a consequence of the repair, not a second error). None when no repair structures
    (the structural issues are then all there is to report)."""
    try:
        return structure(data), [], ()
    except ConfigError as exc:
        issues = list(exc.issues)
    replaced: list[str] = []
    repaired: Any = data
    found = issues
    for _ in range(3):  # a repair can uncover what it hid: a dropped required value, say
        fixed = _repair(repaired, found, replaced)
        if fixed is None:
            return None, issues, ()
        repaired = fixed
        try:
            return structure(repaired), issues, tuple(replaced)
        except ConfigError as exc:
            found = list(exc.issues)
    return None, issues, ()


_PATH_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def _path_keys(path: str) -> list[str | int] | None:
    """``stages[2].tp_size`` -> ``["stages", 2, "tp_size"]`` (None for a path it cannot split)."""
    keys: list[str | int] = []
    for name, index in _PATH_PART.findall(path):
        keys.append(int(index) if index else name)
    return keys or None


def _repair(data: Any, issues: list[ConfigIssue], replaced: list[str]) -> dict[str, Any] | None:
    """A copy of ``data`` without the values ``issues`` are about (see :func:`structure_checked`)."""
    import copy

    fixed = copy.deepcopy(dict(data))
    for issue in issues:
        keys = _path_keys(issue.path)
        if keys is None or not isinstance(keys[-1], str):
            return None  # the top level, or a list item that is not a mapping
        parent: Any = fixed
        for key in keys[:-1]:
            try:
                parent = parent[key]
            except (KeyError, IndexError, TypeError):
                return None
        if not isinstance(parent, dict):
            return None
        leaf = keys[-1]
        if issue.message.startswith("unknown key"):
            parent.pop(leaf, None)  # dropping it changes nothing else: no path to remember
        elif issue.message == "required key is missing" or leaf in ("name", "factory"):
            parent[leaf] = f"<{issue.path}>"  # a name no rule can confuse with a real one
            replaced.append(issue.path)
        else:
            parent.pop(leaf, None)
            replaced.append(issue.path)
    return fixed


def touches(path: str, replaced: tuple[str, ...] | list[str]) -> bool:
    """Whether ``path`` is, holds or lies inside one of the ``replaced`` paths."""
    def inside(inner: str, outer: str) -> bool:
        return inner == outer or outer == "" or inner.startswith((outer + ".", outer + "["))

    return any(inside(path, r) or inside(r, path) for r in replaced)


def _gpu_list_issues(data: Mapping[str, Any]) -> list[ConfigIssue]:
    """A ``gpu`` *list* gives one id per rank, so it has ``tp_size`` entries; a single id
    (``gpu: 2``, not a list) is the short form for consecutive GPUs starting there. The two
    only differ in the file, hence this check on the raw data."""
    issues = []
    for i, raw in enumerate(data.get("stages") or ()):
        if not isinstance(raw, Mapping) or not isinstance(raw.get("gpu"), (list, tuple)):
            continue
        ids, tp_size = raw["gpu"], raw.get("tp_size", 1)
        if len(ids) == 1 and isinstance(tp_size, int) and tp_size > 1:  # other lengths: validate.processes
            issues.append(ConfigIssue(
                f"stages[{i}].gpu",
                f"{len(ids)} GPU id{'s' if len(ids) != 1 else ''} {list(ids)} for tp_size {tp_size}; a list gives one id per rank",
                f"list {tp_size} ids, or write a single id without brackets (gpu: {ids[0] if ids else 0}) "
                "for consecutive GPUs starting there",
            ))
    return issues


# -- sources: files, mappings, registered names -------------------------------------------------


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Parse a YAML (``.yaml``/``.yml``), JSON (``.json``) or TOML (``.toml``) file into a mapping."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError([ConfigIssue("", f"cannot read {path}: {exc.strerror}")], source=str(path)) from None
    return parse_config_text(text, suffix=path.suffix, source=str(path))


def parse_config_text(text: str, *, suffix: str, source: str) -> dict[str, Any]:
    try:
        if suffix.lower() == ".toml":
            data = tomllib.loads(text)
        elif suffix.lower() == ".json":
            data = _load_json(text, source)
        elif suffix.lower() in (".yaml", ".yml"):
            stream = io.StringIO(text)
            stream.name = source  # PyYAML names it in parse errors
            data = yaml.load(stream, Loader=_YamlLoader)  # noqa: S506 (a SafeLoader)
        else:
            raise ConfigError(
                [ConfigIssue("", f"unknown config file type {suffix!r}", "use .yaml, .yml, .toml or .json")], source=source
            )
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError([ConfigIssue("", f"cannot parse: {exc}")], source=source) from None
    if not isinstance(data, dict):
        raise ConfigError([ConfigIssue("", f"expected a mapping at the top level, got {_show(data)}")], source=source)
    return data


def _load_json(text: str, source: str) -> Any:
    """Strict JSON (no trailing commas, no comments): a ``.json`` file is what JSON tools accept."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            [ConfigIssue("", f"cannot parse: line {exc.lineno} column {exc.colno}: {exc.msg}",
                         "a .json config is strict JSON; use .yaml for comments and trailing commas")],
            source=source,
        ) from None


#: File suffixes read as config files.
CONFIG_SUFFIXES = (".yaml", ".yml", ".toml", ".json")


def _registered_pipeline(name: str, registry: Registry | None = None) -> tuple[dict[str, Any], str]:
    """The mapping of a pipeline a plugin registered: a mapping, a file path, a
    ``"package:resource.yaml"`` file shipped in a package, a ``"pkg.mod:attr"`` path to one of
    these, or a zero-argument callable returning one of these."""
    if registry is None:
        from ..plugins import get_registry

        registry = get_registry()
    entry = registry.get("pipeline", name)
    source = f"{name!r} (registered by plugin {entry.plugin!r})"

    def fail(message: str) -> ConfigError:
        return ConfigError([ConfigIssue("", f"pipeline {name!r} of plugin {entry.plugin!r} {message}")], source=source)

    obj = entry.load()
    if isinstance(obj, str) and not os.path.exists(obj) and is_dotted_path(obj):
        package, _, rest = obj.partition(":")
        if Path(rest).suffix.lower() in CONFIG_SUFFIXES:
            try:
                text = importlib.resources.files(package).joinpath(rest).read_text()
            except Exception as exc:  # no such package, not a package, no such file
                raise fail(f"names {obj!r}, which cannot be read: {type(exc).__name__}: {exc}") from None
            return parse_config_text(text, suffix=Path(rest).suffix, source=source), source
        obj = import_ref(obj)
    if callable(obj) and not isinstance(obj, Mapping):
        try:
            obj = obj()
        except Exception as exc:
            raise fail(f"could not be built: {type(exc).__name__}: {exc}") from None
    if isinstance(obj, Mapping):
        return dict(obj), source
    if isinstance(obj, (str, os.PathLike)):
        return read_config_file(obj), source
    raise fail(f"is a {type(obj).__name__}, not a mapping, a file path or a callable returning one")


def load_config(
    config: str | os.PathLike | Mapping[str, Any] | PipelineConfig,
    *,
    validate: bool = True,
    registry: Registry | None = None,
    import_factories: bool = False,
    serve: bool = False,
    model: str | os.PathLike | None = None,
) -> PipelineConfig:
    """Load and validate a pipeline config.

    ``config`` is a path to a YAML/TOML file, a mapping, a :class:`PipelineConfig`, the name of a
    pipeline a plugin registered (``"demo"``), or a checkpoint folder (its ``config.json``'s
    ``model_type`` picks the model family registered for it, whose pipeline serves the folder).
    ``model``: a checkpoint folder given to every stage as ``args.model``. Raises :class:`ConfigError` listing every problem:
    the structural ones (unknown keys, wrong types) and, in the same pass, what the whole-graph
    rules find in the rest. Names are resolved through ``registry`` (default: the registry of the
    installed plugins). ``import_factories`` and ``serve`` are :func:`~omni_core.config.collect_issues`'s.
    """
    issues: list[ConfigIssue] = []
    replaced: tuple[str, ...] = ()
    source: str | None = None
    if isinstance(config, PipelineConfig):
        cfg = config
    else:
        if isinstance(config, Mapping):
            data, source = dict(config), None
        else:
            text = os.fspath(config)
            if os.path.isdir(text):
                data, source = _checkpoint_pipeline(text, registry)
            elif os.path.exists(text) or Path(text).suffix.lower() in CONFIG_SUFFIXES:
                data, source = read_config_file(text), text
            else:
                data, source = _registered_pipeline_or_error(text, registry)
        if model is not None:
            data = with_model(data, model)
        if not validate:
            return structure(data, source=source)
        found, issues, replaced = structure_checked(data)
        if found is None:
            raise ConfigError(issues, source=source)
        cfg = found
    if validate:
        from .validate import collect_issues

        issues += [issue for issue in collect_issues(cfg, registry, import_factories=import_factories, serve=serve)
                   if not touches(issue.path, replaced)]
    if issues:
        raise ConfigError(issues, source=source)
    return cfg


def with_model(data: dict[str, Any], model: str | os.PathLike) -> dict[str, Any]:
    """A pipeline's mapping with ``model`` (a checkpoint folder) as every stage's ``args.model``."""
    folder = str(Path(model).expanduser().resolve())
    stages = [{**stage, "args": {**(stage.get("args") or {}), "model": folder}} if isinstance(stage, Mapping) else stage
              for stage in data.get("stages") or []]
    return {**data, "stages": stages}


def _checkpoint_pipeline(folder: str, registry: Registry | None) -> tuple[dict[str, Any], str]:
    """A checkpoint folder as a pipeline: the model family registered for its ``config.json``'s
    ``model_type`` (``omni_register_families``), its pipeline, every stage given the folder."""
    def fail(message: str) -> ConfigError:
        return ConfigError([ConfigIssue("", message)], source=folder)

    try:
        model_type = json.loads((Path(folder) / "config.json").read_text()).get("model_type")
    except FileNotFoundError:
        raise fail(f"{folder!r} is a folder, neither a config file nor a checkpoint (no config.json in it)") from None
    except (OSError, ValueError, AttributeError) as exc:
        raise fail(f"{folder!r}: its config.json cannot be read: {exc}") from None
    if registry is None:
        from ..plugins import get_registry

        registry = get_registry()
    families = [registry.get("family", name) for name in registry.names("family")]
    for family in families:
        if model_type in family.meta.get("model_types", ()):
            data, _ = _registered_pipeline_or_error(family.meta["pipeline"], registry)
            return with_model(data, folder), f"{folder!r} (model family {family.name!r})"
    installed = ", ".join(f"{f.name} ({', '.join(f.meta.get('model_types', ()))})" for f in families) or "none"
    raise fail(f"no installed model family serves model_type {model_type!r} of {folder}; installed families: "
               f"{installed}")


def _registered_pipeline_or_error(name: str, registry: Registry | None) -> tuple[dict[str, Any], str]:
    try:
        return _registered_pipeline(name, registry)
    except PluginError as exc:
        raise ConfigError(
            [ConfigIssue("", f"{name!r} is neither a config file nor a registered pipeline: {exc}")],
            source=name,
        ) from None


def to_dict(cfg: PipelineConfig) -> dict[str, Any]:
    """The config as plain data (what a spawned process receives)."""
    return converter.unstructure(cfg)

