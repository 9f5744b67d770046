"""Ending processes (the runner's): waiting for a process to exit on its sentinel, killing a
group, and the join → SIGTERM → SIGKILL stair of a stop, each step bounded in time.

A process's sentinel (:attr:`~omni_core.contracts.ProcessHandle.sentinel`) becomes readable once
it exited: a join waits on it in the event loop, never by polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable

from ..contracts import ProcessHandle

__all__ = ["join", "kill", "stair"]


async def join(handle: ProcessHandle, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for ``handle``'s process to exit (on its sentinel), then
    reap it. The sentinel's reader, if it had one in this loop, is removed."""
    loop = asyncio.get_running_loop()
    if handle.exitcode is None and timeout > 0:
        gone: asyncio.Future[None] = loop.create_future()

        def exited() -> None:
            if not gone.done():
                gone.set_result(None)

        loop.add_reader(handle.sentinel, exited)
        try:
            await asyncio.wait_for(gone, timeout)
        except asyncio.TimeoutError:
            return
        finally:
            with contextlib.suppress(Exception):
                loop.remove_reader(handle.sentinel)
    handle.join(0 if handle.exitcode is not None else 0.1)


async def kill(handles: Iterable[ProcessHandle], timeout: float = 5.0) -> None:
    """Kill the live processes of ``handles`` and wait (up to ``timeout`` each) until they are gone."""
    loop = asyncio.get_running_loop()
    handles = list(handles)
    for handle in handles:
        with contextlib.suppress(Exception):
            loop.remove_reader(handle.sentinel)
        if handle.exitcode is None:
            handle.kill()
    for handle in handles:
        await join(handle, timeout)


async def stair(handles: Iterable[ProcessHandle], start: float, span: float) -> None:
    """End every process of ``handles`` by ``start + span`` (monotonic): join until 70 % of
    ``span``, SIGTERM and join until 90 %, then SIGKILL and join (at least half a second)."""
    loop = asyncio.get_running_loop()
    handles = list(handles)
    for handle in handles:
        await join(handle, start + span * 0.7 - time.monotonic())
    for handle in handles:
        if handle.exitcode is None:
            handle.terminate()
    for handle in handles:
        await join(handle, start + span * 0.9 - time.monotonic())
    for handle in handles:
        if handle.exitcode is None:
            handle.kill()
    for handle in handles:
        await join(handle, max(0.5, start + span - time.monotonic()))
        with contextlib.suppress(Exception):
            loop.remove_reader(handle.sentinel)
