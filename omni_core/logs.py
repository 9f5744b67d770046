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
    or WARNING. A ValueError names the levels for anything else."""
    if level is None:
        level = os.environ.get("OMNI_LOG_LEVEL") or "WARNING"
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


def _dispatch(logger: object, method: str, event_dict: dict) -> dict:
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
            print(message, file=sys.stderr, flush=True)

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


def configure_logging(level: str | int | None = None, *, json: bool | None = None, force: bool = False) -> None:
    """Configure structlog and the stdlib root logger (idempotent unless ``force``).

    ``level`` defaults to ``OMNI_LOG_LEVEL`` or ``WARNING`` (an unknown name: WARNING); ``json``
    defaults to "stderr is not a TTY" and can be forced with ``OMNI_LOG_FORMAT=json|console``.
    """
    global _configured, _level
    if _configured and not force:
        return
    try:
        level = parse_level(level)
    except ValueError:
        level = logging.WARNING
    _level = level
    if json is None:
        fmt = os.environ.get("OMNI_LOG_FORMAT")
        json = fmt == "json" if fmt in ("json", "console") else not sys.stderr.isatty()
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _dispatch,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        # Events below info never reach a processor: per-request debug events cost nothing
        # unless asked for.
        wrapper_class=structlog.make_filtering_bound_logger(min(level, logging.INFO)),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=force)
    _configured = True


def get_logger(**bind: object) -> structlog.stdlib.BoundLogger:
    """A logger bound with the given context (``stage=..., request_id=...``)."""
    configure_logging()
    return structlog.get_logger("omni").bind(**bind)
