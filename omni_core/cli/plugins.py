"""`omni plugins list`, `omni plugins new`, `omni plugins check`."""

from __future__ import annotations

import difflib
import json
import shutil
import textwrap
from typing import Annotated

import typer

from .common import LogLevel, err, plugins_app

# -- omni plugins list ---------------------------------------------------------------------------


def _hook_arg(hook: str) -> str:
    """The full hook name of ``--hook``; a usage error with the closest hook otherwise."""
    from ..plugins import HOOK_NAMES

    wanted = hook if hook.startswith("omni_") else f"omni_register_{hook}"
    if wanted in HOOK_NAMES:
        return wanted
    guess = difflib.get_close_matches(wanted, HOOK_NAMES, n=1)
    shown = (guess[0] if hook.startswith("omni_") else guess[0].removeprefix("omni_register_")) if guess else None
    hint = f" (did you mean {shown!r}?)" if shown else ""
    err.print(f"error: unknown hook {hook!r}{hint}; hooks are: {', '.join(HOOK_NAMES)}", markup=False, highlight=False)
    raise typer.Exit(2)


def render_plugins(infos, width: int) -> str:
    """The plugins as text at most ``width`` columns wide: a line per plugin (id, version,
    status), then one row per registered kind under the hook that registers it, names wrapped
    between names."""
    from ..registry import HOOK_KINDS

    kind_w = max(len(k) for kinds in HOOK_KINDS.values() for k in kinds)
    hook_w = max(len(h.removeprefix("omni_register_")) for h in HOOK_KINDS)
    indent = 2 + hook_w + 2 + kind_w + 2
    names_w = max(20, width - indent)
    lines = []
    for info in infos:
        status = "error" if info.error else "ok" + (" (built-in)" if info.builtin else "")
        version = info.version or "-" if info.distribution else "(not installed)"
        lines.append(f"{info.id}  {version}  {status}")
        for hook in info.hooks:
            kinds = [k for k in HOOK_KINDS[hook] if info.registered.get(k)]
            label = hook.removeprefix("omni_register_")
            if not kinds:
                lines.append(f"  {label:<{hook_w}}  {'-':<{kind_w}}")
            for i, kind in enumerate(kinds):
                wrapped = textwrap.wrap(", ".join(info.registered[kind]), names_w, break_long_words=False,
                                        break_on_hyphens=False) or ["-"]
                head = f"  {label if i == 0 else '':<{hook_w}}  {kind:<{kind_w}}  "
                lines.append(head + wrapped[0])
                lines += [" " * indent + more for more in wrapped[1:]]
        if info.error:
            lines += textwrap.wrap(f"error: {info.error}", max(20, width - 2), initial_indent="  ",
                                   subsequent_indent="    ", break_on_hyphens=False)
    return "\n".join(lines)


@plugins_app.command("list")
def plugins_list(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list instead of text.")] = False,
    hook: Annotated[
        str | None, typer.Option("--hook", metavar="NAME", help="Only plugins implementing this hook (relays, or omni_register_relays).")
    ] = None,
    log_level: LogLevel = None,
) -> None:
    """List every plugin omni found: id (distribution:entry point), version, status, and what
    each hook registered, one row per kind.

    Broken plugins are listed with their error; the command still succeeds."""
    from ..plugins import get_plugins

    plugins = get_plugins()
    infos = plugins.infos
    if hook is not None:
        wanted = _hook_arg(hook)
        infos = [i for i in infos if wanted in i.hooks]
    for warning in plugins.warnings:
        err.print(f"warning: {warning}", markup=False, highlight=False)
    if as_json:
        print(json.dumps([i.to_dict() for i in infos], indent=2))
        return
    print(render_plugins(infos, shutil.get_terminal_size((100, 24)).columns))
    broken = [i for i in infos if i.error]
    if broken:
        lines = [f"{len(broken)} plugin(s) with errors; names they would provide are unavailable:"]
        for info in broken:
            where = f"distribution {info.distribution} {info.version}" if info.distribution else "not installed"
            lines.append(f"  {info.name} ({where}, entry point {info.name} = {info.module}): {info.error}")
        err.print("\n".join(lines), markup=False, highlight=False)


# -- omni plugins new ----------------------------------------------------------------------------


