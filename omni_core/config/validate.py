"""Whole-graph validation of a structured config: every rule of docs/config.md, every error at once.

Each rule is a small function ``rule(cfg, ctx) -> None`` that reports through ``ctx.add(path,
message, hint)``; :func:`validate_config` runs them all and raises one ConfigError. Names of
factories, functions, relays, placements and launchers are checked against the plugin registry
without importing anything a plugin registered lazily.
"""

from __future__ import annotations

import difflib
import inspect
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from ..contracts import launcher_class
from ..errors import ConfigError, ConfigIssue, PluginError
from ..registry import Registry, import_ref, is_dotted_path, signature_text
from .schema import CALLER_STAGE, INJECTED_ARGS, PipelineConfig, StageConfig


@attrs.define
class _Context:
    cfg: PipelineConfig
    registry: Registry
    issues: list[ConfigIssue] = attrs.Factory(list)
    #: Import stage factories to check them against their signatures (``omni validate``; the
    #: runtime planner never imports one).
    import_factories: bool = False
    #: Check what only ``omni serve`` reads (``serve.apis``): ``omni validate`` and ``omni serve``
    #: do; ``omni run`` and the library ignore the ``serve`` section.
    serve: bool = False

    def add(self, path: str, message: str, hint: str | None = None) -> None:
        self.issues.append(ConfigIssue(path, message, hint))

    @property
    def names(self) -> list[str]:
        return self.cfg.stage_names

    def unknown_stage(self, path: str, name: str, role: str) -> None:
        guess = difflib.get_close_matches(name, self.names, n=1)
        hint = f"did you mean {guess[0]!r}?" if guess else f"stages are: {', '.join(self.names)}"
        self.add(path, f"{role} names unknown stage {name!r}", hint)


Rule = Callable[[PipelineConfig, _Context], None]
RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def _sp(i: int, field: str | None = None) -> str:
    return f"stages[{i}]" + (f".{field}" if field else "")


# -- values ------------------------------------------------------------------------------------


def _walk_ranges(obj: Any, path: str, ctx: _Context) -> None:
    for field in attrs.fields(type(obj)):
        value = getattr(obj, field.name)
        sub = f"{path}.{field.name}" if path else field.name
        check = field.metadata.get("check")
        if check == "positive" and value is not None and value <= 0:
            ctx.add(sub, f"must be greater than 0, got {value!r}")
        elif check == "non_negative" and value is not None and value < 0:
            ctx.add(sub, f"must be 0 or more, got {value!r}")
        if attrs.has(type(value)):
            _walk_ranges(value, sub, ctx)
        elif isinstance(value, tuple):
            for i, item in enumerate(value):
                if attrs.has(type(item)):
                    _walk_ranges(item, f"{sub}[{i}]", ctx)


@rule
def value_ranges(cfg: PipelineConfig, ctx: _Context) -> None:
    _walk_ranges(cfg, "", ctx)


@rule
def has_stages(cfg: PipelineConfig, ctx: _Context) -> None:
    if not cfg.stages:
        ctx.add("stages", "a pipeline needs at least one stage")


@rule
def unique_names(cfg: PipelineConfig, ctx: _Context) -> None:
    first: dict[str, int] = {}
    for i, stage in enumerate(cfg.stages):
        if not stage.name or stage.name != stage.name.strip() or any(c in stage.name for c in "/\\:\x00"):
            ctx.add(_sp(i, "name"), f"invalid stage name {stage.name!r}", "use letters, digits, '-', '_' or '.'")
        if stage.name == CALLER_STAGE:
            ctx.add(_sp(i, "name"), f"the stage name {CALLER_STAGE!r} is reserved (stream_to: [{CALLER_STAGE}] names "
                    "the request's caller)", "give the stage another name")
        if stage.name in first:
            ctx.add(_sp(i, "name"), f"duplicate stage name {stage.name!r} (also stages[{first[stage.name]}])",
                    "give every stage its own name")
        first.setdefault(stage.name, i)


