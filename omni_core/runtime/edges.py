"""The stage process's edges: relay instances, tensors in and out, and received memory's lifetime.

``Edges`` owns one instance per relay backend this process uses, puts a packed payload's tensors
through an edge's relay (a payload mixing devices the relay cannot all move is split: the rest
goes ``inline`` beside it, one message either way) and gets them back on the receiving side,
recording what must be released when the receiver is done (:class:`~.types.Inbound`).

Received tensors may view relay memory that the relay will reuse once released. Two rules keep
that safe: a stage's result (or a forwarded payload) that still views such memory is copied out
before the release (:meth:`Edges.copy_out`), and a stream chunk's tensors are copied out on
arrival when small (its relay credit comes back at once) or released when the reader has moved
past the chunk when large.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .. import metrics
from ..capabilities import relay_capabilities
from ..config.schema import PipelineConfig
from ..logs import get_logger
from ..registry import Registry
from ..relay.base import InvalidHandle, Relay, RelayContext
from ..relay.lifetime import detach, lent_storages, storage_key
from .types import INLINE_RELAY, SPLIT_RELAY, Inbound

#: A stream chunk whose tensors hold at most this many bytes is copied out of the relay on
#: arrival (its relay memory is free at once); a larger one is a view until the reader moves on.
CHUNK_COPY_BYTES = 1 << 20


class _Split(msgspec.Struct, array_like=True):
    relays: list[str]
    handles: list[bytes]
    counts: list[int]
    index: list[list[int]]


_encode_split = msgspec.msgpack.Encoder().encode
_decode_split = msgspec.msgpack.Decoder(_Split).decode


def relay_options(relay_cfg: Any, name: str) -> dict[str, Any]:
    """The options of relay ``name`` in a ``relay:`` config: its ``options`` when it names that
    backend; under ``auto``, the ``options`` entry named after the relay (``{shm: {slots: 8}}``)."""
    if relay_cfg.backend == name:
        return dict(relay_cfg.options)
    if relay_cfg.backend == "auto" and isinstance(relay_cfg.options.get(name), dict):
        return dict(relay_cfg.options[name])
    return {}


class Edges:
    """Relay instances of one process and the tensors that cross its edges."""

    def __init__(self, *, config: PipelineConfig, registry: Registry, run_id: str, process: str,
                 runtime_dir: str, stages: tuple[str, ...]):
        self.config = config
        self.registry = registry
        self.run_id = run_id
        self.process = process
        self.runtime_dir = runtime_dir
        self.stages = stages
        self.relays: dict[str, Relay] = {}
        self._devices: dict[str, frozenset[str]] = {}
        self.log = get_logger(pipeline=config.name, process=process)

    def relay(self, name: str) -> Relay:
        relay = self.relays.get(name)
        if relay is None:
            cls = self.registry.resolve("relay", name)
            options = relay_options(self.config.relay, name)
            for stage in self.stages:  # a stage's relay options apply to its own edges' relay
                own = self.config.stage(stage).relay
                if own is not None:
                    options.update(relay_options(own, name))
            relay = self.relays[name] = cls(RelayContext(self.run_id, self.process, self.runtime_dir, options))
        return relay

    # -- out ------------------------------------------------------------------------------------

    async def put(self, relay_name: str, rid: int, tensors: list, target: str) -> tuple[str, bytes, list]:
        """Put ``tensors`` through the edge's relay: ``(wire relay name, handle, frames)``.
        Tensors on a device that relay cannot move (CPU tensors on a GPU-only relay) go through
        ``inline`` beside them, in one message."""
        metrics.relay_bytes(relay_name, self.process, target,
                            tensors[0].nbytes if len(tensors) == 1 else sum(t.nbytes for t in tensors))
        relay = self.relays.get(relay_name) or self.relay(relay_name)
        devices = self._devices.get(relay_name)
        if devices is None:  # what it can move: its registration's word, else its class's
            caps = relay_capabilities(self.registry, relay_name, relay)
            devices = self._devices[relay_name] = caps.devices if caps is not None else frozenset({"cpu"})
        if all(t.device.type in devices for t in tensors):
            transfer = await relay.put(rid, tensors, target)
            sent = transfer.frames
            return relay_name, transfer.handle, sent if type(sent) is list else list(sent)
        fits = [i for i, t in enumerate(tensors) if t.device.type in devices]
        fitting = set(fits)
        rest = [i for i in range(len(tensors)) if i not in fitting]
        split = _Split([], [], [], [])
        frames: list = []
        for name, index in ((relay_name, fits), (INLINE_RELAY, rest)):
            if not index:
                continue
            transfer = await self.relay(name).put(rid, [tensors[i] for i in index], target)
            split.relays.append(name)
            split.handles.append(transfer.handle)
            split.counts.append(len(transfer.frames))
            split.index.append(index)
            frames += list(transfer.frames)
        return SPLIT_RELAY, _encode_split(split), frames

    # -- in -------------------------------------------------------------------------------------

    async def get(self, relay_name: str, handle: bytes, frames: list) -> tuple[list, Inbound]:
        """The tensors of a received message, and what to release when the receiver is done."""
        inbound = Inbound()
        try:
            if relay_name != SPLIT_RELAY:
                return await self._get_one(relay_name, handle, frames, inbound), inbound
            try:
                split = _decode_split(handle)
            except msgspec.DecodeError as exc:
                raise InvalidHandle(f"malformed split handle: {exc}") from None
            if len(set(split.relays)) != len(split.relays) or INLINE_RELAY not in split.relays:
                raise InvalidHandle(f"malformed split handle: relays {split.relays} (a split is one edge relay and {INLINE_RELAY!r})")
            total = sum(len(index) for index in split.index)
            if sum(split.counts) != len(frames) or sorted(i for index in split.index for i in index) != list(range(total)):
                raise InvalidHandle("malformed split handle: its frame counts or tensor indices do not add up")
            tensors: list = [None] * total
            start = 0
            for name, sub, count, index in zip(split.relays, split.handles, split.counts, split.index, strict=True):
                part = await self._get_one(name, sub, frames[start:start + count], inbound)
                start += count
                if len(part) != len(index):
                    raise InvalidHandle(f"relay {name!r} returned {len(part)} tensors for {len(index)}")
                for i, tensor in zip(index, part, strict=True):
                    tensors[i] = tensor
            return tensors, inbound
        except BaseException:
            inbound.release()
            raise

    async def _get_one(self, relay_name: str, handle: bytes, frames: list, inbound: Inbound) -> list:
        if relay_name == SPLIT_RELAY:
            raise InvalidHandle("a split handle cannot nest another split")
        relay = self.relays.get(relay_name) or self.relay(relay_name)
        tensors = await relay.get(handle, frames)
        if type(relay).release is not Relay.release:
            inbound.releases.append(lambda: relay.release(handle))
        inbound.storages |= lent_storages(relay, tensors)  # none for inline: views of its own frames
        return tensors

    def discard(self, relay_name: str, handle: bytes) -> None:
        """A message that carried ``handle`` was dropped before its tensors were fetched (its
        request ended here): release what it holds at the sender, as a ``get`` then ``release``
        would. A handle that does not decode is ignored (nothing of this run can be freed)."""
        try:
            if relay_name == SPLIT_RELAY:
                split = _decode_split(handle)
                pairs = list(zip(split.relays, split.handles, strict=False))
            else:
                pairs = [(relay_name, handle)]
            for name, sub in pairs:
                if name == SPLIT_RELAY:
                    continue
                relay = self.relays.get(name) or self.relay(name)
                if type(relay).release is not Relay.release:
                    relay.release(sub)
        except Exception as exc:  # a forged or foreign handle: nothing to free
            self.log.debug("dropped message's handle not released", relay=relay_name, error=str(exc))

    @staticmethod
    def detach_chunk(tensors: list, inbound: Inbound) -> Inbound | None:
        """A small chunk's tensors are copied out of relay memory, which is released at once
        (None returned); a large chunk keeps its views and its ``inbound`` (returned)."""
        if not inbound:
            return None
        if not inbound.storages:  # nothing views relay memory: nothing to copy
            inbound.release()
            return None
        if sum(t.numel() * t.element_size() for t in tensors) > CHUNK_COPY_BYTES:
            return inbound
        for i, tensor in enumerate(tensors):
            if tensor.numel() and storage_key(tensor) in inbound.storages:
                tensors[i] = tensor.clone()
        inbound.release()
        return None

    @staticmethod
    def copy_out(result: Any, storages: set) -> Any:
        """``result`` with every tensor (or numpy array) that views relay memory about to be
        released copied, on its own device (:func:`omni_core.relay.lifetime.detach`)."""
        return detach(result, storages)

    # -- end ------------------------------------------------------------------------------------

    def cleanup(self, rid: int) -> None:
        for relay in self.relays.values():
            try:
                relay.cleanup(rid)
            except Exception:
                self.log.exception("relay cleanup failed", relay=relay.name)

    def cleanup_below(self, floor: int) -> None:
        """Every request below ``floor`` has ended: free what the relays still hold for them (a
        receiver that restarted never saw their end, so it never released their credits)."""
        for relay in self.relays.values():
            try:
                relay.cleanup_below(floor)
            except Exception:
                self.log.exception("relay cleanup failed", relay=relay.name)

    def close(self) -> None:
        for relay in self.relays.values():
            try:
                relay.close()
            except Exception:
                self.log.exception("relay close failed", relay=relay.name)

    def state(self) -> dict[str, int]:
        """Per-request entries the relays hold (for ``Pipeline.debug_state``)."""
        out: dict[str, int] = {}
        for name, relay in self.relays.items():
            report = getattr(relay, "debug_state", None)
            if callable(report):
                for key, value in report().items():
                    out[f"relay.{name}.{key}"] = int(value)
        return out
