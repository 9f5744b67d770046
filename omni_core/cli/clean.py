"""`omni clean`: find and remove what crashed runs left behind."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from .common import LogLevel, app, err


@app.command()
def clean(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only report what would be removed.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the findings as JSON.")] = False,
    log_level: LogLevel = None,
) -> None:
    """Report and remove leftovers of runs whose parent process is dead: runtime directories and
    each installed relay's resources (for example /dev/shm segments of the shm relay).

    Running pipelines are never touched. omni also sweeps these at every pipeline start."""
    from ..plugins import get_registry
    from ..runtime.pipeline import sweep_stale_runtime_dirs

    found: dict[str, list[str]] = {"runtime_dirs": sweep_stale_runtime_dirs(dry_run=dry_run)}
    for entry in get_registry().entries("relay"):
        try:
            found[f"relay {entry.name}"] = list(entry.load().sweep(None, dry_run=dry_run))
        except TypeError:  # a relay whose sweep cannot dry-run: never remove in a dry run
            if not dry_run:
                found[f"relay {entry.name}"] = list(entry.load().sweep(None))
        except Exception as exc:
            err.print(f"warning: relay {entry.name!r} could not be swept: {exc}", markup=False)
    if as_json:
        print(json.dumps({"dry_run": dry_run, "found": found}, indent=2))
        return
    verb = "stale" if dry_run else "removed"
    total = 0
    for what, items in found.items():
        for item in items:
            print(f"{verb}: {what}: {item}")
        total += len(items)
    print(f"{total} stale item(s) {'found' if dry_run else 'removed'}")