@rule
def entry_exists(cfg: PipelineConfig, ctx: _Context) -> None:
    if cfg.entry_stage is not None and cfg.entry_stage not in ctx.names:
        ctx.unknown_stage("entry_stage", cfg.entry_stage, "entry_stage")
    if cfg.stages and cfg.entry in ctx.names:
        i = ctx.names.index(cfg.entry)
        if cfg.stages[i].wait_for:
            ctx.add(_sp(i, "wait_for"), f"the entry stage {cfg.entry!r} cannot wait for other stages",
                    "the caller's inputs are its only payload; set entry_stage to another stage")


# -- wiring ------------------------------------------------------------------------------------


def _refs(ctx: _Context, i: int, field: str, names: Iterable[str], role: str) -> None:
    stage = ctx.cfg.stages[i]
    for k, name in enumerate(names):
        path = _sp(i, f"{field}[{k}]")
        if field == "stream_to" and name == CALLER_STAGE:
            if stage.terminal:
                ctx.add(path, f"stage {stage.name!r} is terminal: its chunks already go to the caller",
                        f"remove {CALLER_STAGE!r} from its stream_to")
            continue
        if name not in ctx.names:
            ctx.unknown_stage(path, name, role)
        elif name == stage.name and field != "next":
            # A stage in its own next is a cycle, judged by the cycle rule; waiting for or
            # streaming to itself never makes sense.
            ctx.add(path, f"stage {stage.name!r} names itself in {field}")


@rule
def references(cfg: PipelineConfig, ctx: _Context) -> None:
    for i, stage in enumerate(cfg.stages):
        _refs(ctx, i, "next", stage.next, "next")
        _refs(ctx, i, "wait_for", stage.wait_for, "wait_for")
        _refs(ctx, i, "stream_to", stage.stream_to, "stream_to")
        for target in stage.project_payload:
            if target not in stage.next:
                ctx.add(_sp(i, f"project_payload.{target}"),
                        f"projection for {target!r}, which is not in this stage's next",
                        f"next is {list(stage.next)}")
        for target in stage.project_stream:
            if target not in stage.stream_to and not (target == CALLER_STAGE and stage.terminal):
                ctx.add(_sp(i, f"project_stream.{target}"),
                        f"stream projection for {target!r}, which this stage does not stream to",
                        f"stream_to is {list(stage.stream_to)}")


@rule
def next_xor_terminal(cfg: PipelineConfig, ctx: _Context) -> None:
    for i, stage in enumerate(cfg.stages):
        if stage.next and stage.terminal:
            ctx.add(_sp(i), f"stage {stage.name!r} has both 'next' and 'terminal: true'",
                    "a terminal stage returns its result to the caller; remove one of them")
        elif not stage.next and not stage.terminal:
            ctx.add(_sp(i), f"stage {stage.name!r} has neither 'next' nor 'terminal: true'",
                    "say where its output goes, or mark it terminal")
    if cfg.stages and not cfg.terminal_stages:
        ctx.add("stages", "no stage is terminal, so no request could ever finish",
                "mark the last stage(s) with 'terminal: true'")


@rule
def function_dependencies(cfg: PipelineConfig, ctx: _Context) -> None:
    for i, stage in enumerate(cfg.stages):
        if stage.wait_for and not stage.merge_fn:
            ctx.add(_sp(i, "wait_for"), f"stage {stage.name!r} waits for {list(stage.wait_for)} but has no merge_fn",
                    "add 'merge_fn: omni.merge_dicts' (or omni.by_source, or your own)")
        if stage.merge_fn and not stage.wait_for:
            ctx.add(_sp(i, "merge_fn"), "merge_fn without wait_for has nothing to merge",
                    "list the stages to wait for in 'wait_for', or remove merge_fn")
        if stage.wait_for_fn and not stage.wait_for:
            ctx.add(_sp(i, "wait_for_fn"), "wait_for_fn needs 'wait_for' (it picks a subset of it)")
        if stage.route_fn and not stage.next:
            ctx.add(_sp(i, "route_fn"), "route_fn needs 'next' (it picks a subset of it)")
        if stage.stream_done_to_fn and not stage.stream_to:
            ctx.add(_sp(i, "stream_done_to_fn"), "stream_done_to_fn needs 'stream_to'")


