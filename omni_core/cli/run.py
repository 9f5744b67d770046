"""`omni run`: run requests through a pipeline and print or save the results."""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from . import app, err


def to_jsonable(value: Any) -> Any:
    """Results as JSON: tensors and arrays become nested lists, bytes become base64 text."""
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"base64": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    return value


def _parse_input(text: str) -> Any:
    if text.startswith("@"):
        text = Path(text[1:]).read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"--input is not valid JSON: {exc}") from None


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else 0.0


async def _run_one(config: str, inputs: Any, stream: bool, request_id: str | None, gpus: int | None) -> Any:
    from ..runtime.pipeline import Pipeline

    async with Pipeline(config, gpus=gpus) as pipeline:
        if not stream:
            return await pipeline.submit(inputs, request_id=request_id)
        result = None
        async for event in pipeline.stream(inputs, request_id=request_id):
            if event.is_result:
                result = event.data
            else:
                print(json.dumps({"stage": event.stage, "chunk": to_jsonable(event.data)}), flush=True)
        return result


async def _run_many(config: str, lines: list[str], output: Path | None, concurrency: int, gpus: int | None) -> tuple[int, int, list[float]]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..errors import OmniError
    from ..runtime.pipeline import Pipeline

    latencies: list[float] = []
    failures = 0
    sem = asyncio.Semaphore(concurrency)
    out = output.open("w") if output else sys.stdout
    try:
        async with Pipeline(config, gpus=gpus) as pipeline:
            with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=err_console(), transient=False) as progress:
                task = progress.add_task("requests", total=len(lines))

                async def one(index: int, line: str) -> None:
                    nonlocal failures
                    async with sem:
                        record: dict[str, Any] = {"index": index}
                        start = time.perf_counter()
                        try:
                            inputs = json.loads(line)
                            record["result"] = to_jsonable(await pipeline.submit(inputs))
                            latencies.append(time.perf_counter() - start)
                        except (OmniError, json.JSONDecodeError) as exc:
                            failures += 1
                            record["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
                        out.write(json.dumps(record) + "\n")
                        progress.advance(task)

                await asyncio.gather(*(one(i, line) for i, line in enumerate(lines)))
    finally:
        if output:
            out.close()
    return len(lines), failures, latencies


def err_console():
    return err


@app.command()
def run(
    config: Annotated[str, typer.Argument(help="A YAML/TOML file or a registered pipeline name (e.g. demo).")],
    input: Annotated[str | None, typer.Option("--input", "-i", help="One request's inputs as JSON (or @file.json).")] = None,
    inputs: Annotated[Path | None, typer.Option("--inputs", help="A JSON-lines file, one request per line.")] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="With --inputs: write results here (JSON lines) instead of stdout.")] = None,
    stream: Annotated[bool, typer.Option("--stream", help="Print chunks as terminal stages emit them (JSON lines), then the result.")] = False,
    concurrency: Annotated[int, typer.Option("--concurrency", "-c", min=1, help="With --inputs: requests in flight at once.")] = 16,
    request_id: Annotated[str | None, typer.Option("--request-id", help="The id of the request (--input only).")] = None,
    gpus: Annotated[int | None, typer.Option("--gpus", min=0, help="Simulate this many GPUs for placement.")] = None,
) -> None:
    """Run requests through a pipeline: one (--input) or many (--inputs FILE).

    Examples:

      omni run demo --input '{"text": "hello"}' --stream

      omni run pipeline.yaml --inputs requests.jsonl --output results.jsonl
    """
    from ..errors import ConfigError, OmniError

    if (input is None) == (inputs is None):
        err.print("error: give exactly one of --input JSON or --inputs FILE")
        raise typer.Exit(2)
    try:
        if input is not None:
            result = asyncio.run(_run_one(config, _parse_input(input), stream, request_id, gpus))
            print(json.dumps({"result": to_jsonable(result)} if stream else to_jsonable(result)))
            return
        lines = [line for line in inputs.read_text().splitlines() if line.strip()]
        count, failures, latencies = asyncio.run(_run_many(config, lines, output, concurrency, gpus))
        p50, p99 = _percentile(latencies, 0.5), _percentile(latencies, 0.99)
        err.print(f"{count} requests, {failures} failed, latency p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms")
        if failures:
            raise typer.Exit(1)
    except ConfigError as exc:
        err.print(str(exc), markup=False, highlight=False)
        raise typer.Exit(1) from None
    except OmniError as exc:
        err.print(f"error: {exc}", markup=False, highlight=False)
        raise typer.Exit(1) from None
