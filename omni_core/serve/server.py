"""Running ``omni serve``: bind, start the pipeline(s), mount the APIs, serve, drain, stop.

With several pipelines (``omni serve A B``) each has its own :class:`ServeState` (one
``group`` dict shared by all): they start together, ``/ready`` waits for all, the drain and the
failure exit below cover all of them.

Order of events:

1. the socket is bound and uvicorn answers at once (``/health`` 200, ``/ready`` 503 "starting");
2. the pipeline starts (every stage process ready) and each API factory is called with it;
3. ``/ready`` turns 200;
4. on SIGTERM or SIGINT: ``/ready`` 503 and new requests 503 at once; requests in flight (streams
   included) may finish for ``drain_timeout`` seconds; what is left then, or at a second signal,
   is aborted; uvicorn closes the connections; the pipeline stops; the exit status is 0 unless
   something could not be cleaned up;
5. when the pipeline stops on its own (a stage process died under ``restart: never``, or past
   ``max_restarts``): ``/health`` and ``/ready`` answer 503 saying why, requests in flight are
   failed (the pipeline fails them; what is left after :data:`FAILED_GRACE` seconds is aborted),
   new requests get 503, and after at least :data:`FAILED_GRACE` seconds the server exits with
   :data:`PIPELINE_FAILED_EXIT` so that systemd, Kubernetes or any supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from typing import TYPE_CHECKING, Any

from ..errors import OmniError, PluginError
from ..logs import get_logger
from .app import CORE_PATHS, build_app
from .auth import is_loopback
from .context import ApiContext, ServeSettings, ServeState

if TYPE_CHECKING:
    import uvicorn

#: Seconds uvicorn waits for open connections once the drain is over (whole seconds: uvicorn's
#: setting is an int).
CLOSE_CONNECTIONS_TIMEOUT = 5

#: The exit status of a server whose pipeline stopped on its own and cannot go on.
PIPELINE_FAILED_EXIT = 3

#: Seconds the answers of failed requests get to reach their clients before the server exits.
FAILED_GRACE = 2.0

#: How often the server looks whether its pipeline stopped on its own.
WATCH_INTERVAL = 0.1


def resolve_apis(names: list[str]) -> list[tuple[str, Any]]:
    """Each API name's factory; an unknown name is a PluginError listing the known ones."""
    from ..plugins import get_registry

    registry = get_registry()
    return [(name, registry.get("api", name).load()) for name in names]


def api_routes(name: str, factory: Any, api: ApiContext) -> list[Any]:
    """Call an API factory and check what it returned."""
    try:
        made = factory(api)
    except OmniError:
        raise
    except Exception as exc:
        raise PluginError(f"API {name!r}: its factory raised {type(exc).__name__}: {exc}") from exc
    routes = getattr(made, "routes", made)
    if routes is None or isinstance(routes, (str, bytes)) or not hasattr(routes, "__iter__"):
        raise PluginError(f"API {name!r}: the factory must return a list of Starlette routes, a Router or an APIRouter, got {type(made).__name__}")
    routes = list(routes)
    taken = [getattr(r, "path", None) for r in routes if getattr(r, "path", None) in CORE_PATHS]
    if taken:
        raise PluginError(f"API {name!r} declares route(s) {taken} that omni serve's core routes own; choose other paths")
    return routes