@rule
def fan_in_sources_route_here(cfg: PipelineConfig, ctx: _Context) -> None:
    by_name = {s.name: s for s in cfg.stages}
    for i, stage in enumerate(cfg.stages):
        for k, source in enumerate(stage.wait_for):
            src = by_name.get(source)
            if src is not None and src.name != stage.name and stage.name not in src.next:
                j = ctx.names.index(source)
                ctx.add(_sp(i, f"wait_for[{k}]"), f"stage {source!r} does not route to {stage.name!r}, so it would wait forever",
                        f"add {stage.name!r} to stages[{j}].next")
        senders = [s.name for s in cfg.stages if stage.name in s.next]
        if stage.wait_for and len(senders) > 0:
            extra = [s for s in senders if s not in stage.wait_for]
            if extra:
                ctx.add(_sp(i, "wait_for"), f"stages {extra} route to fan-in stage {stage.name!r} but are not in its wait_for",
                        "add them to wait_for, or remove the stage from their next")


def _next_graph(cfg: PipelineConfig) -> dict[str, list[str]]:
    """Stage name → the stages it routes to (a duplicated name, already reported, keeps the
    edges of every stage that carries it, so it causes no second error)."""
    names = set(cfg.stage_names)
    graph: dict[str, list[str]] = {}
    for s in cfg.stages:
        graph.setdefault(s.name, []).extend(t for t in s.next if t in names)
    return graph


def find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """One cycle of the graph as a list of names (first == last), or None."""
    color: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        color[node] = 1
        stack.append(node)
        for nxt in graph.get(node, []):
            if color.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in color and (found := visit(nxt)):
                return found
        stack.pop()
        color[node] = 2
        return None

    for node in graph:
        if node not in color and (found := visit(node)):
            return found
    return None


def strongly_connected(graph: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of the graph that contain a cycle (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, []):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, []):
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


@rule
def acyclic_unless_declared(cfg: PipelineConfig, ctx: _Context) -> None:
    graph = _next_graph(cfg)
    if not cfg.allow_cycles:
        cycle = find_cycle(graph)
        if cycle:
            ctx.add("stages", f"the stages form a cycle: {' -> '.join(cycle)}",
                    "set 'allow_cycles: true' if the loop is intended (a route_fn must end it)")
        return
    by_name = {s.name: s for s in cfg.stages}
    for component in strongly_connected(graph):
        if not any(by_name[name].route_fn for name in component):
            ctx.add("stages", f"the cycle through {', '.join(component)} has no route_fn, so a request "
                    "would loop forever", "give one of these stages a route_fn that leaves the loop")


@rule
def reachable_from_entry(cfg: PipelineConfig, ctx: _Context) -> None:
    if not cfg.stages or cfg.entry not in ctx.names:
        return
    graph = _next_graph(cfg)
    seen, todo = {cfg.entry}, [cfg.entry]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    for i, stage in enumerate(cfg.stages):
        if stage.name not in seen:
            ctx.add(_sp(i), f"stage {stage.name!r} is not reachable from the entry stage {cfg.entry!r}",
                    "add it to some stage's next, or remove it")


# -- processes and devices ------------------------------------------------------------------------


