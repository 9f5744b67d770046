"""`omni validate`."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from .common import LogLevel, app, err, fail_config

# -- omni validate -------------------------------------------------------------------------------


@app.command()
def validate(
    config: Annotated[str, typer.Argument(metavar="CONFIG", help="A YAML/TOML/JSON file or a registered pipeline name.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    gpus: Annotated[int | None, typer.Option("--gpus", min=0, metavar="N", help="Check placement against N simulated GPUs.")] = None,
    shallow: Annotated[bool, typer.Option("--shallow", help="Do not import stage factories (skips the checks of their arguments).")] = False,
    log_level: LogLevel = None,
) -> None:
    """Check a pipeline config: every error with its path, or a one-line summary.

    Stage factories are imported (from installed packages, the config file's folder and the
    working directory) to check that they exist and that `args` matches their signatures;
    --shallow skips that. Placement (GPU ids, memory budgets, TP ranks) is checked too when the
    config places anything on GPUs or --gpus is given; `omni plan` shows the full plan.
    Structural errors and the graph's are reported in one run, and serve.apis is checked as
    `omni serve` checks it."""
    from ..config import load_config
    from ..errors import ConfigError
    from .importpath import add_config_import_paths

    add_config_import_paths(config)
    warnings: tuple[str, ...] = ()
    try:
        # Structure and graph in one pass; serve: the check omni serve makes of serve.apis.
        cfg = load_config(config, import_factories=not shallow, serve=True)
        if gpus is not None or _places_on_gpus(cfg):
            from ..plan import build_plan
            from ..plugins import get_registry

            warnings = build_plan(cfg, get_registry(), gpus=gpus).warnings
    except ConfigError as exc:
        fail_config(exc, source=config, as_json=as_json)
    processes = {s.process or s.name for s in cfg.stages}
    summary = (
        f"{config}: valid pipeline {cfg.name!r}: {len(cfg.stages)} stages, "
        f"{len(processes)} process groups, entry {cfg.entry!r}, terminal {', '.join(cfg.terminal_stages)}"
    )
    to_caller = [s.name for s in cfg.stages if not s.terminal and "caller" in s.stream_to]
    if to_caller:
        summary += f", streaming to the caller {', '.join(to_caller)}"
    if as_json:
        result = {"valid": True, "name": cfg.name, "stages": cfg.stage_names}
        print(json.dumps({**result, "warnings": list(warnings)} if warnings else result, indent=2))
    else:
        print(summary)
        for warning in warnings:
            err.print(f"warning: {warning}", markup=False, highlight=False)


def _places_on_gpus(cfg) -> bool:
    """Whether placement has anything to check (else it would only detect devices for nothing)."""
    return (
        cfg.placement.gpus is not None
        or cfg.placement.strategy != "explicit"
        or any(s.gpu is not None or s.memory is not None for s in cfg.stages)
    )
