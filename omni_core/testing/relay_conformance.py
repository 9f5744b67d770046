"""The relay conformance kit: the contracts of :mod:`omni_core.relay.base` as pytest tests.

A relay package runs them against its backend by subclassing::

    from omni_core.testing.relay_conformance import RelayConformance

    class TestMyRelay(RelayConformance):
        relay_name = "my_relay"          # resolved through installed plugins (or relay_class = ...)
        relay_options = {"timeout": 1}   # RelayContext.options of every instance
        credits = 4                      # small puts one target can hold before put waits;
                                         # None for a relay whose put never waits
        put_timeout = 1.0                # seconds put waits for credits with these options

The sender runs in the test process, the receiver in a spawned process
(:class:`~omni_core.testing.peer.RelayPeer`); handles and frames travel over a pipe, as they do in
control messages. Every test closes its relays and then checks that nothing in /dev/shm names the
run, that no file the test created is left in the run's runtime dir, that no file descriptor of
this process points into /dev/shm or the runtime dir, and that no thread was left running; cross-process tests run under pytest-timeout and check
that the processes they started are gone. Relays must therefore put the run id in the names of
the shared resources they create (docs/relays.md, "Writing a relay"), which is what lets ``sweep`` find them.

Cross-node mode (:class:`CrossNodeRelayConformance`): the same tests with the receiver and a
second peer on two other nodes than the test process, and every handle and frame carried by the
control plane's tcp transport (CurveZMQ, :class:`~omni_core.testing.peer.TcpWire`) instead of the
pipe. A node provider subclasses it and says how a peer starts on a node (``omni_ray.testing``
does it on a Ray cluster); a relay that does not declare the ``cluster`` scope is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Collection
from typing import Any, ClassVar, Protocol

import pytest
import torch

from ..relay.base import Relay, RelayContext
from . import peer as cmd
from .peer import RelayPeer, TcpWire, resolve_relay, tensor_record
from .waiting import until

SENDER, RECEIVER = "sender", "receiver"

DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


def sample(dtype: torch.dtype, shape: tuple[int, ...] = (3, 5), seed: int = 0) -> torch.Tensor:
    """A random tensor of ``dtype`` (values spread over the type's range, signs included)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    low = 0 if dtype == torch.uint8 else -100
    return torch.randint(low, 120, shape, generator=gen, dtype=dtype)


def shm_entries(run_id: str) -> list[str]:
    """What /dev/shm holds that names ``run_id``."""
    return sorted(name for name in os.listdir("/dev/shm") if run_id in name)


def remove_leaked(run_id: str, keep: Collection[str] = ()) -> list[str]:
    """Unlink what /dev/shm holds for ``run_id`` beyond ``keep``, so a failing relay does not
    pollute the machine; the names removed, for the assertion that follows."""
    leaked = [name for name in shm_entries(run_id) if name not in keep]
    for name in leaked:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join("/dev/shm", name))
    return leaked


def runtime_files(runtime_dir: str) -> set[str]:
    """Every file under the run's runtime dir (relative paths)."""
    found = set()
    for root, _, files in os.walk(runtime_dir):
        found |= {os.path.relpath(os.path.join(root, f), runtime_dir) for f in files}
    return found