@rule
def processes(cfg: PipelineConfig, ctx: _Context) -> None:
    own_process = {s.name for s in cfg.stages if s.process is None}
    groups: dict[str, list[int]] = {}
    for i, stage in enumerate(cfg.stages):
        if stage.process is not None:
            groups.setdefault(stage.process, []).append(i)
            if stage.process in own_process:
                ctx.add(_sp(i, "process"), f"process {stage.process!r} is also the name of stage "
                        f"{stage.process!r}, which runs in a process of its own",
                        f"rename the process, or set 'process: {stage.process}' on that stage too")
        if stage.gpu is not None:
            if len(stage.gpu) not in (1, stage.tp_size):
                ctx.add(_sp(i, "gpu"), f"{len(stage.gpu)} GPU ids for tp_size {stage.tp_size}",
                        f"give one id per rank ({stage.tp_size}) or a single id")
            for k, gpu in enumerate(stage.gpu):
                if gpu < 0:
                    ctx.add(_sp(i, "gpu" if len(stage.gpu) == 1 else f"gpu[{k}]"),
                            f"GPU ids start at 0, got {gpu}", "use null to run on the CPU")
        for key in stage.env:
            if not key or "=" in key or "\x00" in key:
                ctx.add(_sp(i, "env"), f"invalid environment variable name {key!r}")
    for key in cfg.env_defaults:
        if not key or "=" in key or "\x00" in key:
            ctx.add("env_defaults", f"invalid environment variable name {key!r}")
    for name, members in groups.items():
        if len(members) < 2:
            continue
        first = cfg.stages[members[0]]
        for i in members:
            stage = cfg.stages[i]
            if stage.tp_size > 1:
                ctx.add(_sp(i, "process"), f"tensor-parallel stage {stage.name!r} (tp_size {stage.tp_size}) shares process {name!r}",
                        "a TP stage owns its processes (one per rank); remove 'process' from it")
            if stage.replicas > 1:
                ctx.add(_sp(i, "replicas"), f"stage {stage.name!r} has replicas but shares process {name!r}",
                        "replicated stages get processes of their own; remove 'process' or 'replicas'")
            for field in ("gpu", "env", "threads"):
                if i != members[0] and getattr(stage, field) != getattr(first, field):
                    ctx.add(_sp(i, field), f"stages {first.name!r} and {stage.name!r} share process {name!r} but set different {field}",
                            f"give both the same {field}, or separate processes")


# -- names resolved through the plugin registry --------------------------------------------------


def _resolvable(ctx: _Context, path: str, kind: str, ref: str | None) -> str | None:
    """Report why ``ref`` does not resolve as ``kind``; returns that problem (None: it resolves)."""
    if ref is None:
        return None
    problem = ctx.registry.problem(kind, ref)
    if problem:
        ctx.add(path, problem)
    return problem


def _imported_factory(ctx: _Context, i: int) -> Any:
    """The factory object of stage ``i`` when it can be had without side effects (registered as
    an object, or a dotted path whose module is loaded), or by importing it when the context
    says so (then an import failure is reported at ``stages[i].factory``); None otherwise."""
    ref = ctx.cfg.stages[i].factory
    if ctx.import_factories:
        try:
            return ctx.registry.resolve("stage", ref)
        except PluginError as exc:
            ctx.add(_sp(i, "factory"), str(exc), "check the module and attribute name, and that the module imports without error")
            return None
    if is_dotted_path(ref):
        module, _, _ = ref.partition(":")
        if module not in sys.modules:
            return None
        try:
            return import_ref(ref)
        except PluginError:
            return None
    entry = ctx.registry.get("stage", ref)
    if isinstance(entry.target, str):
        return entry._loaded
    return entry.target


def factory_arg_issues(stage: StageConfig, path: str, factory: Any) -> list[ConfigIssue]:
    """``args`` keys ``factory`` does not accept (with the closest parameter name) and the
    required parameters nobody supplies, each at ``path`` (``stages[0]``) plus ``.args``.
    Used by ``omni validate`` and by a stage process before it calls the factory."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return []
    named = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    shown = signature_text(factory)
    issues = []
    if not takes_any:
        for key in stage.args:
            if key not in named:
                guess = difflib.get_close_matches(str(key), [n for n in named if n not in stage.args], n=1)
                issues.append(ConfigIssue(
                    f"{path}.args.{key}",
                    f"factory {stage.factory!r} does not accept argument {key!r}"
                    + (f" (did you mean {guess[0]!r}?)" if guess else ""),
                    f"its signature is {shown}",
                ))
    for name, param in named.items():
        if param.default is param.empty and name not in stage.args and name not in INJECTED_ARGS:
            issues.append(ConfigIssue(f"{path}.args", f"factory {stage.factory!r} needs argument {name!r}",
                                      f"add it under args; the signature is {shown}"))
    return issues


def _factory_args(ctx: _Context, i: int) -> None:
    """``args`` keys the factory does not accept, and required parameters nobody supplies."""
    factory = _imported_factory(ctx, i)
    if factory is not None:
        ctx.issues.extend(factory_arg_issues(ctx.cfg.stages[i], _sp(i), factory))


def stage_environment(cfg: PipelineConfig, stage: StageConfig, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment ``stage``'s process gets as far as the config and this machine tell:
    ``env_defaults``, the stage's ``env``, then ``environ`` (default ``os.environ``), which wins."""
    environ = os.environ if environ is None else environ
    return {**{k: str(v) for k, v in cfg.env_defaults.items()}, **stage.env, **environ}