@plugins_app.command("new")
def plugins_new(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The plugin's name: distribution omni-NAME, package omni_NAME, names NAME.*")],
    directory: Annotated[str, typer.Option("--dir", metavar="DIR", help="Where to create omni-NAME/ (default: the working directory).")] = ".",
    kind: Annotated[str, typer.Option("--kind", metavar="KIND", help="What the plugin contributes: stage (default), relay, placement, launcher, api or family (a model family for omni-transformers).")] = "stage",
    log_level: LogLevel = None,
) -> None:
    """Write a complete plugin distribution omni-NAME/: pyproject with the omni entry point, the
    plugin module, tests that run it in real processes, a tox matrix and a README."""
    from ..scaffold import (
        KINDS,
        ScaffoldError,
        curl_command,
        new_plugin,
        run_command,
        serve_command,
    )

    if kind not in KINDS:
        guess = difflib.get_close_matches(kind, list(KINDS), n=1)
        hint = f" (did you mean {guess[0]!r}?)" if guess else ""
        err.print(f"error: unknown --kind {kind!r}{hint}; kinds: {', '.join(KINDS)}", markup=False, highlight=False)
        raise typer.Exit(2)
    try:
        path = new_plugin(name, directory, kind)
    except ScaffoldError as exc:
        err.print(f"error: {exc}", markup=False, highlight=False)
        raise typer.Exit(1) from None
    dist = path.name
    print(f"created {path}/ (distribution {dist}, package omni_{name}, names {name}.*)")
    print("next:")
    print(f"  pip install -e '{path}[test]'")
    print(f"  cd {path} && pytest")
    print(f"  omni plugins check {dist}")
    print(f"  {run_command(name, kind)}")
    if kind == "api":
        print(f"  {serve_command(name)}    # then, from another terminal:")
        print(f"  {curl_command(name)}")


# -- omni plugins check --------------------------------------------------------------------------


@plugins_app.command("check")
def plugins_check(
    distributions: Annotated[list[str] | None, typer.Argument(metavar="[DIST]...", help="Distributions to check (default: every installed plugin).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the problems as JSON.")] = False,
    smoke: Annotated[bool, typer.Option("--smoke/--no-smoke", help="Run a relay conformance round per relay (default: on).")] = True,
    log_level: LogLevel = None,
) -> None:
    """Load each plugin distribution in a fresh process and report every problem: import and
    hook errors, names not namespaced by the plugin, functions whose signature does not fit
    their kind, pipelines that do not validate, relays without capabilities or options schema
    (and a conformance smoke round), dotted paths that do not import. Exit 1 if any error."""
    from ..plugin_check import check_in_subprocess, installed_distributions
    from ..registry import normalize_distribution

    installed = installed_distributions()
    wanted = [normalize_distribution(d) for d in distributions] if distributions else installed
    for dist in wanted:
        if dist not in installed:
            guess = difflib.get_close_matches(dist, installed, n=1)
            hint = f" (did you mean {guess[0]!r}?)" if guess else ""
            err.print(f"error: no installed distribution {dist!r} declares omni plugins{hint}; installed: "
                      f"{', '.join(installed)}", markup=False, highlight=False)
            raise typer.Exit(2)
    results = {dist: check_in_subprocess(dist, smoke=smoke) for dist in wanted}
    errors = sum(1 for ps in results.values() for p in ps if p.severity == "error")
    if as_json:
        print(json.dumps({"ok": errors == 0, "distributions": {d: [p.to_dict() for p in ps] for d, ps in results.items()}}, indent=2))
        raise typer.Exit(1 if errors else 0)
    width = shutil.get_terminal_size((100, 24)).columns
    for dist, problems in results.items():
        if not problems:
            print(f"{dist}: ok")
            continue
        print(f"{dist}:")
        for p in problems:
            where = f"{p.plugin} {p.name}" if p.name else p.plugin
            print(textwrap.fill(f"{p.severity}: {where}: {p.problem}", width, initial_indent="  ",
                                subsequent_indent="    ", break_long_words=False, break_on_hyphens=False))
            print(textwrap.fill(f"fix: {p.fix}", width, initial_indent="    ", subsequent_indent="      ",
                                break_long_words=False, break_on_hyphens=False))
    warnings = sum(1 for ps in results.values() for p in ps) - errors
    print(f"{len(results)} distribution(s) checked: {errors} error(s), {warnings} warning(s)")
    raise typer.Exit(1 if errors else 0)
