"""Per-request ordered handling of control messages.

zmq keeps the messages of one sender in order on the wire; this keeps them in order while they
are *handled*. A message whose tensors must be fetched from a relay may need to wait (a relay
``get`` can be asynchronous); every later message of the same request then waits behind it,
whatever it is (a chunk without tensors, the end of a stream, a result). Requests do not wait for
each other. A request whose queue is empty and whose message needs no waiting is handled at once,
without a task.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from ..logs import get_logger

log = get_logger()



class OrderedDelivery:
    """Runs steps keyed by request, one key's steps strictly in order."""

    def __init__(self) -> None:
        self._queues: dict[int, deque[tuple[Callable[[], Any], bool]]] = {}
        self._workers: dict[int, asyncio.Task] = {}

    def __len__(self) -> int:
        return len(self._queues)

    def keys(self) -> list[int]:
        return list(self._queues)

    def busy(self, key: int) -> bool:
        return key in self._queues

    def run(self, key: int, step: Callable[[], None]) -> None:
        """Run the function ``step`` now if nothing of ``key`` waits, else after what waits."""
        queue = self._queues.get(key)
        if queue is not None:
            queue.append((step, False))
            return
        try:
            step()
        except Exception:
            log.exception("message handling failed")

    def wait(self, key: int, make: Callable[[], Awaitable[Any]]) -> None:
        """Run the coroutine ``make()`` in order; later steps of ``key`` wait for it."""
        queue = self._queues.get(key)
        if queue is not None:
            queue.append((make, True))
            return
        queue = self._queues[key] = deque([(make, True)])
        self._workers[key] = asyncio.get_running_loop().create_task(self._work(key, queue))

    async def _work(self, key: int, queue: deque) -> None:
        try:
            while queue:
                step, is_async = queue.popleft()
                try:
                    if is_async:
                        await step()
                    else:
                        step()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("message handling failed")
        finally:
            if self._queues.get(key) is queue:
                del self._queues[key]
                self._workers.pop(key, None)

    def drop(self, key: int) -> None:
        """Forget everything that waits for ``key`` (its request ended)."""
        self._queues.pop(key, None)
        worker = self._workers.pop(key, None)
        if worker is not None:
            worker.cancel()

    def close(self) -> None:
        for key in list(self._queues):
            self.drop(key)
