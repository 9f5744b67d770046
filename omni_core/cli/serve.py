"""`omni serve`: serve one or several pipelines over HTTP until SIGTERM/SIGINT, then drain and stop."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from .common import LogLevel, app, err


@app.command()
def serve(
    configs: Annotated[list[str], typer.Argument(metavar="CONFIG", help="A YAML/TOML/JSON file, a registered pipeline name (e.g. demo) or a checkpoint folder; several: one server serves each (a request picks one by its name, the OpenAI APIs by 'model').")],
    host: Annotated[str, typer.Option("--host", help="The address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="The port to listen on (0: any free port, printed at start).")] = 8000,
    api: Annotated[list[str] | None, typer.Option("--api", metavar="NAME", help="Mount this API (repeatable), beside the config's serve.apis; see `omni plugins list`.")] = None,
    drain_timeout: Annotated[float, typer.Option("--drain-timeout", min=0, help="Seconds requests in flight may take to finish after SIGTERM/SIGINT.")] = 30.0,
    no_console: Annotated[bool, typer.Option("--no-console", help="Do not serve the console (the web page at GET / and its /console/* routes).")] = False,
    model: Annotated[str | None, typer.Option("--model", metavar="DIR", help="A checkpoint folder given to every stage of every pipeline as args.model (a model family's pipeline serves it), as omni run --model.")] = None,
    gpus: Annotated[int | None, typer.Option("--gpus", min=0, metavar="N", help="Place stages on N of this machine's GPUs, as omni run --gpus (needs CUDA; 0: every stage on the CPU; `omni plan CONFIG --gpus N` shows the plan without them).")] = None,
    api_key: Annotated[list[str] | None, typer.Option("--api-key", metavar="KEY", help="Require this key on every route (repeatable): 'Authorization: Bearer KEY'. Visible in ps: prefer --api-key-file or OMNI_API_KEY.")] = None,
    api_key_file: Annotated[list[str] | None, typer.Option("--api-key-file", metavar="PATH", help="Require the keys in this file (one per line; blank and # lines skipped; repeatable).")] = None,
    public_route: Annotated[list[str] | None, typer.Option("--public-route", metavar="PATH", help="With keys: a route served without one (repeatable; /health, /ready, /metrics, /openapi.json, or 'none'). Default: /health and /ready.")] = None,
    ssl_certfile: Annotated[str | None, typer.Option("--ssl-certfile", metavar="PATH", help="Serve HTTPS with this PEM certificate (chain); needs --ssl-keyfile.")] = None,
    ssl_keyfile: Annotated[str | None, typer.Option("--ssl-keyfile", metavar="PATH", help="The PEM private key of --ssl-certfile.")] = None,
    log_level: LogLevel = None,
) -> None:
    """Serve a pipeline over HTTP: JSON and SSE requests, APIs from plugins, /metrics, and the
    console (open the printed URL in a browser: the graph, live state, a playground).

    Several pipelines (omni serve A B ...): each keeps its own processes, metrics (their
    'pipeline' label) and console graph (/?pipeline=NAME); POST /v1/pipelines/NAME/requests
    reaches one, the OpenAI APIs pick one by the request's 'model', GET /v1/models lists them.
    --api mounts an API for every one of them.

    Ready (GET /ready 200) once every stage process (of every pipeline) is ready. SIGTERM or SIGINT drains: no new
    requests, those in flight finish within --drain-timeout, then everything stops; a second
    signal aborts what is left. If a pipeline stops on its own (a stage process died and the
    config's restart policy cannot bring it back), the server fails what is in flight and exits
    with status 3, for its supervisor to restart it.

    With API keys (--api-key, --api-key-file or the OMNI_API_KEY environment variable, commas
    between keys) every route but the public ones needs 'Authorization: Bearer KEY'; the console
    page asks the browser for it (any user name, the key as password). See docs/serving.md,
    Security.

    Examples:

      omni serve demo

      omni serve pipeline.yaml --port 9000 --api openai

      omni serve qwen2_5_omni --model ./Qwen2.5-Omni-7B

      omni serve demo asr.yaml tts.yaml --api openai --api realtime

      omni serve demo --host 0.0.0.0 --api-key-file keys.txt --ssl-certfile cert.pem --ssl-keyfile key.pem
    """
    from ..errors import ConfigError, OmniError
    from ..serve.auth import load_keys, public_routes
    from .importpath import add_config_import_paths
    from .run import _check_gpus, check_stage_args, prestart

    try:
        keys = load_keys(api_key or (), api_key_file or ())
        public = public_routes(public_route)
    except OmniError as exc:
        err.print(f"omni serve: {exc}", markup=False, highlight=False)
        raise typer.Exit(2) from None

    _check_gpus(gpus)
    if gpus == 0:  # every stage on the CPU: neither placement nor a stage process sees a GPU
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    for config in configs:
        add_config_import_paths(config)  # factories beside the config, or in the working directory
    try:
        for config in configs:
            check_stage_args(config if model is None else _on_gpus(config, None, model))
    except ConfigError as exc:
        err.print(str(exc), markup=False, highlight=False)
        raise typer.Exit(1) from None
    prestart(configs[0])  # the forkserver imports torch while this process does
    config = " ".join(configs)
    from ..serve.context import ServeSettings
    from ..serve.server import run

    settings = ServeSettings(config=config, host=host, port=port, apis=tuple(api or ()), drain_timeout=drain_timeout,
                             console=not no_console, api_keys=keys, public_routes=public,
                             ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile)

    def announce(url: str) -> None:
        err.print(f"omni serve: {config} on {url}", markup=False, highlight=False)

    try:
        targets = [_on_gpus(c, gpus, model) if gpus or model is not None else c for c in configs]
        status = run(targets[0] if len(targets) == 1 else targets, settings, announce=announce)
    except ConfigError as exc:
        err.print(str(exc), markup=False, highlight=False)
        raise typer.Exit(1) from None
    except OmniError as exc:
        from .report import describe_error

        # A failed start: the stage by its config path, the stage code's frames only.
        err.print(describe_error(exc), markup=False, highlight=False)
        raise typer.Exit(1) from None
    raise typer.Exit(status)


def _on_gpus(config: str, gpus: int | None, model: str | None = None):
    """The config with ``placement.gpus`` set to ``gpus``: what ``omni run --gpus`` gives the
    pipeline (placement over that many GPUs instead of every GPU torch sees); with ``model``, the
    checkpoint folder in every stage's ``args.model`` (``omni run --model``)."""
    import attrs

    from ..config import load_config

    cfg = load_config(config, model=model)
    return attrs.evolve(cfg, placement=attrs.evolve(cfg.placement, gpus=gpus)) if gpus else cfg
