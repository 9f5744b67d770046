"""`omni validate`."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from . import app, fail_config

# -- omni validate -------------------------------------------------------------------------------


@app.command()
def validate(
    config: Annotated[str, typer.Argument(help="A YAML/TOML file or a registered pipeline name.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    gpus: Annotated[int | None, typer.Option("--gpus", min=0, help="Check placement against this many simulated GPUs.")] = None,
) -> None:
    """Check a pipeline config: every error with its path, or a one-line summary.

    Placement (GPU ids, memory budgets, TP ranks) is checked too when the config places anything
    on GPUs or --gpus is given; `omni plan` shows the full plan."""
    from ..config import load_config
    from ..errors import ConfigError

    try:
        cfg = load_config(config)
        if gpus is not None or _places_on_gpus(cfg):
            from ..plan import build_plan
            from ..plugins import get_registry

            build_plan(cfg, get_registry(), gpus=gpus)
    except ConfigError as exc:
        fail_config(exc, source=config, as_json=as_json)
    processes = {s.process or s.name for s in cfg.stages}
    summary = (
        f"{config}: valid pipeline {cfg.name!r}: {len(cfg.stages)} stages, "
        f"{len(processes)} process groups, entry {cfg.entry!r}, terminal {', '.join(cfg.terminal_stages)}"
    )
    if as_json:
        print(json.dumps({"valid": True, "name": cfg.name, "stages": cfg.stage_names}, indent=2))
    else:
        print(summary)


def _places_on_gpus(cfg) -> bool:
    """Whether placement has anything to check (else it would only detect devices for nothing)."""
    return (
        cfg.placement.gpus is not None
        or cfg.placement.strategy != "explicit"
        or any(s.gpu is not None or s.memory is not None for s in cfg.stages)
    )
