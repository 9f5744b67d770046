"""The ``omni`` command line: inspect plugins, validate, plan and run pipelines.

Each command is a thin shell over the library: it parses arguments, calls one public function and
prints. Exit codes: 0 success, 1 the input was wrong (config, request), 2 bad usage.
"""

from __future__ import annotations

import sys

from .common import LogLevel, app, debug_enabled, err, fail_config, out, plugins_app

__all__ = ["LogLevel", "app", "debug_enabled", "err", "fail_config", "main", "out", "plugins_app"]


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: a user error is one message and exit 1 (usage errors: 2), a
    Ctrl-C exits 130; ``--debug`` / ``OMNI_DEBUG=1`` shows the traceback instead."""
    try:
        app(args=argv, prog_name="omni")
    except KeyboardInterrupt:
        err.print("interrupted", markup=False, highlight=False)
        sys.exit(130)
    except Exception as exc:
        if debug_enabled():
            raise
        from .report import describe_error

        err.print(describe_error(exc), markup=False, highlight=False)
        sys.exit(1)


# Each command lives in its own module and registers itself on ``app``.
from . import clean as _clean  # noqa: E402,F401
from . import plan as _plan  # noqa: E402,F401
from . import plugins as _plugins  # noqa: E402,F401
from . import run as _run  # noqa: E402,F401
from . import serve as _serve  # noqa: E402,F401
from . import validate as _validate  # noqa: E402,F401
