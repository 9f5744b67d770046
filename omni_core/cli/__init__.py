"""The ``omni`` command line: inspect plugins, validate, plan and run pipelines.

Each command is a thin shell over the library: it parses arguments, calls one public function and
prints. Exit codes: 0 success, 1 the input was wrong (config, request), 2 bad usage.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.console import Console

from .. import __version__

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
plugins_app = typer.Typer(help="Inspect installed plugins.", no_args_is_help=True)
app.add_typer(plugins_app, name="plugins")

out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, soft_wrap=True)


def _version(value: bool) -> None:
    if value:
        print(f"omni {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    log_level: Annotated[
        str | None, typer.Option("--log-level", envvar="OMNI_LOG_LEVEL", help="debug, info, warning (default), error.")
    ] = None,
) -> None:
    from ..logs import configure_logging

    configure_logging(log_level)


def fail_config(exc, *, source: str, as_json: bool):
    """Print every issue of a ConfigError (as JSON, or as text on stderr) and exit 1."""
    from ..errors import ConfigError

    if not exc.source:
        exc = ConfigError(exc.issues, source=source)
    if as_json:
        issues = [{"path": i.path, "message": i.message, "hint": i.hint} for i in exc.issues]
        print(json.dumps({"valid": False, "errors": issues}, indent=2))
    else:
        err.print(str(exc), markup=False, highlight=False)
    raise typer.Exit(1)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    try:
        app(args=argv, prog_name="omni")
    except KeyboardInterrupt:
        sys.exit(130)


# Each command lives in its own module and registers itself on ``app``.
from . import clean as _clean  # noqa: E402,F401
from . import plan as _plan  # noqa: E402,F401
from . import plugins as _plugins  # noqa: E402,F401
from . import run as _run  # noqa: E402,F401
from . import serve as _serve  # noqa: E402,F401
from . import validate as _validate  # noqa: E402,F401
