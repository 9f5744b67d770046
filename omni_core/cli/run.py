"""`omni run`: run requests through a pipeline and print or save the results."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer

from .common import LogLevel, app, debug_enabled, err


def to_jsonable(value: Any, *, tensor_data: bool = False) -> Any:
    """Results and chunks as JSON. A tensor or array is summarised as ``{"tensor": {"dtype",
    "shape"}}``; with ``tensor_data`` it is written whole in the one encoding ``omni serve`` speaks
    too (:mod:`omni_core.encoding`): ``{"dtype", "shape", "data": base64}``. Bytes are
    ``{"base64": ...}``."""
    from ..encoding import to_jsonable as encode

    return encode(value if tensor_data else summarise_tensors(value))


def summarise_tensors(value: Any) -> Any:
    """``value`` with every torch tensor and numpy array replaced by ``{"tensor": {"dtype": ...,
    "shape": [...]}}`` (dtype named as in omni's JSON encoding: ``float32``, ``int64`` ...)."""
    if type(value) in (str, int, float, bool) or value is None:
        return value
    if isinstance(value, Mapping):
        return {k: summarise_tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [summarise_tensors(v) for v in value]
    module = type(value).__module__
    if (module.startswith("torch") and hasattr(value, "detach")) or (module.startswith("numpy") and hasattr(value, "shape")
                                                                     and hasattr(value, "ndim") and value.ndim > 0):
        return {"tensor": {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape)}}
    return value


def _parse_input(text: str) -> Any:
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as exc:
            raise typer.BadParameter(f"cannot read {text[1:]!r}: {exc.strerror}", param_hint="'--input'") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"not valid JSON: {exc}", param_hint="'--input'") from None


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else 0.0


#: Back-off of a request the pipeline refused as overloaded: first wait, cap, attempts.
RETRY_FIRST_S, RETRY_MAX_S, RETRY_ATTEMPTS = 0.01, 1.0, 12


def _check_gpus(gpus: int | None) -> None:
    """``--gpus`` places stages on that many real GPUs; it cannot conjure them."""
    if not gpus:
        return
    from ..plan.placement import detect_devices

    seen = len(detect_devices())
    if seen < gpus:
        what = "this machine has no CUDA GPU" if seen == 0 else f"only {seen} CUDA GPU{'s' if seen != 1 else ''} visible"
        err.print(f"error: --gpus {gpus}: {what}; stages cannot run on GPUs that are not there "
                  f"(to see the plan for {gpus} GPUs without them, use `omni plan CONFIG --gpus {gpus}`)",
                  markup=False, highlight=False)
        raise typer.Exit(2)


class _StartupLine:
    """``starting pipeline 'demo': 5/5 processes started, 2 ready`` on a terminal, updated from
    the runtime's ``process started`` and ``process ready`` log events (seen whatever the log
    level); nothing when stderr is not a TTY."""

    def __init__(self, name: str, total: int | None):
        self.name, self.total, self.launched, self.ready = name, total, 0, 0
        self.active = err.is_terminal
        self.started = time.perf_counter()

    def __enter__(self) -> _StartupLine:
        if self.active:
            from ..logs import add_listener

            add_listener(self.on_event)
            self.show()
        return self

    def on_event(self, event: dict) -> None:
        if event.get("event") == "process started":
            self.launched += 1
            self.show()
        elif event.get("event") == "process ready":
            self.ready += 1
            self.show()

    def show(self, final: bool = False) -> None:
        of = f"/{self.total}" if self.total else ""
        if final:
            text = f"{self.total or self.launched}{of} processes ready ({time.perf_counter() - self.started:.1f} s)\n"
        else:
            text = f"{self.launched}{of} processes started, {self.ready} ready"
        err.file.write(f"\r\x1b[2Kstarting pipeline {self.name!r}: {text}")
        err.file.flush()

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if not self.active:
            return
        from ..logs import remove_listener

        remove_listener(self.on_event)
        if exc_type is None:
            self.show(final=True)
        else:
            err.file.write("\n")
            err.file.flush()


