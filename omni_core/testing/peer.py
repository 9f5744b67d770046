"""A relay in another process, driven from a test: the far end of cross-process relay tests.

``RelayPeer.start(...)`` spawns a process (multiprocessing ``spawn``) that builds the relay with
the given context and then runs commands sent over a pipe: ``peer.call(fn, *args)`` runs
``fn(state, *args)`` there (``fn`` a module-level function, awaited when it returns a coroutine)
and returns its result; ``peer.acall`` does the same without blocking the caller's event loop.
Tensors never cross the pipe (torch would share them through its own shared memory): commands
return :func:`tensor_record` tuples instead, which compare exactly, NaN and bit patterns included.
"""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing
import os
import signal
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from ..relay.base import Relay, RelayContext
from ..relay.inline import dtype_name


def tensor_record(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    """``(dtype, shape, raw bytes in row-major order)`` of a tensor."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return dtype_name(t.dtype), tuple(t.shape), raw


def resolve_relay(ref: type[Relay] | str) -> type[Relay]:
    """A relay class, or the class registered under that name by an installed plugin."""
    if isinstance(ref, str):
        from ..plugins import get_registry

        return get_registry().resolve("relay", ref)
    return ref


@attrs.define
class PeerState:
    """What commands running in the peer see: its relay, its loop, and what it holds."""

    relay: Relay
    loop: asyncio.AbstractEventLoop
    held: dict[bytes, list[torch.Tensor]] = attrs.Factory(dict)


# -- commands (run in the peer) -----------------------------------------------------------------

async def get_records(state: PeerState, handle: bytes, frames: Sequence[bytearray], release: bool = True):
    """Get a transfer; return its tensors as records plus whether each was contiguous. Without
    ``release`` the tensors stay held (credits stay taken) until :func:`release`."""
    tensors = await state.relay.get(handle, list(frames))
    records = [(*tensor_record(t), t.is_contiguous()) for t in tensors]
    if release:
        state.relay.release(handle)
    else:
        state.held[bytes(handle)] = tensors
    return records


def release(state: PeerState, handle: bytes) -> None:
    state.held.pop(bytes(handle), None)
    state.relay.release(handle)


def cleanup(state: PeerState, request_id: int) -> None:
    """The receiving side's abort path (held tensors stay referenced, as a slow stage's would)."""
    state.relay.cleanup(request_id)


def reset_relay(state: PeerState) -> None:
    """Close the peer's relay and build a fresh one with the same context (drops what it held)."""
    state.held.clear()
    state.relay.close()
    state.relay = type(state.relay)(state.relay.ctx)


async def put_seeded(state: PeerState, request_id: int, target: str, seed: int, shapes: list):
    """Put random float32 tensors of ``shapes`` (from ``seed``) to ``target``; the transfer as
    ``(handle, frames as bytes)``, for the test process to get."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(tuple(s), generator=gen) for s in shapes]
    transfer = await state.relay.put(request_id, tensors, target)
    return bytes(transfer.handle), [bytearray(memoryview(f)) for f in transfer.frames]


def seeded_records(seed: int, shapes: list) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [tensor_record(torch.randn(tuple(s), generator=gen)) for s in shapes]


# -- the peer process ---------------------------------------------------------------------------

def _peer_main(conn, relay_ref, ctx: RelayContext) -> None:
    torch.set_num_threads(1)
    loop = asyncio.new_event_loop()
    try:
        state = PeerState(resolve_relay(relay_ref)(ctx), loop)
    except BaseException:
        conn.send((False, traceback.format_exc()))
        return
    conn.send((True, os.getpid()))
    try:
        while (msg := conn.recv()) is not None:
            fn, args = msg
            try:
                result = fn(state, *args)
                if inspect.isawaitable(result):
                    result = loop.run_until_complete(result)
                conn.send((True, result))
            except BaseException:
                conn.send((False, traceback.format_exc()))
    finally:
        state.held.clear()
        state.relay.close()
        loop.close()
    conn.send((True, None))


class PeerError(RuntimeError):
    """A command failed in the peer; the message carries its traceback."""


class RelayPeer:
    """A relay running in a spawned process (see the module docstring)."""

    def __init__(self, process, conn):
        self.process = process
        self._conn = conn
        self._lock = threading.Lock()

    @classmethod
    def start(cls, relay: type[Relay] | str, ctx: RelayContext, *, timeout: float = 60) -> RelayPeer:
        parent, child = multiprocessing.get_context("spawn").Pipe()
        proc = multiprocessing.get_context("spawn").Process(
            target=_peer_main, args=(child, relay, ctx), name=f"relay-peer-{ctx.process}", daemon=True
        )
        proc.start()
        child.close()
        peer = cls(proc, parent)
        peer.pid = peer._reply(timeout)
        return peer

    def _reply(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            alive = self.process.is_alive()
            raise PeerError(f"relay peer pid {self.process.pid} did not answer in {timeout} s "
                            f"({'alive' if alive else f'exit code {self.process.exitcode}'})")
        try:
            ok, value = self._conn.recv()
        except EOFError:
            self.process.join(5)
            raise PeerError(f"relay peer died (exit code {self.process.exitcode})") from None
        if not ok:
            raise PeerError(f"relay peer command failed:\n{value}")
        return value

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = 30) -> Any:
        with self._lock:
            self._conn.send((fn, args))
            return self._reply(timeout)

    async def acall(self, fn: Callable[..., Any], *args: Any, timeout: float = 30) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, lambda: self.call(fn, *args, timeout=timeout))

    def kill(self) -> None:
        """SIGKILL the peer and reap it (a crash: its relay never closes)."""
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)
        self._conn.close()

    def stop(self, timeout: float = 30) -> int | None:
        """Close the peer's relay, let it exit, and return its exit code (killed if it hangs)."""
        if self.process.is_alive() and not self._conn.closed:
            with self._lock:
                try:
                    self._conn.send(None)
                    self._reply(timeout)
                except (PeerError, OSError):
                    pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        if not self._conn.closed:
            self._conn.close()
        return self.process.exitcode
