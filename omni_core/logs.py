"""Logging, configured once in one place: structlog, human-readable on a TTY, JSON lines otherwise.

Every process omni starts calls :func:`configure_logging` once; loggers are bound with ``pipeline``,
``stage``, ``process`` and ``request_id`` where those are known.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

#: The one default level of every omni command and process (``OMNI_LOG_LEVEL``, ``--log-level``).
DEFAULT_LEVEL = "warning"

_configured = False
_level = logging.WARNING
_listeners: list[Callable[[dict], None]] = []

LEVELS = ("debug", "info", "warning", "error", "critical")
_METHOD_LEVELS = {
    "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "warn": logging.WARNING,
    "error": logging.ERROR, "exception": logging.ERROR, "critical": logging.CRITICAL, "fatal": logging.CRITICAL,
}


def parse_level(level: str | int | None) -> int:
    """``"debug"`` / ``"INFO"`` / ``logging.WARNING`` → the level number; None → ``OMNI_LOG_LEVEL``
    or :data:`DEFAULT_LEVEL`. A ValueError names the levels for anything else."""
    if level is None:
        level = os.environ.get("OMNI_LOG_LEVEL") or DEFAULT_LEVEL
    if isinstance(level, int):
        return level
    value = logging.getLevelName(level.strip().upper())
    if not isinstance(value, int):
        raise ValueError(f"unknown log level {level!r}; use one of {', '.join(LEVELS)}")
    return value


def add_listener(callback: Callable[[dict], None]) -> None:
    """Call ``callback(event_dict)`` for every event at ``info`` or above, whatever the output
    level (the CLI's start-up progress line listens for ``process ready``)."""
    _listeners.append(callback)


def remove_listener(callback: Callable[[dict], None]) -> None:
    with contextlib.suppress(ValueError):
        _listeners.remove(callback)


def _dispatch(logger: WrappedLogger, method: str, event_dict: EventDict) -> EventDict:
    """Hand the event to the listeners, then drop it if it is below the output level (events
    reach here from ``info`` up, so that listeners see them at the default level too)."""
    for callback in list(_listeners):
        with contextlib.suppress(Exception):
            callback(dict(event_dict))
    if _METHOD_LEVELS.get(method, logging.INFO) < _level:
        raise structlog.DropEvent
    return event_dict


class _StderrLogger:
    """Writes each rendered line to the *current* ``sys.stderr`` (a test harness or a server may
    swap it), and never raises: a log line must not break the code that logs it."""

    def msg(self, message: str) -> None:
        with contextlib.suppress(ValueError, OSError):
            # One write for the line and its newline: with unbuffered stderr (PYTHONUNBUFFERED),
            # print's two writes let another process's line land between them.
            sys.stderr.write(message + "\n")
            sys.stderr.flush()

    log = debug = info = warning = warn = error = critical = exception = fatal = msg


def _stderr_logger(*_: object) -> _StderrLogger:
    return _StderrLogger()


class _Stderr:
    """Whatever ``sys.stderr`` is at the time of writing (a test runner swaps and closes it; a
    stream captured at configuration time would then be written to after it was closed)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


class _StderrHandler(logging.StreamHandler):
    """A stdlib handler writing to the current ``sys.stderr`` (see :class:`_Stderr`)."""

    def __init__(self) -> None:
        super().__init__(_Stderr())


#: Libraries' loggers (transformers, uvicorn, ray, Python warnings ...) show their records from this
#: level up while omni logs at ``warning`` or above: quiet at the default level, all there with
#: ``--log-level info`` or ``debug``.
LIBRARY_QUIET_LEVEL = logging.ERROR

#: Libraries that give their root logger a stderr handler of their own and stop propagation;
#: omni keeps them propagating to its own handler instead (see :class:`_RoutedLogger`).
ROUTED_LIBRARIES = ("transformers", "ray")

#: Set for libraries that read them at import: progress bars off, no advisory warnings. The value
#: of each variable omni set itself, so that a later configuration can change it and a user's own
#: setting is never overwritten.
_LIBRARY_ENV_QUIET = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
_env_set: dict[str, str] = {}


def library_level(level: int) -> int:
    """The level from which other libraries' records are shown when omni logs at ``level``."""
    return level if level < logging.WARNING else max(level, LIBRARY_QUIET_LEVEL)


class _LibraryFilter(logging.Filter):
    """Passes omni's own stdlib records at the output level and other libraries' from
    :func:`library_level`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "omni" or record.name.startswith("omni."):
            return record.levelno >= _level
        return record.levelno >= library_level(_level)


def _is_console_handler(handler: logging.Handler) -> bool:
    stream = getattr(handler, "stream", None)
    return (isinstance(handler, logging.StreamHandler) and not isinstance(handler, (logging.FileHandler, _StderrHandler))
            and stream in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__))


class _RoutedLogger(logging.Logger):
    """The root logger of a library in :data:`ROUTED_LIBRARIES`: it never gets a console handler
    of its own and always propagates, so its records reach omni's handler (and its format and
    level rules) whenever the library configures itself, before or after omni does."""

    @property
    def propagate(self) -> bool:
        return True

    @propagate.setter
    def propagate(self, _value: bool) -> None:
        pass

    def addHandler(self, handler: logging.Handler) -> None:  # noqa: N802 - logging's name
        if not _is_console_handler(handler):
            super().addHandler(handler)


def _route_library_loggers() -> None:
    """Make each routed library's root logger a :class:`_RoutedLogger`, whether the library was
    imported already (its console handler is dropped) or will be."""
    manager = logging.Logger.manager
    for name in ROUTED_LIBRARIES:
        existing = manager.loggerDict.get(name)
        if isinstance(existing, logging.Logger):
            for handler in [h for h in existing.handlers if _is_console_handler(h)]:
                existing.removeHandler(handler)
            if not isinstance(existing, _RoutedLogger):
                existing.__class__ = _RoutedLogger
            continue
        previous = manager.loggerClass
        manager.setLoggerClass(_RoutedLogger)
        try:
            logging.getLogger(name)
        finally:
            manager.loggerClass = previous


def _quiet_library_env(level: int) -> None:
    """At the default level and above, libraries that read the environment at import show no
    progress bars and no advisory warnings (a variable the user set is left alone)."""
    for key, value in _LIBRARY_ENV_QUIET.items():
        if key in os.environ and _env_set.get(key) != os.environ[key]:
            continue  # the user's own
        if level >= logging.WARNING:
            os.environ[key] = _env_set[key] = value
        elif key in _env_set:
            os.environ.pop(key, None)
            del _env_set[key]
    if level >= logging.WARNING and "transformers.utils.logging" in sys.modules:  # imported before: too late for the env
        with contextlib.suppress(Exception):
            sys.modules["transformers.utils.logging"].disable_progress_bar()


def configure_logging(level: str | int | None = None, *, json: bool | None = None, force: bool = False) -> None:
    """Configure structlog and the stdlib root logger (idempotent unless ``force``).

    ``level`` defaults to ``OMNI_LOG_LEVEL`` or :data:`DEFAULT_LEVEL` (also for an unknown name); ``json``
    defaults to "stderr is not a TTY" and can be forced with ``OMNI_LOG_FORMAT=json|console``.

    Other libraries' log records (uvicorn, transformers, ray) go through the same handler and
    format, shown from :func:`library_level`: at ``warning`` and above only their errors. With
    ``force`` (a process omni owns: the CLI, a stage process) Python warnings are logged too, the
    libraries of :data:`ROUTED_LIBRARIES` lose their own console handlers, and progress bars are
    off at ``warning`` and above.
    """
    global _configured, _level
    if _configured and not force:
        return
    try:
        level = parse_level(level)
    except ValueError:
        level = parse_level(DEFAULT_LEVEL)
    _level = level
    if json is None:
        fmt = os.environ.get("OMNI_LOG_FORMAT")
        json = fmt == "json" if fmt in ("json", "console") else not sys.stderr.isatty()
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    stamp: list[Processor] = [structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True)]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _dispatch,
            *stamp,
            structlog.processors.format_exc_info,
            renderer,
        ],
        # Events below info never reach a processor: per-request debug events cost nothing
        # unless asked for.
        wrapper_class=structlog.make_filtering_bound_logger(min(level, logging.INFO)),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )
    # Records of the stdlib's loggers (other libraries, Python warnings) are rendered like omni's
    # own events, with the logger's name.
    handler = _StderrHandler()
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        foreign_pre_chain=[structlog.stdlib.add_logger_name, *stamp, structlog.processors.format_exc_info],
    ))
    handler.addFilter(_LibraryFilter())
    logging.basicConfig(level=level, handlers=[handler], force=force)
    if force:  # omni owns this process (the CLI, a stage process): other libraries' output too
        logging.captureWarnings(True)
        _route_library_loggers()
        _quiet_library_env(level)
    _configured = True


def get_logger(**bind: object) -> structlog.stdlib.BoundLogger:
    """A logger bound with the given context (``stage=..., request_id=...``)."""
    configure_logging()
    return structlog.get_logger("omni").bind(**bind)