def _uvicorn_server(config: uvicorn.Config) -> uvicorn.Server:
    """uvicorn's Server without its own signal handling (omni serve drains first)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield

        def install_signal_handlers(self) -> None:  # uvicorn < 0.29
            pass

    return Server(config)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OmniError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; pick another --port or --host") from None
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def pipeline_apis(settings: ServeSettings, config: Any) -> tuple[str, ...]:
    """The APIs one pipeline is served by: its ``serve.apis`` then ``--api`` names, each once."""
    return tuple(dict.fromkeys([*config.serve.apis, *settings.apis]))


async def serve(config: Any, settings: ServeSettings, *, announce=None) -> int:
    """Serve ``config`` (one config, or a list of them: several pipelines in one server) until a
    signal; returns the exit status. ``announce(url)`` is called once the socket listens (the CLI
    prints it)."""
    import uvicorn

    from ..errors import ConfigError
    from ..runtime.pipeline import Pipeline

    log = get_logger(component="serve")
    configs = list(config) if isinstance(config, (list, tuple)) else [config]
    if not configs:
        raise ConfigError("omni serve needs at least one pipeline")
    pipelines = [Pipeline(c) for c in configs]
    seen: dict[str, int] = {}
    for i, p in enumerate(pipelines):
        if p.config.name in seen:
            raise ConfigError(f"two pipelines named {p.config.name!r} (the {_ordinal(seen[p.config.name])} and the "
                              f"{_ordinal(i)} given): each pipeline of one server needs its own name (its config's "
                              "'name'), which requests pick it by")
        seen[p.config.name] = i
    per_pipeline = [pipeline_apis(settings, p.config) for p in pipelines]
    names = list(dict.fromkeys(n for apis in per_pipeline for n in apis))
    factories = resolve_apis(names)
    settings.apis = tuple(names)
    states = [ServeState(p, settings) for p in pipelines]
    group = {s.name: s for s in states}
    for s, apis in zip(states, per_pipeline, strict=True):
        s.group = group
        s.apis = apis
    state = states[0]
    app = build_app(state)
    tls = check_tls(settings)
    sock = bind(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    settings.port = port
    uv_config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                               timeout_graceful_shutdown=CLOSE_CONNECTIONS_TIMEOUT, timeout_keep_alive=5,
                               **tls)
    server = _uvicorn_server(uv_config)

    loop = asyncio.get_running_loop()
    signals: asyncio.Queue[signal.Signals] = asyncio.Queue()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    uv_task = loop.create_task(server.serve(sockets=[sock]))
    status = 0
    signal_while_starting = False
    try:
        while not server.started:
            if uv_task.done():
                uv_task.result()
                raise OmniError("the HTTP server stopped before it started")
            await asyncio.sleep(0.01)
        scheme = "https" if tls else "http"
        url = f"{scheme}://{'[' + host + ']' if ':' in host else host}:{port}"
        if announce is not None:
            announce(url)
        log.info("listening", url=url, pipelines=list(group), apis=names, api_keys=len(settings.api_keys),
                 public_routes=list(settings.public_routes) if settings.api_keys else "all")
        if not settings.api_keys and not is_loopback(settings.host):
            log.warning("serving without an API key on a non-loopback address: anyone who reaches it can use every "
                        "route, the console and its playground included; pass --api-key-file PATH (or --api-key, "
                        "OMNI_API_KEY)", host=settings.host)

        start = loop.create_task(_start_all(pipelines))
        first_signal = loop.create_task(signals.get())
        await asyncio.wait({start, first_signal}, return_when=asyncio.FIRST_COMPLETED)
        if not start.done():  # a signal while starting: give up starting, clean up
            log.warning("signal during startup: stopping", signal=signal.Signals(first_signal.result()).name)
            start.cancel()
            with contextlib.suppress(BaseException):
                await start
            signal_while_starting = True
    except BaseException:
        await _shutdown(server, uv_task, sock, pipelines, loop)
        raise
    if signal_while_starting:
        await _shutdown(server, uv_task, sock, pipelines, loop)
        return 0
    try:
        first_signal.cancel()
        start.result()  # StartupError → the CLI prints it
        for name, factory in factories:
            # One call per API: with the context of the first pipeline it serves; the others
            # are its ApiContext.peers() (an API picks one by the request's model).
            first = next(s for s in states if name in s.apis)
            routes = api_routes(name, factory, ApiContext(name, first.pipeline, settings,
                                                          dict(first.pipeline.config.serve.options.get(name, {})), first))
            app.starlette.router.routes.extend(routes)
        for s in states:
            s.started = True
        log.info("ready", url=url, pipelines=list(group))

        next_signal = loop.create_task(signals.get())
        watches = {loop.create_task(pipeline_failed(s)): s for s in states}
        await asyncio.wait({next_signal, *watches}, return_when=asyncio.FIRST_COMPLETED)
        if not next_signal.done():
            next_signal.cancel()
            broken = next(s for task, s in watches.items() if task.done())
            for task in watches:
                task.cancel()
            status = await _fail(broken, loop, log)
            return status
        for task in watches:
            task.cancel()
        sig = next_signal.result()
        for s in states:
            s.draining = True
        log.warning("draining", signal=signal.Signals(sig).name, in_flight=sum(len(s.active) for s in states),
                    drain_timeout=settings.drain_timeout)
        idle = loop.create_task(_all_idle(states))
        again = loop.create_task(signals.get())
        done, _ = await asyncio.wait({idle, again}, timeout=settings.drain_timeout, return_when=asyncio.FIRST_COMPLETED)
        idle.cancel()
        again.cancel()
        if not all(s.idle.is_set() for s in states):
            why = "second signal" if again in done else f"drain timeout ({settings.drain_timeout:g} s)"
            aborted = sum([await s.abort_all() for s in states])
            log.warning("aborted requests still in flight", reason=why, aborted=aborted)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(_all_idle(states), 5.0)
    finally:
        await _shutdown(server, uv_task, sock, pipelines, loop)
        left = [item for p in pipelines for item in leftovers(p)]
        if left:
            log.error("could not clean up", left=left)
            status = status or 1
        log.info("stopped", pipelines=list(group), status=status)
    return status


def _ordinal(i: int) -> str:
    return {0: "first", 1: "second", 2: "third"}.get(i, f"{i + 1}th")


async def _start_all(pipelines: list[Any]) -> None:
    """Start every pipeline at once; the first failure is raised once all have tried (a signal
    cancels them all)."""
    results = await asyncio.gather(*(p.start() for p in pipelines), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result


async def _all_idle(states: list[ServeState]) -> None:
    for s in states:
        await s.idle.wait()


async def pipeline_failed(state: ServeState) -> None:
    """Return once the pipeline stopped on its own (it cannot go on), recording why."""
    pipeline = state.pipeline
    while pipeline.state not in ("stopping", "stopped"):
        await asyncio.sleep(WATCH_INTERVAL)
    reason = getattr(getattr(pipeline, "lifecycle", None), "closed_reason", None)
    state.failed = (str(reason) if reason is not None else f"the pipeline {state.name!r} stopped") + (
        f"; omni serve exits with status {PIPELINE_FAILED_EXIT} so that its supervisor restarts it")


async def _fail(state: ServeState, loop: Any, log: Any) -> int:
    """A pipeline cannot go on: fail what is in flight (in every pipeline of the server), then
    exit non-zero."""
    states = list(state.group.values())
    log.error("pipeline stopped: exiting", pipeline=state.name, reason=state.failed,
              in_flight=sum(len(s.active) for s in states),
              restart_policy=state.pipeline.config.restart.policy, exit_status=PIPELINE_FAILED_EXIT)
    for s in states:  # the others refuse new work from now on, saying why
        if s is not state and s.failed is None:
            s.failed = f"pipeline {state.name!r} of this server stopped: {state.failed}"
    # FAILED_GRACE seconds in any case: the failed requests' answers go out, and probes and the
    # console's push channel see why before the server is gone.
    grace = loop.create_task(asyncio.sleep(FAILED_GRACE))
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(_all_idle(states), FAILED_GRACE)
    if not all(s.idle.is_set() for s in states):
        for s in states:
            await s.abort_all()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(_all_idle(states), FAILED_GRACE)
    await grace
    for s in states:
        s.draining = True
    return PIPELINE_FAILED_EXIT


def check_tls(settings: ServeSettings) -> dict[str, Any]:
    """uvicorn's TLS settings from ``--ssl-certfile/--ssl-keyfile``, checked before anything
    starts (an OmniError naming the file otherwise)."""
    cert, key = settings.ssl_certfile, settings.ssl_keyfile
    if not cert and not key:
        return {}
    if not cert or not key:
        given, missing = ("--ssl-certfile", "--ssl-keyfile") if cert else ("--ssl-keyfile", "--ssl-certfile")
        raise OmniError(f"{given} was given without {missing}: TLS needs both (the certificate chain and its private key)")
    import ssl

    for flag, path in (("--ssl-certfile", cert), ("--ssl-keyfile", key)):
        if not os.path.isfile(path):
            raise OmniError(f"{flag} {path}: no such file")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise OmniError(f"--ssl-certfile {cert} / --ssl-keyfile {key}: cannot load them ({exc}); give a PEM "
                        "certificate (chain) and its unencrypted PEM private key") from None
    return {"ssl_certfile": cert, "ssl_keyfile": key}


async def _shutdown(server: Any, uv_task: asyncio.Task, sock: socket.socket, pipelines: list[Any], loop: Any) -> None:
    """Close the HTTP side (open connections get CLOSE_CONNECTIONS_TIMEOUT), then stop the
    pipelines and restore the signal handlers."""
    server.should_exit = True
    with contextlib.suppress(BaseException):
        await asyncio.wait_for(asyncio.shield(uv_task), CLOSE_CONNECTIONS_TIMEOUT + 2)
    if not uv_task.done():
        server.force_exit = True
        with contextlib.suppress(BaseException):
            await uv_task
    with contextlib.suppress(OSError):
        sock.close()
    await asyncio.gather(*(p.stop() for p in pipelines), return_exceptions=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)


def leftovers(pipeline: Any) -> list[str]:
    """What a stopped pipeline left behind (empty when it cleaned up)."""
    left = [f"process {name} (pid {h.pid})" for name, h in getattr(pipeline, "handles", {}).items() if h.exitcode is None]
    if pipeline.runtime_dir and os.path.exists(pipeline.runtime_dir):
        left.append(f"runtime dir {pipeline.runtime_dir}")
    return left


def run(config: Any, settings: ServeSettings, *, announce=None) -> int:
    """Synchronous entry point (the CLI)."""
    return asyncio.run(serve(config, settings, announce=announce))