def stage_arg_check_issues(cfg: PipelineConfig, registry: Registry) -> list[ConfigIssue]:
    """What the argument checks of the stage factories (``register(name, factory, check=fn)``)
    find in their stages' ``args``, at ``stages[i].args.<key>``. The one place these checks
    run: ``omni validate`` (through :func:`collect_issues` with ``import_factories``) and
    ``Pipeline.start`` before any process starts. Stages whose factory is a dotted path or does
    not resolve have no check (the latter is reported by the name rules)."""
    # The same problem in several stages (a model path they all share) is reported once, at the
    # first, naming the others: (argument, message, hint) -> [first issue, other stages ...].
    found: dict[tuple[str, str, str | None], list[Any]] = {}
    for i, stage in enumerate(cfg.stages):
        if is_dotted_path(stage.factory) or registry.problem("stage", stage.factory):
            continue
        try:
            check = registry.get("stage", stage.factory).load_check()
        except PluginError as exc:
            found[(_sp(i, "factory"), str(exc), None)] = [ConfigIssue(_sp(i, "factory"), str(exc))]
            continue
        for issue in _run_arg_check(check, cfg, stage, _sp(i, "args")) if check is not None else ():
            key = (issue.path.removeprefix(_sp(i)), issue.message, issue.hint)
            if key in found:
                found[key].append(_sp(i))
            else:
                found[key] = [issue]
    return [attrs.evolve(first, message=f"{first.message} (also {', '.join(others)})") if others else first
            for first, *others in found.values()]


def _run_arg_check(check: Callable[..., Any], cfg: PipelineConfig, stage: StageConfig, path: str) -> list[ConfigIssue]:
    declared: Mapping[str, inspect.Parameter]
    try:
        declared = inspect.signature(check).parameters
    except (TypeError, ValueError):
        declared = {}
    extra = {"env": stage_environment(cfg, stage), "stage_name": stage.name}
    try:
        found = list(check(dict(stage.args), **{k: v for k, v in extra.items() if k in declared}) or ())
    except Exception as exc:
        return [ConfigIssue(path, f"the argument check of factory {stage.factory!r} raised {type(exc).__name__}: {exc}",
                            "a bug in the plugin that registered the factory: report it there")]
    issues = []
    for item in found:
        if isinstance(item, ConfigIssue):
            issues.append(ConfigIssue(f"{path}.{item.path}" if item.path else path, item.message, item.hint))
        else:
            issues.append(ConfigIssue(path, str(item)))
    return issues


@rule
def stage_arg_checks(cfg: PipelineConfig, ctx: _Context) -> None:
    """The factories' own argument checks, with the deep validation that imports factories."""
    if ctx.import_factories:
        ctx.issues.extend(stage_arg_check_issues(cfg, ctx.registry))


@rule
def auto_relay_options(cfg: PipelineConfig, ctx: _Context) -> None:
    """Under ``auto`` the relay is chosen per edge, so options are given per relay name."""
    sections = [("relay", cfg.relay)] + [(_sp(i, "relay"), s.relay) for i, s in enumerate(cfg.stages) if s.relay]
    for path, relay in sections:
        if relay.backend != "auto":
            continue
        for key, value in relay.options.items():
            if not isinstance(value, dict) or ctx.registry.problem("relay", key):
                known = ", ".join(ctx.registry.names("relay"))
                ctx.add(f"{path}.options.{key}", f"under backend 'auto', options are given per relay: {key!r} is not a relay name with a mapping of options",
                        f"write e.g. 'options: {{shm: {{slots: 8}}}}'; relays: {known}")


