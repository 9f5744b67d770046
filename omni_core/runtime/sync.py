"""Use a pipeline from synchronous code (scripts, notebooks, WSGI apps).

``SyncPipeline`` runs a :class:`~omni_core.runtime.pipeline.Pipeline` on a private event loop in a
background thread and exposes blocking methods::

    with SyncPipeline("pipeline.yaml") as p:
        print(p.submit({"text": "hi"}))
        for event in p.stream({"text": "hi"}):
            print(event.stage, event.data)
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

from .pipeline import Pipeline
from .requests import Event


class SyncPipeline:
    """Blocking facade over :class:`Pipeline`; the methods are safe to call from any thread."""

    def __init__(self, config: Any, *, gpus: int | None = None):
        self.pipeline = Pipeline(config, gpus=gpus)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="omni-pipeline-loop", daemon=True)
        self._started = False

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self) -> SyncPipeline:
        """Start every stage process (blocks until all are ready)."""
        if not self._thread.is_alive():
            self._thread.start()
        self._call(self.pipeline.start())
        self._started = True
        return self

    def stop(self) -> None:
        """Stop the pipeline and the background loop; idempotent."""
        if self._thread.is_alive():
            try:
                self._call(self.pipeline.stop())
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(10)
        if not self._loop.is_closed() and not self._loop.is_running():
            self._loop.close()

    def __enter__(self) -> SyncPipeline:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def submit(self, inputs: Any, *, request_id: str | None = None, timeout: float | None = None,
               retry: Any = None) -> Any:
        """Run one request and return its result (see ``Pipeline.submit``; ``retry`` too)."""
        return self._call(self.pipeline.submit(inputs, request_id=request_id, retry=retry), timeout)

    def stream(self, inputs: Any, *, request_id: str | None = None, retry: Any = None) -> Iterator[Event]:
        """Yield the request's events as they arrive (see ``Pipeline.stream``; ``retry`` too)."""
        agen = self.pipeline.stream(inputs, request_id=request_id, retry=retry)
        try:
            while True:
                try:
                    yield self._call(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._call(agen.aclose())

    def abort(self, request_id: str) -> bool:
        return self._call(self.pipeline.abort(request_id))