def open_relay_fds(runtime_dir: str) -> list[str]:
    """This process's file descriptors that point into /dev/shm or ``runtime_dir``."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(("/dev/shm/", runtime_dir.rstrip("/") + "/")):
                found.append(f"fd {fd} -> {target}")
    return found


def assert_arrived(sent: list[torch.Tensor], records: list) -> None:
    assert len(records) == len(sent), f"{len(records)} tensors arrived, {len(sent)} were put"
    for i, (tensor, (dtype, shape, raw, contiguous)) in enumerate(zip(sent, records, strict=True)):
        want = tensor_record(tensor)
        assert (dtype, tuple(shape)) == want[:2], (
            f"tensor {i}: {dtype}{shape} arrived, {want[:2]} put"
        )
        assert raw == want[2], f"tensor {i} ({dtype}{shape}): values differ"
        assert contiguous, f"tensor {i} arrived non-contiguous"


def _wire(transfer) -> tuple[bytes, list[bytearray]]:
    """The transfer as it crosses a pipe: handle bytes and frames as writable buffers (received
    zmq frames belong to the receiver too)."""
    return bytes(transfer.handle), [bytearray(memoryview(f)) for f in transfer.frames]


class PipeTransport:
    """How handles and frames reach a spawned peer: as arguments of its commands, over the pipe."""

    def attach(self, peer: Any) -> None:
        pass

    async def deliver(self, peer: Any, transfer: Any, release: bool = True) -> list:
        """The records of ``transfer`` once the peer got it (and released it, unless not)."""
        return await peer.acall(cmd.get_records, *_wire(transfer), release)

    async def fetch(
        self, peer: Any, request_id: int, target: str, seed: int, shapes: list
    ) -> tuple[bytes, list]:
        """``(handle, frames)`` of :func:`~omni_core.testing.peer.put_seeded` in the peer."""
        return await peer.acall(cmd.put_seeded, request_id, target, seed, shapes)

    def close(self) -> None:
        pass


class TcpTransport(PipeTransport):
    """Handles and frames over the control plane's tcp transport: a CurveZMQ inbox in the test
    process and one in every peer (bound on the peer's ``ip``), under one key set."""

    def __init__(self, host: str):
        from ..runtime.channel import CurveKeys

        self.keys = CurveKeys.generate()
        self.wire = TcpWire(self.keys, host)
        self.addresses: dict[int, str] = {}
        self.nodes: dict[str, str] = {}  # peer process -> its node
        self._tokens = iter(range(1, 1 << 62))

    def attach(self, peer: Any) -> None:
        self.addresses[id(peer)] = peer.call(
            cmd.open_wire, self.keys, getattr(peer, "ip", "127.0.0.1")
        )

    def token(self) -> bytes:
        return next(self._tokens).to_bytes(8, "little")

    async def deliver(self, peer: Any, transfer: Any, release: bool = True) -> list:
        token = self.token()
        self.wire.send(self.addresses[id(peer)], token, transfer.handle, list(transfer.frames))
        return await peer.acall(cmd.get_from_wire, token, release)

    async def fetch(
        self, peer: Any, request_id: int, target: str, seed: int, shapes: list
    ) -> tuple[bytes, list]:
        token = self.token()
        await peer.acall(
            cmd.put_seeded_to_wire, request_id, target, seed, shapes, self.wire.address, token
        )
        return await asyncio.to_thread(self.wire.receive, token)

    def close(self) -> None:
        self.wire.close()


class KitPeer(Protocol):
    """A peer as the kit drives it: a :class:`~omni_core.testing.peer.RelayPeer`, or what a node
    provider's ``spawn_peer`` returns (see :class:`CrossNodeRelayConformance`), with the
    ``transport`` that ``start_peer`` gives it."""

    transport: PipeTransport

    @property
    def node(self) -> str: ...

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = 30) -> Any: ...

    async def acall(self, fn: Callable[..., Any], *args: Any, timeout: float = 30) -> Any: ...

    def alive(self) -> bool: ...

    def kill(self) -> None: ...

    def stop(self, timeout: float = 30) -> int | None: ...


