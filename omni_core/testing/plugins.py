"""What a plugin's own tests use: check what an installed distribution registers, and run a
pipeline in real processes.

    from omni_core.testing import assert_plugin_registers, run_pipeline

    def test_registers():
        assert_plugin_registers("omni-acme", stage=["acme.upper"], pipeline=["acme.example"])

    def test_example_runs():
        (outcome,) = run_pipeline("acme.example", [{"text": "hi"}])
        assert outcome.result == {"text": "HI"}

Both load plugins the way omni does; ``run_pipeline`` starts every stage process, so the
distribution must be installed (``pip install -e .``): spawned processes see installed entry
points only.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from ..plugins import Plugins, load_plugins
from ..registry import KIND_LABELS, normalize_distribution


def assert_plugin_registers(distribution: str, *, env: Mapping[str, str] | None = None,
                            **names: Iterable[str]) -> Plugins:
    """Load the plugins of ``distribution`` alone (omni-core's built-ins beside them) and assert
    that they load without error and register exactly ``names`` per kind
    (``stage=[...]``, ``route=[...]``, ``relay=[...]``, ``pipeline=[...]`` ...; kinds not given
    are not checked). Returns the loaded plugins for further checks."""
    unknown = sorted(set(names) - set(KIND_LABELS))
    if unknown:
        raise TypeError(f"unknown kind(s) {', '.join(unknown)}; kinds: {', '.join(KIND_LABELS)}")
    dist = normalize_distribution(distribution)
    plugins = load_plugins(env={**(env or {}), "OMNI_LOAD_PLUGINS": distribution})
    mine = [i for i in plugins.infos if i.distribution and normalize_distribution(i.distribution) == dist]
    assert mine, (f"no plugin of distribution {distribution!r} is installed (is it pip-installed, "
                  f"with an [project.entry-points.omni] table?); loaded: {', '.join(i.id for i in plugins.infos)}")
    errors = [f"{i.id}: {i.error}" for i in mine if i.error]
    assert not errors, "plugin errors: " + "; ".join(errors)
    for kind, expected in names.items():
        got = sorted(n for i in mine for n in i.registered.get(kind, []))
        assert got == sorted(expected), (
            f"{distribution} registers {KIND_LABELS[kind]} names {got}, expected {sorted(expected)}")
    return plugins


@attrs.frozen
class Outcome:
    """What one request of :func:`run_pipeline` gave: its ``result`` (None when it failed), the
    ``chunks`` terminal stages streamed to the caller as ``(stage, data)``, and ``error``."""

    result: Any = None
    chunks: tuple[tuple[str | None, Any], ...] = ()
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


async def _run(config: Any, inputs: Sequence[Any], stream: bool, gpus: int | None) -> list[Outcome]:
    from ..runtime.pipeline import Pipeline

    async def one(pipeline: Pipeline, item: Any) -> Outcome:
        try:
            if not stream:
                return Outcome(result=await pipeline.submit(item))
            chunks, result = [], None
            async for event in pipeline.stream(item):
                if event.is_result:
                    result = event.data
                else:
                    chunks.append((event.stage, event.data))
            return Outcome(result=result, chunks=tuple(chunks))
        except Exception as exc:  # the outcome of this request; the others go on
            return Outcome(error=exc)

    async with Pipeline(config, gpus=gpus) as pipeline:
        return list(await asyncio.gather(*(one(pipeline, item) for item in inputs)))


def run_pipeline(config: Any, inputs: Sequence[Any], *, stream: bool = False, timeout: float = 120,
                 gpus: int | None = None) -> list[Outcome]:
    """Start ``config`` (a path, a registered pipeline name, a mapping) in real processes, send
    every item of ``inputs`` concurrently, stop the pipeline, and return one :class:`Outcome`
    per input, in order. ``stream`` collects the chunks too. The whole run is bounded by
    ``timeout`` seconds; a pipeline that fails to start raises its StartupError/ConfigError."""
    os.environ.setdefault("OMNI_LOG_LEVEL", "WARNING")
    return asyncio.run(asyncio.wait_for(_run(config, list(inputs), stream, gpus), timeout))
