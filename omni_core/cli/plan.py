"""`omni plan`."""

from __future__ import annotations

import enum
import json
from typing import Annotated

import typer

from .common import LogLevel, app, debug_enabled, err, fail_config


class PlanFormat(str, enum.Enum):
    text = "text"
    json = "json"
    mermaid = "mermaid"
    dot = "dot"


# -- omni plan -----------------------------------------------------------------------------------


@app.command()
def plan(
    config: Annotated[str, typer.Argument(metavar="CONFIG", help="A YAML/TOML/JSON file, a registered pipeline name or a checkpoint folder.")],
    gpus: Annotated[
        int | None,
        typer.Option("--gpus", min=0, metavar="N",
                     help="Plan for N simulated GPUs (default: placement.gpus, else the GPUs torch sees)."),
    ] = None,
    launcher: Annotated[
        str | None,
        typer.Option("--launcher", metavar="NAME", help="Plan for this launcher instead of the config's (e.g. ray)."),
    ] = None,
    cluster: Annotated[
        str | None,
        typer.Option("--cluster", metavar="FILE",
                     help="A cluster.yaml describing the nodes, for a launcher that places on nodes (ray)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Same as --format json.")] = False,
    fmt: Annotated[
        PlanFormat, typer.Option("--format", help="text (default), json, mermaid or dot.")
    ] = PlanFormat.text,
    model: Annotated[
        str | None,
        typer.Option("--model", metavar="DIR", help="A checkpoint folder given to every stage as args.model."),
    ] = None,
    log_level: LogLevel = None,
) -> None:
    """Show how a pipeline would run: the GPU of every stage and rank, the process groups, each
    edge's relay, the endpoints and any warnings. Starts nothing and imports no stage code."""
    import os

    from ..config import load_config
    from ..errors import ConfigError, PluginError
    from ..plan import build_plan
    from ..plan.render import plan_dict, render_dot, render_mermaid, render_text
    from ..plugins import get_registry

    if as_json and fmt not in (PlanFormat.text, PlanFormat.json):
        err.print(f"error: --json and --format {fmt.value} contradict each other; pass one of them")
        raise typer.Exit(2)
    fmt = PlanFormat.json if as_json else fmt
    from .importpath import add_config_import_paths

    add_config_import_paths(config)  # a placement strategy or function given by dotted path beside the config
    try:
        cfg = load_config(config, model=model)
        if launcher is not None:
            cfg = _with_launcher(cfg, launcher)
        result = build_plan(cfg, get_registry(), gpus=gpus, environ=os.environ)
        result = _on_nodes(result, cluster)
    except ConfigError as exc:
        fail_config(exc, source=config, as_json=fmt is PlanFormat.json)
    except (PluginError, LookupError) as exc:
        if debug_enabled():
            raise
        err.print(f"error: {exc}", markup=False, highlight=False)
        raise typer.Exit(1) from None
    renderers = {
        PlanFormat.text: render_text,
        PlanFormat.json: lambda p: json.dumps(plan_dict(p), indent=2) + "\n",
        PlanFormat.mermaid: render_mermaid,
        PlanFormat.dot: render_dot,
    }
    print(renderers[fmt](result), end="")


def _with_launcher(cfg, name: str):
    """``cfg`` launched by ``name`` (options dropped unless it already names that launcher),
    validated again: its stages' ``launch:`` mappings are now that launcher's to check."""
    import attrs

    from ..config.validate import validate_config

    if cfg.launcher.name != name:
        cfg = attrs.evolve(cfg, launcher=attrs.evolve(cfg.launcher, name=name, options={}))
    validate_config(cfg)
    return cfg


def _on_nodes(plan, cluster: str | None):
    """The plan with a node per process when its launcher places on nodes (``plan_nodes``)."""
    from ..contracts import launcher_class
    from ..plugins import get_registry

    name = plan.config.launcher.name
    placed = launcher_class(get_registry().resolve("launcher", name), name).plan_nodes(plan, cluster)
    if placed is None:
        if cluster is not None:
            raise LookupError(f"--cluster needs a launcher that places processes on nodes (such as ray); "
                              f"launcher {name!r} runs every process on this machine")
        return plan
    return placed