@pytest.mark.timeout(120)
class RelayConformance:
    """Subclass as ``Test<Relay>`` and set the class attributes (see the module docstring)."""

    relay_name: ClassVar[str] = ""
    relay_class: ClassVar[type[Relay] | None] = None
    relay_options: ClassVar[dict[str, Any]] = {}
    credits: ClassVar[int | None] = None
    put_timeout: ClassVar[float] = 1.0
    #: Why a ``release`` without a ``get`` cannot give the sender's credit back (a relay whose
    #: receiver must first reach the sender); "" for a relay that keeps that part of the contract.
    #: The runtime then relies on the sender's ``cleanup`` when the request's end reaches it.
    unread_release_gap: ClassVar[str] = ""
    large_bytes: ClassVar[int] = 8 << 20

    # -- fixtures -------------------------------------------------------------------------------

    @classmethod
    def relay_ref(cls) -> type[Relay] | str:
        ref = cls.relay_class or cls.relay_name
        if not ref:
            raise TypeError(f"{cls.__name__}: set relay_name or relay_class")
        return ref

    @classmethod
    def context(cls, run_id: str, process: str, runtime_dir: str) -> RelayContext:
        return RelayContext(run_id, process, runtime_dir, dict(cls.relay_options))

    @pytest.fixture(scope="class")
    @classmethod
    def run_id(cls) -> str:
        return f"kit{os.getpid()}x{uuid.uuid4().hex[:8]}"

    @pytest.fixture(scope="class")
    @classmethod
    def runtime_dir(cls, tmp_path_factory) -> str:
        return str(tmp_path_factory.mktemp("relay-kit"))

    @classmethod
    def make_transport(cls) -> PipeTransport:
        """How handles and frames travel between the test process and its peers."""
        return PipeTransport()

    @classmethod
    def spawn_peer(cls, ctx: RelayContext) -> Any:
        """A peer running the relay with ``ctx`` (``ctx.process`` is ``receiver`` or ``doomed``)."""
        return RelayPeer.start(cls.relay_ref(), ctx)

    @classmethod
    def start_peer(
        cls, process: str, run_id: str, runtime_dir: str, transport: PipeTransport
    ) -> Any:
        peer = cls.spawn_peer(cls.context(run_id, process, runtime_dir))
        try:
            transport.attach(peer)
        except BaseException:
            peer.kill()
            raise
        peer.transport = transport
        return peer

    @classmethod
    def sweep_after_crash(cls, peer: Any, run_id: str) -> None:
        """What the runner does after ``peer`` crashed: sweep the run on its node."""
        resolve_relay(cls.relay_ref()).sweep(run_id)

    @pytest.fixture(scope="class")
    @classmethod
    def transport(cls):
        transport = cls.make_transport()
        yield transport
        transport.close()

    @pytest.fixture(scope="class")
    @classmethod
    def receiver(cls, run_id, runtime_dir, transport):
        peer = cls.start_peer(RECEIVER, run_id, runtime_dir, transport)
        yield peer
        assert peer.stop() == 0, "the receiver process did not exit cleanly"
        assert not peer.alive()
        assert remove_leaked(run_id) == [], "the receiver's relay left /dev/shm entries after close"

    @pytest.fixture
    def sender(self, run_id, runtime_dir, receiver):
        shm_before, threads_before = shm_entries(run_id), set(threading.enumerate())
        files_before, fds_before = runtime_files(runtime_dir), set(open_relay_fds(runtime_dir))
        relay = resolve_relay(self.relay_ref())(self.context(run_id, SENDER, runtime_dir))
        yield relay
        relay.close()
        assert remove_leaked(run_id, shm_before) == [], "close() left /dev/shm entries behind"
        extra = [t.name for t in set(threading.enumerate()) - threads_before if t.is_alive()]
        assert not extra, f"threads still running after close(): {extra}"
        fds = sorted(set(open_relay_fds(runtime_dir)) - fds_before)
        assert not fds, f"file descriptors still open after close(): {fds}"
        self.check_runtime_files(runtime_dir, files_before)

    def check_runtime_files(self, runtime_dir: str, before: set[str]) -> None:
        """No file created during the test may be left in the runtime dir once the sender
        closed. Override for a relay whose files outlive ``close`` by design."""
        left = sorted(runtime_files(runtime_dir) - before)
        assert not left, f"files left in the runtime dir after close(): {left}"

    def run(self, coro, timeout: float = 90) -> Any:
        return asyncio.run(asyncio.wait_for(coro, timeout))

    def needs_credits(self) -> int:
        if self.credits is None:
            pytest.skip(f"{self.relay_ref()} declares no credits (put never waits)")
        return self.credits

    async def send(
        self,
        sender: Relay,
        receiver: KitPeer,
        tensors,
        request_id: int = 1,
        release: bool = True,
        target: str = RECEIVER,
    ):
        """Put ``tensors``, get them in the receiver; the records that arrived and the handle."""
        transfer = await sender.put(request_id, tensors, target)
        records = await receiver.transport.deliver(receiver, transfer, release)
        return records, bytes(transfer.handle)

    async def fill_credits(self, sender: Relay, receiver: KitPeer, request_id: int, got: int):
        """Take every credit toward the receiver with small puts of ``request_id``; the first
        ``got`` of them are received and held there, the rest never delivered."""
        handles = []
        for i in range(self.needs_credits()):
            if i < got:
                _, handle = await self.send(
                    sender, receiver, [sample(torch.float32)], request_id, False
                )
            else:
                handle, _ = _wire(await sender.put(request_id, [sample(torch.float32)], RECEIVER))
            handles.append(handle)
        return handles

    async def until_a_put_waits(self, sender: Relay, put: asyncio.Future) -> None:
        """Until ``put`` waits for a credit: as ``sender.open_links()`` says (its entries'
        ``"waiting"``) when the relay reports it; otherwise, with nothing to observe, for a
        window of a third of the put's timeout (at most 0.3 s) in which it must not finish."""
        open_links = getattr(sender, "open_links", None)
        if not callable(open_links):
            await asyncio.wait([put], timeout=min(0.3, self.put_timeout / 3))
            return

        def waits() -> bool:
            links = open_links()["sending"].values()
            return put.done() or sum(link.get("waiting", 0) for link in links) > 0

        await until(waits, "the put waiting for a credit", deadline_s=self.put_timeout)

    async def assert_put_times_out(self, sender: Relay, target: str = RECEIVER) -> str:
        started = time.monotonic()
        with pytest.raises(TimeoutError) as info:
            await sender.put(999, [sample(torch.float32)], target)
        elapsed = time.monotonic() - started
        assert elapsed <= self.put_timeout + 3, f"put took {elapsed:.1f} s to give up"
        assert target in str(info.value), (
            f"the timeout error does not name the target: {info.value}"
        )
        return str(info.value)

    # -- values ---------------------------------------------------------------------------------

    @pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
    def test_every_dtype_round_trips_across_processes(self, sender, receiver, dtype):
        tensors = [sample(dtype), sample(dtype, (7,), seed=1), sample(dtype, (), seed=2)]
        records, _ = self.run(self.send(sender, receiver, tensors))
        assert_arrived(tensors, records)

    def test_empty_and_zero_dim_tensors_round_trip(self, sender, receiver):
        tensors = [
            torch.empty(0),
            torch.empty(3, 0, 2, dtype=torch.int64),
            torch.tensor(7.5),
            torch.tensor(True),
            torch.ones(1, dtype=torch.float16),
        ]
        records, _ = self.run(self.send(sender, receiver, tensors))
        assert_arrived(tensors, records)
        records, _ = self.run(self.send(sender, receiver, []))
        assert records == []

    def test_non_contiguous_tensors_arrive_contiguous_with_their_values(self, sender, receiver):
        base = sample(torch.float32, (6, 8))
        tensors = [
            base.t(),
            base[::2, 1::3],
            sample(torch.int16, (4,)).expand(3, 4),
            sample(torch.complex64, (4, 4))[:, 1],
            torch.arange(24).view(2, 3, 4).permute(2, 0, 1),
        ]
        assert not any(t.is_contiguous() for t in tensors)
        records, _ = self.run(self.send(sender, receiver, tensors))
        assert_arrived(tensors, records)

    def test_many_tensors_in_one_put_arrive_in_order(self, sender, receiver):
        tensors = [sample(DTYPES[i % len(DTYPES)], (i % 5, 3 + i % 7), seed=i) for i in range(64)]
        records, _ = self.run(self.send(sender, receiver, tensors))
        assert_arrived(tensors, records)

    def test_large_tensor_round_trips(self, sender, receiver):
        tensors = [sample(torch.float32, (self.large_bytes // 4,)), sample(torch.uint8, (1000,))]
        records, _ = self.run(self.send(sender, receiver, tensors))
        assert_arrived(tensors, records)

    def test_many_concurrent_transfers_all_arrive_intact(self, sender, receiver):
        async def one(i: int):
            tensors = [sample(DTYPES[i % len(DTYPES)], (50 + i,), seed=i), torch.full((3,), i)]
            records, _ = await self.send(sender, receiver, tensors, request_id=i)
            assert_arrived(tensors, records)

        async def all_of_them():
            await asyncio.gather(*(one(i) for i in range(40)))

        self.run(all_of_them())

    def test_transfers_flow_both_ways(self, sender, receiver):
        shapes = [[4, 5], [0], [1000]]

        async def back():
            handle, frames = await receiver.transport.fetch(receiver, 3, SENDER, 11, shapes)
            tensors = await sender.get(handle, frames)
            records = [tensor_record(t) for t in tensors]
            sender.release(handle)
            return records

        assert self.run(back()) == cmd.seeded_records(11, shapes)
        receiver.call(cmd.reset_relay)  # the receiver's own sending resources go with it

    # -- failures and idempotence ---------------------------------------------------------------

    def test_release_and_cleanup_are_idempotent(self, sender, receiver):
        async def go():
            for rid in range(3):
                records, handle = await self.send(
                    sender, receiver, [sample(torch.int32)], rid, False
                )
                await receiver.acall(cmd.release, handle)
                await receiver.acall(cmd.release, handle)
                await receiver.acall(cmd.cleanup, rid)
                sender.cleanup(rid)
                sender.cleanup(rid)
            sender.cleanup(12345)
            for _ in range(self.credits or 3):  # every credit came back exactly once
                records, _ = await self.send(sender, receiver, [sample(torch.int8)], 10, False)
                assert_arrived([sample(torch.int8)], records)
            await receiver.acall(cmd.cleanup, 10)

        self.run(go())

    def test_failed_put_raises_and_leaves_relay_usable(self, sender, receiver):
        async def go():
            with pytest.raises(Exception):  # noqa: B017 - any error is fine, as long as it raises
                await sender.put(1, [torch.ones(3), "not a tensor"], RECEIVER)
            for rid in range(self.credits or 3):  # the failed put kept no credit
                records, _ = await self.send(sender, receiver, [sample(torch.float64)], 2 + rid)
                assert_arrived([sample(torch.float64)], records)

        self.run(go())

    def test_close_twice_is_harmless(self, run_id, runtime_dir, sender, receiver):
        relay = resolve_relay(self.relay_ref())(self.context(run_id, "twice", runtime_dir))
        self.run(self.send(relay, receiver, [sample(torch.float32)]))
        relay.close()
        relay.close()

    def test_close_leaves_no_link_open(self, run_id, runtime_dir, sender, receiver):
        """A relay that reports what it holds open toward other processes (``open_links()``, as
        omni's relays do: ``{"sending": {...}, "receiving": {...}}``) reports nothing once it is
        closed."""
        relay = resolve_relay(self.relay_ref())(self.context(run_id, "linked", runtime_dir))
        if not callable(getattr(relay, "open_links", None)):
            relay.close()
            pytest.skip(f"{self.relay_ref()} has no open_links()")
        try:
            self.run(self.send(relay, receiver, [sample(torch.float32)]))
            links = relay.open_links()
            assert set(links) == {"sending", "receiving"}, links
        finally:
            relay.close()
        assert relay.open_links() == {"sending": {}, "receiving": {}}

    # -- credits and back-pressure ----------------------------------------------------------------

    def test_put_waits_for_credits_and_resumes_after_release(self, sender, receiver):
        async def go():
            handles = await self.fill_credits(sender, receiver, 1, got=self.needs_credits())
            waiting = asyncio.ensure_future(sender.put(2, [sample(torch.float32)], RECEIVER))
            await self.until_a_put_waits(sender, waiting)
            assert not waiting.done(), "put did not wait although every credit was held"
            await receiver.acall(cmd.release, handles[0])
            transfer = await asyncio.wait_for(waiting, self.put_timeout)
            records = await receiver.transport.deliver(receiver, transfer)
            assert_arrived([sample(torch.float32)], records)
            for handle in handles[1:]:
                await receiver.acall(cmd.release, handle)

        self.run(go())

    def test_put_times_out_with_clear_error_while_credits_are_held(self, sender, receiver):
        async def go():
            await self.fill_credits(sender, receiver, 1, got=self.needs_credits() // 2)
            await self.assert_put_times_out(sender)
            await receiver.acall(cmd.cleanup, 1)
            sender.cleanup(1)

        self.run(go())

    def test_cleanup_of_aborted_request_frees_its_credits(self, sender, receiver):
        async def go():
            old = await self.fill_credits(sender, receiver, 7, got=self.needs_credits() // 2)
            sender.cleanup(7)
            await self.fill_credits(sender, receiver, 8, got=0)  # every credit is back
            for handle in old:  # late releases of the aborted request free nothing new
                await receiver.acall(cmd.release, handle)
            await self.assert_put_times_out(sender)
            sender.cleanup(8)
            await self.send(sender, receiver, [sample(torch.float32)], 9)

        self.run(go())

    def test_data_for_an_ended_request_is_released_without_a_get(self, sender, receiver):
        """A receiver drops a message of a request that ended there unread: releasing its handle
        without a ``get`` gives the sender's credit back."""
        if self.unread_release_gap:
            pytest.skip(f"{self.relay_ref()}: {self.unread_release_gap}")

        async def go():
            handles = await self.fill_credits(sender, receiver, 3, got=0)
            for handle in handles:
                await receiver.acall(cmd.release, handle)
            await self.fill_credits(sender, receiver, 4, got=self.needs_credits())  # every credit is back
            await receiver.acall(cmd.cleanup, 4)

        self.run(go())

    def test_cleanup_below_a_floor_frees_the_credits_of_ended_requests(self, sender, receiver):
        """Every request below the floor ended (a restarted receiver never saw their end):
        ``cleanup_below(floor)`` frees their credits, and keeps those of requests at the floor."""
        if type(sender).cleanup_below is Relay.cleanup_below:
            pytest.skip(f"{self.relay_ref()} does not override cleanup_below (it frees nothing by floor)")

        async def go():
            n = self.needs_credits()
            kept = await self.send(sender, receiver, [sample(torch.float32)], 20, False)
            for i in range(n - 1):
                await sender.put(10 + i % 3, [sample(torch.float32)], RECEIVER)
            sender.cleanup_below(20)
            for _ in range(n - 1):  # n - 1 credits came back; request 20's is still held
                await sender.put(21, [sample(torch.float32)], RECEIVER)
            await self.assert_put_times_out(sender)
            await receiver.acall(cmd.release, kept[1])
            sender.cleanup(21)

        self.run(go())

    def test_receiver_cleanup_releases_what_it_holds(self, sender, receiver):
        async def go():
            await self.fill_credits(sender, receiver, 5, got=self.needs_credits())
            await receiver.acall(cmd.cleanup, 5)
            await self.fill_credits(sender, receiver, 6, got=self.needs_credits())
            await receiver.acall(cmd.cleanup, 6)

        self.run(go())

    def test_dead_receiver_never_hangs_the_sender(self, run_id, runtime_dir, transport, sender):
        doomed = self.start_peer("doomed", run_id, runtime_dir, transport)
        try:

            async def before_death():
                if self.credits is None:
                    await self.send(sender, doomed, [sample(torch.float32)], 1, False, "doomed")
                    return
                for rid in range(self.credits):
                    await self.send(sender, doomed, [sample(torch.float32)], rid, False, "doomed")

            self.run(before_death())
            doomed.kill()
            assert not doomed.alive()
            self.sweep_after_crash(doomed, run_id)  # what the runner does after a crash

            async def after_death():
                if self.credits is None:
                    await asyncio.wait_for(
                        sender.put(2, [sample(torch.float32)], "doomed"), self.put_timeout + 3
                    )
                    return
                await self.assert_put_times_out(sender, "doomed")
                for rid in range(self.credits):
                    sender.cleanup(rid)
                await asyncio.wait_for(
                    sender.put(2, [sample(torch.float32)], "doomed"), self.put_timeout
                )

            self.run(after_death())
        finally:
            doomed.stop()
        assert not doomed.alive()


class CrossNodeRelayConformance(RelayConformance):
    """:class:`RelayConformance` with the ends on different nodes: the sender in the test process,
    the receiver and the ``doomed`` peer each on another node, every handle and frame over the
    control plane's tcp transport (CurveZMQ). A node provider subclasses it (``omni_ray.testing``
    provides ``RayCrossNodeConformance``) and implements:

    - ``spawn_peer(ctx)``: a peer with :class:`~omni_core.testing.peer.RelayPeer`'s methods
      (``call``, ``acall``, ``alive``, ``kill``, ``stop``) plus ``node`` (its node's identity) and
      ``ip`` (the address its inbox binds), on the node of ``ctx.process`` (``receiver`` and
      ``doomed`` on two different nodes);
    - ``this_node()`` and ``this_ip()``: the same for the test process;
    - ``sweep_after_crash(peer, run_id)``: the relay's sweep on the dead peer's node.

    The leak checks of /dev/shm and the runtime dir look at this machine: on a simulated cluster
    (every node on one machine) they see every node. A relay whose registered capabilities lack
    the ``cluster`` scope is skipped: ``auto`` never puts it on an edge between nodes."""

    @classmethod
    def this_node(cls) -> str:
        raise NotImplementedError(f"{cls.__name__}: a node provider implements this_node()")

    @classmethod
    def this_ip(cls) -> str:
        return "127.0.0.1"

    @classmethod
    def spawn_peer(cls, ctx: RelayContext) -> Any:
        raise NotImplementedError(f"{cls.__name__}: a node provider implements spawn_peer(ctx)")

    @classmethod
    def make_transport(cls) -> PipeTransport:
        return TcpTransport(cls.this_ip())

    @classmethod
    def declared_scopes(cls) -> frozenset[str]:
        """The scopes the relay declared: at registration (by name), else its class attribute."""
        ref = cls.relay_ref()
        if isinstance(ref, str) and ":" not in ref:
            from ..plugins import get_registry

            caps = get_registry().get("relay", ref).capabilities
            if caps is not None:
                return frozenset(caps.scopes)
        return frozenset(resolve_relay(ref).capabilities.scopes)

    @classmethod
    def start_peer(
        cls, process: str, run_id: str, runtime_dir: str, transport: PipeTransport
    ) -> Any:
        if "cluster" not in cls.declared_scopes():
            pytest.skip(
                f"relay {cls.relay_ref()!r} does not declare the 'cluster' scope: it never crosses nodes"
            )
        if not isinstance(transport, TcpTransport):
            raise TypeError(f"{cls.__name__}: peers on other nodes need a TcpTransport from "
                            f"make_transport(), got a {type(transport).__name__}")
        peer = super().start_peer(process, run_id, runtime_dir, transport)
        taken = {cls.this_node(): "the test process"}
        taken.update({n: p for p, n in transport.nodes.items() if p != process})
        if peer.node in taken:
            peer.kill()
            raise AssertionError(
                f"peer {process!r} runs on the node of {taken[peer.node]} ({peer.node}): not across nodes"
            )
        transport.nodes[process] = peer.node
        return peer