def prestart(config: str) -> None:
    """Start the local launcher's forkserver (which imports torch for every stage process) before
    this process imports torch too, so that the two overlap; a config that cannot be loaded is
    left for the start to report."""
    try:
        from ..config import load_config
        from ..runtime.launcher import prestart as start_forkserver

        cfg = load_config(config)
        start_forkserver(cfg.launcher.name, cfg.launcher.options)
    except Exception:
        pass


def check_stage_args(config: str) -> None:
    """The stage factories' argument checks, as ``Pipeline.start`` runs them, before this process
    starts a forkserver or imports torch: a missing model fails in a second, once. A config that
    cannot be loaded is left for the start to report."""
    from ..config import load_config
    from ..config.validate import stage_arg_check_issues
    from ..errors import ConfigError
    from ..plugins import get_registry

    try:
        cfg = load_config(config)
    except Exception:
        return
    issues = stage_arg_check_issues(cfg, get_registry())
    if issues:
        raise ConfigError(issues, source=config)


async def _started(config: str, gpus: int | None):
    """A started Pipeline, with a progress line while it starts; a failed start is described
    with the config paths of the failing process's stages (and, if the factory's signature
    explains it, the config error ``omni validate`` would report)."""
    from ..errors import StartupError

    check_stage_args(config)
    prestart(config)
    from ..runtime.pipeline import Pipeline  # imports torch
    from .report import describe_startup_failure

    pipeline = Pipeline(config, gpus=gpus)
    total = None
    try:
        from ..plan import build_plan
        from ..plugins import get_registry

        total = len(build_plan(pipeline.config, get_registry(), gpus=gpus).processes)
    except Exception:  # the start itself reports any problem of the plan
        pass
    try:
        with _StartupLine(pipeline.config.name, total):
            await pipeline.start()
    except StartupError as exc:
        if debug_enabled():
            raise  # the child's whole traceback, omni's frames included
        from ..config import collect_issues
        from ..errors import ConfigError

        issues = collect_issues(pipeline.config, import_factories=True)
        if issues:
            raise ConfigError(issues, source=config) from exc
        err.print(describe_startup_failure(exc, cfg=pipeline.config, plan=pipeline.plan), markup=False, highlight=False)
        raise typer.Exit(1) from None
    return pipeline


async def _run_one(config: str, inputs: Any, stream: bool, request_id: str | None, gpus: int | None,
                   tensor_data: bool = False) -> Any:
    pipeline = await _started(config, gpus)
    try:
        if not stream:
            return await pipeline.submit(inputs, request_id=request_id)
        result = None
        async for event in pipeline.stream(inputs, request_id=request_id):
            if event.is_result:
                result = event.data
            else:
                chunk = to_jsonable(event.data, tensor_data=tensor_data)
                print(json.dumps({"stage": event.stage, "chunk": chunk}), flush=True)
        return result
    finally:
        await pipeline.stop()


class Batch:
    """What a batch run has done so far (for the summary, also after a Ctrl-C)."""

    def __init__(self, total: int):
        self.total = total
        self.done = 0
        self.failures = 0
        self.latencies: list[float] = []
        self.interrupted = False

    def summary(self) -> str:
        ok = self.done - self.failures
        if self.latencies:
            p50, p99 = _percentile(self.latencies, 0.5), _percentile(self.latencies, 0.99)
            latency = f"latency p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms over {ok} succeeded"
        else:
            latency = "no latency: no request succeeded"
        if self.interrupted:
            return (f"interrupted: {self.done} of {self.total} requests finished, {self.failures} failed, "
                    f"{self.total - self.done} not finished; {latency}")
        return f"{self.total} requests, {self.failures} failed, {latency}"


async def submit_retrying(pipeline: Any, inputs: Any, request_id: str) -> Any:
    """Submit; an ``Overloaded`` refusal (another caller filled the pipeline) is retried with
    exponential back-off before it counts as the request's error."""
    from ..errors import Overloaded

    wait = RETRY_FIRST_S
    for attempt in range(RETRY_ATTEMPTS):
        try:
            return await pipeline.submit(inputs, request_id=request_id)
        except Overloaded:
            if attempt == RETRY_ATTEMPTS - 1:
                raise
            await asyncio.sleep(wait)
            wait = min(RETRY_MAX_S, wait * 2)
    raise AssertionError("unreachable")


