"""`omni plugins list`."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from . import err, out, plugins_app

# -- omni plugins list ---------------------------------------------------------------------------


@plugins_app.command("list")
def plugins_list(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list instead of a table.")] = False,
    hook: Annotated[
        str | None, typer.Option("--hook", metavar="NAME", help="Only plugins implementing this hook (e.g. omni_register_relays).")
    ] = None,
) -> None:
    """List every plugin omni found: distribution, version, hooks, registered names, errors.

    Broken plugins are listed with their error; the command still succeeds."""
    from ..plugins import HOOK_NAMES, get_plugins

    infos = get_plugins().infos
    if hook is not None:
        wanted = hook if hook.startswith("omni_") else f"omni_register_{hook}"
        if wanted not in HOOK_NAMES:
            err.print(f"error: unknown hook {hook!r}; hooks are: {', '.join(HOOK_NAMES)}")
            raise typer.Exit(2)
        infos = [i for i in infos if wanted in i.hooks]
    if as_json:
        print(json.dumps([i.to_dict() for i in infos], indent=2))
        return
    table = Table(title="omni plugins", show_lines=False)
    for col in ("plugin", "distribution", "version", "hooks", "registered", "status"):
        table.add_column(col, overflow="fold")
    for info in infos:
        registered = "\n".join(f"{kind}: {', '.join(names)}" for kind, names in sorted(info.registered.items()))
        hooks = "\n".join(h.removeprefix("omni_register_") for h in info.hooks)
        if info.error:
            status = Text(f"error: {info.error}", style="red")
        else:
            status = Text("ok" + (" (built-in)" if info.builtin else ""), style="green")
        # Plain Text cells: names and errors are shown as they are, never read as rich markup.
        cells = (info.name, info.distribution or "-", info.version or "-", hooks or "-", registered or "-")
        table.add_row(*(Text(c) for c in cells), status)
    out.print(table)
    broken = [i for i in infos if i.error]
    if broken:
        lines = [f"{len(broken)} plugin(s) with errors; names they would provide are unavailable:"]
        for info in broken:
            where = f"distribution {info.distribution} {info.version}" if info.distribution else "not installed"
            lines.append(f"  {info.name} ({where}, entry point {info.name} = {info.module}): {info.error}")
        err.print("\n".join(lines), markup=False, highlight=False)