@rule
def plugin_options(cfg: PipelineConfig, ctx: _Context) -> None:
    """Relay, placement and launcher options against the schemas their plugins declared."""
    from .options import options_issues

    ctx.issues.extend(options_issues(cfg, ctx.registry))


@rule
def registered_names(cfg: PipelineConfig, ctx: _Context) -> None:
    for i, stage in enumerate(cfg.stages):
        if not _resolvable(ctx, _sp(i, "factory"), "stage", stage.factory):
            _factory_args(ctx, i)
        _resolvable(ctx, _sp(i, "route_fn"), "route", stage.route_fn)
        _resolvable(ctx, _sp(i, "merge_fn"), "merge", stage.merge_fn)
        _resolvable(ctx, _sp(i, "wait_for_fn"), "wait_for", stage.wait_for_fn)
        _resolvable(ctx, _sp(i, "stream_done_to_fn"), "stream_done", stage.stream_done_to_fn)
        for target, fn in stage.project_payload.items():
            _resolvable(ctx, _sp(i, f"project_payload.{target}"), "project_payload", fn)
        for target, fn in stage.project_stream.items():
            _resolvable(ctx, _sp(i, f"project_stream.{target}"), "project_stream", fn)
        if stage.relay is not None and stage.relay.backend != "auto":
            _resolvable(ctx, _sp(i, "relay.backend"), "relay", stage.relay.backend)
    _resolvable(ctx, "terminal_stages_fn", "terminal_stages", cfg.terminal_stages_fn)
    if cfg.relay.backend != "auto":
        _resolvable(ctx, "relay.backend", "relay", cfg.relay.backend)
    _resolvable(ctx, "placement.strategy", "placement", cfg.placement.strategy)
    _resolvable(ctx, "launcher.name", "launcher", cfg.launcher.name)


@rule
def served_apis(cfg: PipelineConfig, ctx: _Context) -> None:
    """``serve.apis`` names APIs an installed plugin registered (what ``omni serve`` mounts)."""
    if ctx.serve:
        for k, name in enumerate(cfg.serve.apis):
            _resolvable(ctx, f"serve.apis[{k}]", "api", name)


@rule
def launch_options(cfg: PipelineConfig, ctx: _Context) -> None:
    """A stage's ``launch:`` mapping belongs to the launcher: its ``validate_launch(launch, path)``
    returns the issues (unknown keys at ``stages[i].launch.x``; the default ignores it)."""
    if not any(s.launch for s in cfg.stages) or ctx.registry.problem("launcher", cfg.launcher.name):
        return
    launcher = launcher_class(ctx.registry.get("launcher", cfg.launcher.name).load(), cfg.launcher.name)
    for i, stage in enumerate(cfg.stages):
        if stage.launch:
            ctx.issues.extend(launcher.validate_launch(stage.launch, _sp(i, "launch")))


def collect_issues(
    cfg: PipelineConfig, registry: Registry | None = None, *, import_factories: bool = False, serve: bool = False
) -> list[ConfigIssue]:
    """Every problem of ``cfg`` (empty when it is valid). With ``import_factories``, stage
    factories are imported and checked against their signatures (what ``omni validate`` does;
    the runtime never imports a factory in the parent). With ``serve``, what ``omni serve``
    reads is checked too (``serve.apis``)."""
    if registry is None:
        from ..plugins import get_registry

        registry = get_registry()
    ctx = _Context(cfg, registry, import_factories=import_factories, serve=serve)
    for check in RULES:
        check(cfg, ctx)
    return ctx.issues


def validate_config(
    cfg: PipelineConfig, *, source: str | None = None, registry: Registry | None = None, import_factories: bool = False,
    serve: bool = False,
) -> None:
    """Raise one ConfigError listing every problem of ``cfg``; return None when it is valid."""
    issues = collect_issues(cfg, registry, import_factories=import_factories, serve=serve)
    if issues:
        raise ConfigError(issues, source=source)