async def _run_many(config: str, lines: list[tuple[int, str]], output: Path | None, concurrency: int | None,
                    gpus: int | None, tensor_data: bool = False) -> Batch:
    """Run every line (``(line number, text)``) with at most ``concurrency`` in flight (never more
    than ``limits.max_in_flight``); results are written as they finish, numbered by input line.

    A Ctrl-C (SIGINT: the stage processes, in sessions of their own, do not get it) starts no
    further request and lets those in flight finish, for at most ``limits.stop_timeout``
    seconds; a second Ctrl-C, or that deadline, aborts what is left. Returns what finished."""
    import signal

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..errors import OmniError

    batch = Batch(len(lines))
    pipeline = await _started(config, gpus)
    limit = pipeline.config.limits.max_in_flight
    if concurrency is not None and concurrency > limit:
        err.print(f"note: --concurrency {concurrency} is above limits.max_in_flight ({limit}); sending at most {limit} at once",
                  markup=False, highlight=False)
    sem = asyncio.Semaphore(min(concurrency or DEFAULT_CONCURRENCY, limit))
    out = output.open("w") if output else sys.stdout
    loop = asyncio.get_running_loop()
    interrupts = 0
    interrupted, aborted = asyncio.Event(), asyncio.Event()

    def on_sigint() -> None:
        nonlocal interrupts
        interrupts += 1
        (interrupted if interrupts == 1 else aborted).set()

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    in_flight: set[asyncio.Task] = set()
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err_console(), transient=False) as progress:
            task = progress.add_task("requests", total=len(lines))

            async def one(number: int, line: str) -> None:
                async with sem:
                    if interrupted.is_set():
                        return  # interrupted while it waited for its turn: never sent
                    me = asyncio.current_task()
                    assert me is not None, "one() runs as a task"
                    in_flight.add(me)
                    record: dict[str, Any] = {"line": number}
                    start = time.perf_counter()
                    try:
                        inputs = json.loads(line)
                        result = await submit_retrying(pipeline, inputs, f"line-{number}")
                        record["result"] = to_jsonable(result, tensor_data=tensor_data)
                        batch.latencies.append(time.perf_counter() - start)
                    except (OmniError, json.JSONDecodeError) as exc:
                        batch.failures += 1
                        record["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
                    finally:
                        in_flight.discard(me)
                    batch.done += 1
                    out.write(json.dumps(record) + "\n")
                    out.flush()
                    progress.advance(task)

            tasks = [asyncio.ensure_future(one(n, line)) for n, line in lines]
            everything = asyncio.gather(*tasks)
            waiter = asyncio.ensure_future(interrupted.wait())
            watched: list[asyncio.Future[Any]] = [everything, waiter]
            await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if interrupted.is_set() and not everything.done():
                batch.interrupted = True
                draining = [t for t in in_flight if not t.done()]
                for t in tasks:
                    if t not in in_flight:
                        t.cancel()  # not sent yet: it never will be
                if draining:
                    drain = pipeline.config.limits.stop_timeout
                    progress.console.print(
                        f"interrupted: finishing {len(draining)} request{'s' if len(draining) != 1 else ''} in flight "
                        f"(at most {drain:g} s, limits.stop_timeout); Ctrl-C again to abort them",
                        markup=False, highlight=False)
                    finished = asyncio.ensure_future(asyncio.wait(draining))
                    second = asyncio.ensure_future(aborted.wait())
                    await asyncio.wait([finished, second], timeout=drain, return_when=asyncio.FIRST_COMPLETED)
                    second.cancel()
                    finished.cancel()
                    for t in draining:
                        t.cancel()  # past the deadline or a second Ctrl-C: aborted
            await asyncio.gather(everything, return_exceptions=True)
            if not batch.interrupted:
                everything.result()  # an unexpected error in the CLI itself: not swallowed
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        await pipeline.stop(timeout=0 if aborted.is_set() else None)
        if output:
            out.close()
    return batch


#: ``--concurrency`` when not given: this, or ``limits.max_in_flight`` when that is smaller.
DEFAULT_CONCURRENCY = 16


def err_console():
    return err


@app.command()
def run(
    config: Annotated[str, typer.Argument(metavar="CONFIG", help="A YAML/TOML/JSON file, a registered pipeline name (e.g. demo) or a checkpoint folder (its model family's pipeline).")],
    input: Annotated[str | None, typer.Option("--input", "-i", metavar="JSON", help="One request's inputs as JSON (or @file.json).")] = None,
    inputs: Annotated[Path | None, typer.Option("--inputs", metavar="FILE", exists=True, dir_okay=False, readable=True,
                                                help="A JSON-lines file, one request per line.")] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", metavar="FILE", help="With --inputs: write results here (JSON lines) instead of stdout.")] = None,
    stream: Annotated[bool, typer.Option("--stream", help="Print chunks as terminal stages emit them (JSON lines), then the result.")] = False,
    concurrency: Annotated[int | None, typer.Option("--concurrency", "-c", min=1, metavar="N",
                                                    help="With --inputs: requests in flight at once (default: 16, or limits.max_in_flight when smaller; never more).")] = None,
    request_id: Annotated[str | None, typer.Option("--request-id", metavar="ID", help="The id of the request (--input only).")] = None,
    gpus: Annotated[int | None, typer.Option("--gpus", min=0, metavar="N",
                                             help="Place stages on N of this machine's GPUs (needs CUDA; to plan for GPUs you do not have, use `omni plan --gpus N`).")] = None,
    tensor_data: Annotated[bool, typer.Option("--tensor-data",
                                              help="Print tensors whole (dtype, shape and base64 data, as omni serve sends them) instead of only their dtype and shape.")] = False,
    model: Annotated[str | None, typer.Option("--model", metavar="DIR", help="A checkpoint folder given to every stage as args.model (a model family's pipeline runs on it).")] = None,
    log_level: LogLevel = None,
) -> None:
    """Run requests through a pipeline: one (--input) or many (--inputs FILE).

    Python code the config names (factory: my_stages:Upper) is imported from the config file's
    folder and the working directory, as well as from installed packages.

    Examples:

      omni run demo --input '{"text": "hello"}' --stream

      omni run pipeline.yaml --inputs requests.jsonl --output results.jsonl

      omni run ./Qwen2.5-Omni-7B --input '{"text": "hello"}'   (a checkpoint folder: its family's pipeline)
    """
    from ..errors import OmniError
    from .importpath import add_config_import_paths
    from .report import describe_error

    if (input is None) == (inputs is None):
        err.print("error: give exactly one of --input JSON or --inputs FILE")
        raise typer.Exit(2)
    _check_gpus(gpus)
    add_config_import_paths(config)
    try:
        if model is not None:  # the config loaded once, with the checkpoint in every stage's args
            from ..config import load_config

            config = load_config(config, model=model)  # type: ignore[assignment]
        if input is not None:
            parsed = _parse_input(input)
            result = to_jsonable(asyncio.run(_run_one(config, parsed, stream, request_id, gpus, tensor_data)),
                                 tensor_data=tensor_data)
            print(json.dumps({"result": result} if stream else result))
            return
        assert inputs is not None, "exactly one of input and inputs (checked above)"
        lines = [(n, line) for n, line in enumerate(inputs.read_text().splitlines(), start=1) if line.strip()]
        batch = asyncio.run(_run_many(config, lines, output, concurrency, gpus, tensor_data))
    except OmniError as exc:
        if debug_enabled():
            raise
        err.print(describe_error(exc), markup=False, highlight=False)
        raise typer.Exit(1) from None
    err.print(batch.summary(), markup=False, highlight=False)
    if batch.interrupted:
        raise typer.Exit(130)
    if batch.failures:
        raise typer.Exit(1)
