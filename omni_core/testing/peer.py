"""A relay in another process, driven from a test: the far end of cross-process relay tests.

``RelayPeer.start(...)`` spawns a process (multiprocessing ``spawn``) that builds the relay with
the given context and then runs commands sent over a pipe: ``peer.call(fn, *args)`` runs
``fn(state, *args)`` there (``fn`` a module-level function, awaited when it returns a coroutine)
and returns its result; ``peer.acall`` does the same without blocking the caller's event loop.
Tensors never cross the pipe (torch would share them through its own shared memory): commands
return :func:`tensor_record` tuples instead, which compare exactly, NaN and bit patterns included.

:class:`TcpWire` is the control plane's tcp transport (CurveZMQ, as between two nodes), for tests
whose handles and frames must cross it rather than the pipe: the relay conformance kit's
cross-node mode binds one in the test process and one in each peer (:func:`open_wire`), sends a
transfer with :meth:`TcpWire.send` and has the peer take it from its inbox
(:func:`get_from_wire`), so the relay's ``get`` sees received zmq frames, as in a stage process.
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
from ..relay.dtypes import dtype_name


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
    wire: TcpWire | None = None

    def bound_wire(self) -> TcpWire:
        """The wire :func:`open_wire` bound; a RuntimeError before that."""
        if self.wire is None:
            raise RuntimeError("the peer has no wire: open_wire() first")
        return self.wire

    def close(self) -> None:
        """Drop what is held, close the relay and the wire (what a peer does before it exits)."""
        self.held.clear()
        try:
            self.relay.close()
        finally:
            if self.wire is not None:
                self.wire.close()
                self.wire = None


# -- the control plane's tcp transport ------------------------------------------------------------


class TcpWire:
    """A CurveZMQ tcp inbox on ``host`` (bound by the control plane's ``bind_inbox``, a port chosen
    by binding) and PUSH sockets to other wires' addresses, all under one run's ``keys``. A message
    is ``[token, handle, *frames]``; :meth:`receive` returns the one of a token, keeping others
    that arrive first (concurrent transfers may overtake each other)."""

    def __init__(self, keys: Any, host: str):
        import zmq
        from zmq.utils.garbage import gc

        from ..runtime.channel import adopt_inbox, bind_inbox

        if not gc.is_alive():  # pyzmq's thread for zero-copy sends, once per process: start it now
            gc.start()
        self.keys = keys
        address = bind_inbox(None, keys=keys, host=host)
        inbox = adopt_inbox(address) if address is not None else None
        if address is None or inbox is None:  # bind_inbox binds a tcp inbox whenever it has keys
            raise ValueError(f"TcpWire: no tcp inbox bound on {host} (keys: {keys!r})")
        self.address: str = address
        self.inbox = inbox
        self.ctx = zmq.Context(io_threads=1)
        self.outboxes: dict[str, Any] = {}
        self.early: dict[bytes, list[Any]] = {}
        self._lock = threading.Lock()

    def send(
        self, address: str, token: bytes, handle: bytes, frames: Sequence[Any], timeout: float = 30
    ) -> None:
        import zmq

        from ..runtime.channel import connect, trust

        with self._lock:
            sock = self.outboxes.get(address)
            if sock is None:
                trust([address], self.keys)
                sock = self.ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
                connect(sock, address)
                self.outboxes[address] = sock
            sock.send_multipart([token, bytes(handle), *frames], copy=False)

    def receive(self, token: bytes, timeout: float = 30) -> tuple[bytes, list[Any]]:
        """``(handle, frames)`` of the message sent with ``token``; the frames as received
        (``zmq.Frame``). TimeoutError when it does not come."""
        import time

        import zmq

        deadline = time.monotonic() + timeout
        with self._lock:
            while token not in self.early:
                left = deadline - time.monotonic()
                if left <= 0 or not self.inbox.poll(int(left * 1000) + 1, zmq.POLLIN):
                    if token in self.early:
                        break
                    raise TimeoutError(
                        f"nothing arrived for {token!r} at {self.address} within {timeout:g} s"
                    )
                parts = self.inbox.recv_multipart(copy=False)
                self.early[bytes(parts[0].buffer)] = parts[1:]
            handle, *frames = self.early.pop(token)
        return bytes(handle.buffer), frames

    def close(self) -> None:
        from ..runtime.channel import forget_trust

        for sock in self.outboxes.values():
            sock.close(linger=0)
        self.outboxes.clear()
        self.early.clear()
        self.inbox.close(linger=0)
        self.ctx.term()
        forget_trust(self.keys)


# -- commands (run in the peer) -----------------------------------------------------------------


async def get_records(
    state: PeerState, handle: bytes, frames: Sequence[bytearray], release: bool = True
):
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


def open_wire(state: PeerState, keys: Any, host: str) -> str:
    """Bind the peer's :class:`TcpWire` on ``host``; its address."""
    wire = state.wire = TcpWire(keys, host)
    return wire.address


async def get_from_wire(state: PeerState, token: bytes, release: bool = True, timeout: float = 30):
    """:func:`get_records` of the transfer that arrived on the peer's wire with ``token``."""
    handle, frames = state.bound_wire().receive(token, timeout)  # sent before this command: no wait
    return await get_records(state, handle, frames, release)


async def put_seeded_to_wire(
    state: PeerState,
    request_id: int,
    target: str,
    seed: int,
    shapes: list,
    address: str,
    token: bytes,
) -> None:
    """:func:`put_seeded`, the transfer sent over the peer's wire to ``address`` with ``token``."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(tuple(s), generator=gen) for s in shapes]
    transfer = await state.relay.put(request_id, tensors, target)
    state.bound_wire().send(address, token, transfer.handle, list(transfer.frames))


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
        state.close()
        loop.close()
    conn.send((True, None))


class PeerError(RuntimeError):
    """A command failed in the peer; the message carries its traceback."""


class RelayPeer:
    """A relay running in a spawned process (see the module docstring)."""

    pid: int  # the peer process's, set by start() once the peer answered

    def __init__(self, process, conn):
        self.process = process
        self._conn = conn
        self._lock = threading.Lock()

    @classmethod
    def start(
        cls, relay: type[Relay] | str, ctx: RelayContext, *, timeout: float = 60
    ) -> RelayPeer:
        parent, child = multiprocessing.get_context("spawn").Pipe()
        proc = multiprocessing.get_context("spawn").Process(
            target=_peer_main,
            args=(child, relay, ctx),
            name=f"relay-peer-{ctx.process}",
            daemon=True,
        )
        proc.start()
        child.close()
        peer = cls(proc, parent)
        peer.pid = peer._reply(timeout)
        return peer

    def _reply(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            alive = self.process.is_alive()
            raise PeerError(
                f"relay peer pid {self.process.pid} did not answer in {timeout} s "
                f"({'alive' if alive else f'exit code {self.process.exitcode}'})"
            )
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
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.call(fn, *args, timeout=timeout)
        )

    @property
    def node(self) -> str:
        """Where the peer runs: this machine (a peer of another node says which)."""
        return "local"

    def alive(self) -> bool:
        return self.process.is_alive()

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
