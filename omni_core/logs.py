"""Logging, configured once in one place: structlog, human-readable on a TTY, JSON lines otherwise.

Every process omni starts calls :func:`configure_logging` once; loggers are bound with ``pipeline``,
``stage``, ``process`` and ``request_id`` where those are known.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


def configure_logging(level: str | int | None = None, *, json: bool | None = None, force: bool = False) -> None:
    """Configure structlog and the stdlib root logger (idempotent unless ``force``).

    ``level`` defaults to ``OMNI_LOG_LEVEL`` or ``WARNING``; ``json`` defaults to "stderr is not a
    TTY" and can be forced with ``OMNI_LOG_FORMAT=json|console``.
    """
    global _configured
    if _configured and not force:
        return
    level = level or os.environ.get("OMNI_LOG_LEVEL", "WARNING")
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
        if not isinstance(level, int):
            level = logging.WARNING
    if json is None:
        fmt = os.environ.get("OMNI_LOG_FORMAT")
        json = fmt == "json" if fmt in ("json", "console") else not sys.stderr.isatty()
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s", force=force)
    _configured = True


def get_logger(**bind: object) -> structlog.stdlib.BoundLogger:
    """A logger bound with the given context (``stage=..., request_id=...``)."""
    configure_logging()
    return structlog.get_logger("omni").bind(**bind)
