"""Errors as the CLI prints them: what went wrong, where, and what to do; no traceback unless
``--debug`` (or ``OMNI_DEBUG=1``) asks for one."""

from __future__ import annotations

import re
from typing import Any

from ..errors import (
    ConfigError,
    OmniError,
    PluginError,
    StageError,
    StartupError,
    has_user_frames,
    trim_traceback,
)

DEBUG_HINT = "run with --debug (or OMNI_DEBUG=1) for the full traceback"


def describe_error(exc: BaseException, *, cfg: Any = None, plan: Any = None) -> str:
    """The text the CLI prints for ``exc`` (no traceback of omni's own code)."""
    if isinstance(exc, StartupError):
        return describe_startup_failure(exc, cfg=cfg, plan=plan)
    if isinstance(exc, ConfigError):
        return str(exc)
    if isinstance(exc, StageError):
        return describe_stage_error(exc)
    if isinstance(exc, PluginError):
        return f"error: {exc}"
    if isinstance(exc, OmniError):
        return f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    if isinstance(exc, OSError) and exc.filename:
        return f"error: {exc.strerror or exc}: {exc.filename}"
    owner = plugin_of(exc)
    if owner:
        return (
            f"error: {owner} raised {type(exc).__name__}: {exc}\n"
            f"  this is a bug in that plugin; {DEBUG_HINT} and report it there"
        )
    return (
        f"error: omni failed unexpectedly: {type(exc).__name__}: {exc}\n"
        f"  this is a bug; {DEBUG_HINT} and report it"
    )


def plugin_of(exc: BaseException) -> str | None:
    """``launcher 'ray' of plugin 'omni-ray'`` when the innermost frame of ``exc``'s traceback
    that belongs to a registered thing's module is known (None otherwise, or when the registry is
    not loaded)."""
    registry = _loaded_registry()
    if registry is None:
        return None
    by_module: dict[str, Any] = {}
    for entry in registry.entries():
        target = entry.target
        module = target.partition(":")[0] if isinstance(target, str) else getattr(target, "__module__", None)
        if module and not module.startswith("omni_core.") and module not in by_module:
            by_module[module] = entry
    tb, found = exc.__traceback__, None
    while tb is not None:
        entry = by_module.get(tb.tb_frame.f_globals.get("__name__", ""))
        found = entry or found
        tb = tb.tb_next
    return None if found is None else f"{_kind_label(found.kind)} {found.name!r} of plugin {found.plugin!r}"


def _loaded_registry() -> Any:
    try:
        from ..plugins import get_registry

        return get_registry()
    except Exception:
        return None


def _kind_label(kind: str) -> str:
    from ..registry import KIND_LABELS

    return KIND_LABELS.get(kind, kind)


def stage_paths(cfg: Any, process: str | None, plan: Any = None) -> list[str]:
    """``stages[0] 'a'`` for every stage the process ``process`` hosts."""
    if cfg is None or process is None:
        return []
    names: list[str] = []
    if plan is not None:
        spec = next((p for p in getattr(plan, "processes", ()) if p.name == process), None)
        names = list(spec.stages) if spec is not None else []
    if not names:
        names = [s.name for s in cfg.stages if (s.process or s.name) == process or s.name == process]
    index = {s.name: i for i, s in enumerate(cfg.stages)}
    return [f"stages[{index[n]}] {n!r} (factory {cfg.stages[index[n]].factory!r})" for n in names if n in index]


def config_paths_by_index(text: str, cfg: Any) -> str:
    """``stages[thinker].args`` → ``stages[1].args``: a path as the config file has it."""
    if cfg is None:
        return text
    index = {s.name: i for i, s in enumerate(cfg.stages)}
    return re.sub(r"stages\[([^\]\d][^\]]*)\]", lambda m: f"stages[{index[m.group(1)]}]" if m.group(1) in index else m.group(0), text)


def describe_startup_failure(exc: StartupError, *, cfg: Any = None, plan: Any = None) -> str:
    """A failed start: for each process that failed, the config path of the stage it was
    building (``stages[1]``: its factory raised; ``.factory``: it could not be imported;
    ``.args``: its arguments do not fit) or of the stages it hosts, the child's message, and the
    child's traceback with omni's frames trimmed (none when only omni code was involved, for
    example a config error the child found)."""
    failures = getattr(exc, "failures", None) or [exc]
    if len(failures) == 1:
        return "error: " + "\n".join(_startup_lines(failures[0], cfg, plan, indent="  "))
    lines = [f"error: {len(failures)} processes failed to start:"]
    for failure in failures:
        first, *rest = _startup_lines(failure, cfg, plan, indent="      ")
        lines += ["  - " + first, *rest]
    return "\n".join(lines)


def _startup_lines(exc: StartupError, cfg: Any, plan: Any, *, indent: str) -> list[str]:
    stage, path, detail = getattr(exc, "stage", None), getattr(exc, "path", None), getattr(exc, "detail", None)
    if stage and path and detail:
        factory = ""
        if cfg is not None:
            found = next((s for s in cfg.stages if s.name == stage), None)
            factory = f", factory {found.factory!r}" if found is not None else ""
        hosted = f" in process {exc.process!r}" if exc.process and exc.process != stage else ""
        lines = [f"{path}: stage {stage!r} ({factory.lstrip(', ')}) failed to start{hosted}: "
                 f"{config_paths_by_index(detail, cfg)}".replace(" ()", "")]
    else:
        message = config_paths_by_index(getattr(exc, "message", None) or str(exc).split("\n\n--- traceback", 1)[0], cfg)
        lines = [message]
        where = stage_paths(cfg, exc.process, plan)
        if where:
            lines.append(f"{indent}in {', '.join(where)}")
    if exc.traceback:
        trimmed = trim_traceback(exc.traceback).rstrip()
        if has_user_frames(trimmed):
            lines.append(f"{indent}the stage's code raised (omni's frames trimmed; {DEBUG_HINT}):")
            lines += [f"{indent}  {line}" for line in trimmed.splitlines()]
    return lines


def describe_stage_error(exc: StageError) -> str:
    """A request that failed in a stage: the one-line reason, then the stage code's own frames."""
    lines = [f"error: {str(exc).splitlines()[0]}"]
    trimmed = trim_traceback(exc.traceback or "").rstrip()
    if has_user_frames(trimmed):
        lines.append(f"  raised in stage {exc.stage!r} (omni's frames trimmed; {DEBUG_HINT}):")
        lines += ["    " + line for line in trimmed.splitlines()]
    return "\n".join(lines)
