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
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from ..logs import get_logger

log = get_logger()


class Resume(Coroutine):
    """The rest of a coroutine that already ran up to its first suspension (it yielded
    ``first``): its first step hands the task what the coroutine waits on; every later one passes
    straight through. What lets a call start eagerly and get a task only if it suspends."""

    __slots__ = ("_coro", "_first", "_fresh")

    def __init__(self, coro: Coroutine, first: Any):
        self._coro = coro
        self._first = first
        self._fresh = True

    def send(self, value: Any) -> Any:
        if self._fresh:
            self._fresh = False
            return self._first
        return self._coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        if self._fresh:  # cancelled before its first step: what it waited on is abandoned
            self._fresh = False
            if isinstance(self._first, asyncio.Future):
                self._first.cancel()
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)  # pragma: no cover - asyncio throws instances

    def close(self) -> None:
        self._coro.close()

    def __await__(self):
        return self  # an iterator of the same steps (``await Resume(...)`` in a coroutine)

    def __iter__(self):
        return self

    def __next__(self) -> Any:
        return self.send(None)



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

    def start(self, key: int, make: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        """Like :meth:`wait`, but when nothing of ``key`` waits the coroutine runs at once, up
        to its first suspension: one that does not suspend (a relay ``get`` with nothing to
        wait for) needs no task, and only one that does holds the later steps of ``key``."""
        queue = self._queues.get(key)
        if queue is not None:
            queue.append((make, True))
            return
        coro = make()
        try:
            first = coro.send(None)
        except StopIteration:
            return
        except Exception:
            log.exception("message handling failed")
            return
        queue = self._queues[key] = deque([(lambda: Resume(coro, first), True)])
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
