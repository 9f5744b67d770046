"""Every hook an omni plugin can implement, grouped by what it contributes.

A plugin is a module (or any object) exposed through the ``omni`` entry-point group::

    [project.entry-points.omni]
    acme = "acme_omni.plugin"

and implements hooks with :data:`omni_core.hookimpl`. Each ``omni_register_*`` hook receives one
``register`` callback (:class:`omni_core.contracts.Register`) and calls it once per thing it
contributes; omni owns validation, naming and conflict detection. The callback's signature is::

    register(name, obj, *, description=None, kind=None, capabilities=None, options=None, check=None)

``kind`` is required for functions (``omni_register_functions``) and not accepted elsewhere.
``check`` (stage factories only) checks a stage's ``args`` without building the stage.
``capabilities`` (relays) and ``options`` (relays, placement strategies, launchers: an options
schema, see :mod:`omni_core.options`) are registration metadata: omni plans and validates configs
from them without importing ``obj``.
``obj`` is the object itself or a ``"package.module:attr"`` string, imported only when the name is
used (keeps ``omni plugins list`` and planning cheap). Names are global per kind: two plugins that
register the same name of the same kind are a conflict, reported naming both. Hooks are called again
in every process omni spawns, so they must be cheap, idempotent and free of side effects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .contracts import Register

hookspec = pluggy.HookspecMarker("omni")

# --------------------------------------------------------------------------------------------------
# Building blocks of a pipeline
# --------------------------------------------------------------------------------------------------


@hookspec
def omni_register_stages(register: Register) -> None:
    """Register stage factories: ``register("acme.upper", UpperStage, description="...")``.

    A factory is any callable returning a stage object (an object with an async or sync
    ``__call__(payload, ctx)``). It is called in the stage's own process with the stage's ``args``
    plus any of ``stage_name``, ``device``, ``gpu_id``, ``tp_rank``, ``tp_size``, ``tp_init_method``
    its signature declares.

    ``check=fn`` (a function or a ``"package.module:function"`` path) checks a stage's ``args``
    without building the stage: ``fn(args, *, env, stage_name)`` (declare the keywords you need)
    returns an iterable of :class:`omni_core.errors.ConfigIssue` whose ``path`` is the argument's
    key (``"model"``; ``""``: ``args`` as a whole), with the bad value in the message and how to
    fix it in the hint; omni reports them at ``stages[i].args.model``. ``env`` is the environment
    the stage's process will get (``env_defaults``, the stage's ``env``, then this machine's). It
    runs in ``omni validate`` and when a pipeline starts, before any process, on the machine
    running omni: it must be cheap, load no model and import nothing heavy (keep it in a module
    apart from the stage). An exception in it is reported as a bug of the plugin.
    """


@hookspec
def omni_register_functions(register: Register) -> None:
    """Register wiring functions, each with its kind:
    ``register("acme.pick", pick, kind="route", description="...")``.

    Kinds and the signatures omni calls them with:

    - ``route``: ``fn(request_id, payload) -> str | list[str]`` (a subset of the stage's ``next``)
    - ``merge``: ``fn(payloads: dict[str, payload]) -> payload`` (fan-in, keyed by source stage)
    - ``wait_for``: ``fn(request_id, from_stage, payload) -> list[str] | None`` (None: not known yet)
    - ``stream_done``: ``fn(request_id, payload) -> str | list[str] | None``
    - ``project_payload``: ``fn(payload) -> payload`` (per-target projection before sending)
    - ``project_stream``: ``fn(chunk) -> chunk`` (per-target projection of each streamed chunk)
    - ``terminal_stages``: ``fn(inputs) -> list[str] | None`` (per-request terminal subset)
    """


# --------------------------------------------------------------------------------------------------
# Moving data and placing processes
# --------------------------------------------------------------------------------------------------


@hookspec
def omni_register_relays(register: Register) -> None:
    """Register relay backends:
    ``register("acme", "acme_omni.relay:AcmeRelay", capabilities=CAPS, options=SCHEMA)``.

    ``obj`` is a class implementing :class:`omni_core.relay.Relay`. ``capabilities`` (a
    :class:`omni_core.relay.RelayCapabilities` or a mapping of devices, scopes, priority and,
    optionally, ms_per_mib) say which edges it can serve, so the ``auto`` backend can pick it
    without importing it (``ms_per_mib``: its measured cost across nodes, shown by ``omni plan``);
    ``options`` is the schema of its ``relay.options``.
    """


@hookspec
def omni_register_placements(register: Register) -> None:
    """Register placement strategies: ``register("pack", pack, options=SCHEMA)``.

    A strategy is ``fn(request: omni_core.plan.PlacementRequest) -> dict[str, list[int | None]]``
    giving, for every stage, one GPU id (or None for CPU) per tensor-parallel rank, or per replica
    and rank (``replicas * tp_size`` entries, replica-major). It must be a pure function; omni
    checks its answer (visible ids, distinct GPUs for TP ranks, memory budgets).
    """


@hookspec
def omni_register_launchers(register: Register) -> None:
    """Register launchers: ``register("local", LocalLauncher, options=SCHEMA)``.

    A launcher is a subclass of :class:`omni_core.contracts.Launcher`: it starts the planned
    processes, each returning a :class:`omni_core.contracts.ProcessHandle`, and reports their
    liveness; ``prepare``, ``plan_nodes`` and ``validate_launch`` are its optional capabilities.
    """


# --------------------------------------------------------------------------------------------------
# Whole pipelines
# --------------------------------------------------------------------------------------------------


@hookspec
def omni_register_pipelines(register: Register) -> None:
    """Register named pipeline configs: ``register("demo", "acme_omni:demo.yaml")``.

    ``obj`` is a mapping, a path to a YAML/TOML file, a ``"package:resource"`` string naming a
    file shipped inside a package, or a zero-argument callable returning one of these. The name can
    then be used wherever a config path is accepted (``omni run demo``).
    """


@hookspec
def omni_register_families(register: Register) -> None:
    """Register model families: ``register("acme_lm", "acme_omni.family:FAMILY",
    model_types=["acme_lm"], pipeline="acme_lm", description="...")``.

    A model family serves checkpoints of some architectures: ``model_types`` are the
    ``config.json`` ``model_type`` values it serves, ``pipeline`` the registered pipeline that
    serves such a checkpoint (``omni run DIR`` / ``omni serve DIR`` / ``omni plan DIR`` on a
    checkpoint folder pick it by its ``model_type`` and give its stages the folder as ``model``).
    ``obj`` is the family's descriptor (omni-transformers' ``omni_transformers.kit.family.Family``
    for families on its kit), imported only when used; ``omni plugins list`` lists families and
    ``omni plugins check`` imports them. See docs/models.md ("Adding a model family").
    """


# --------------------------------------------------------------------------------------------------
# Serving
# --------------------------------------------------------------------------------------------------


@hookspec
def omni_register_apis(register: Register) -> None:
    """Register HTTP APIs that ``omni serve`` can mount:
    ``register("openai", "acme_omni.api:make_routes", description="...")``.

    ``obj`` is a factory (:class:`omni_core.contracts.ApiFactory`)
    ``fn(api: omni_core.serve.ApiContext) -> routes``, called once in the
    server process once the pipeline runs; ``api.pipeline`` is the running pipeline,
    ``api.settings`` the server's settings and ``api.options`` this API's mapping from the config's
    ``serve.options``. It returns Starlette routes (a list of routes, a ``Router``) or a FastAPI
    ``APIRouter``. Mounted with ``omni serve --api NAME`` or the config's ``serve: {apis: [NAME]}``;
    see docs/serving.md. ``options=`` is the schema of its ``serve.options.NAME``; ``chat=PATH``
    says it serves an OpenAI-style chat completions route at ``PATH`` (streamed as server-sent
    chunks), which the console's chat tab then talks to; ``chat="package.module:function"``, a
    function of the pipeline's ``serve.options.NAME`` returning that path or None, says so per
    pipeline (an API serving speech for some pipelines and chat for others). ``speech=`` and
    ``transcription=`` do the same for OpenAI-style ``/v1/audio/speech`` and
    ``/v1/audio/transcriptions`` routes (the console's Speech and Transcribe tabs).
    """
