"""What every ``omni`` command shares: the typer apps, the consoles, ``--log-level`` and
``--debug``, and how a config error is printed. The commands (one module each) import it; the
package imports them, so that each registers itself on ``app``."""

from __future__ import annotations

import json
import os
import sys
from typing import Annotated

import typer
from rich.console import Console

from .._version import __version__
from ..logs import DEFAULT_LEVEL

app = typer.Typer(
    name="omni",
    help=(
        "Serve multi-stage model pipelines as a set of OS processes.\n\n"
        "Start with `omni plugins list` to see what is installed, `omni validate CONFIG` to check a "
        "pipeline config, and `omni run CONFIG --input JSON` to run one request. CONFIG is a YAML/TOML "
        "file or the name of a pipeline a plugin registered (for example `demo`)."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
plugins_app = typer.Typer(no_args_is_help=True)
app.add_typer(plugins_app, name="plugins")

out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, soft_wrap=True)


def _version(value: bool) -> None:
    if value:
        print(f"omni {__version__}")
        raise typer.Exit()


def debug_enabled() -> bool:
    """``--debug`` or ``OMNI_DEBUG=1``: tracebacks for bug reports instead of one-line errors."""
    return os.environ.get("OMNI_DEBUG", "").lower() in ("1", "true", "yes", "on")


LOG_LEVEL_HELP = (f"debug, info, {DEFAULT_LEVEL} (default) or error; also OMNI_LOG_LEVEL. Stage processes log at "
                  "the same level; other libraries (transformers, uvicorn, ray) show only their errors unless "
                  "the level is info or debug.")


def _apply_log_level(value: str | None) -> str | None:
    """Configure logging for the rest of this process and the processes it starts; the same for
    ``omni --log-level L CMD`` and ``omni CMD --log-level L`` (the latter wins)."""
    from ..logs import configure_logging, parse_level

    if value is not None:
        try:
            parse_level(value)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="'--log-level'") from None
        os.environ["OMNI_LOG_LEVEL"] = value  # stage processes read it when they configure logging
    configure_logging(value, force=True)
    return value


#: ``--log-level`` of every subcommand (``log_level: LogLevel = None``): applied as it is parsed.
LogLevel = Annotated[
    str | None,
    typer.Option("--log-level", metavar="LEVEL", callback=lambda value: value and _apply_log_level(value),
                 is_eager=True, help=LOG_LEVEL_HELP),
]


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    log_level: Annotated[
        str | None, typer.Option("--log-level", envvar="OMNI_LOG_LEVEL", metavar="LEVEL", help=LOG_LEVEL_HELP),
    ] = None,
    debug: Annotated[
        bool, typer.Option("--debug", help="Show Python tracebacks of errors (for bug reports); also OMNI_DEBUG=1.")
    ] = False,
) -> None:
    if debug:
        os.environ["OMNI_DEBUG"] = "1"
    _apply_log_level(log_level)


@plugins_app.callback()
def _plugins(log_level: LogLevel = None) -> None:
    """Inspect installed plugins."""


def fail_config(exc, *, source: str, as_json: bool):
    """Print every issue of a ConfigError (as JSON, or as text on stderr) and exit 1."""
    from ..errors import ConfigError

    if debug_enabled():
        raise exc
    if not exc.source:
        exc = ConfigError(exc.issues, source=source)
    if as_json:
        issues = [{"path": i.path, "message": i.message, "hint": i.hint} for i in exc.issues]
        print(json.dumps({"valid": False, "errors": issues}, indent=2))
    else:
        err.print(str(exc), markup=False, highlight=False)
    raise typer.Exit(1)
