"""Stages and functions the runtime tests wire into pipelines (imported by dotted path in the
stage processes)."""

from __future__ import annotations

import asyncio
import os
import time

import torch


def write_marker(path: str, text: str) -> None:
    """Write ``text`` to ``path`` at once (rename): a test polling for the file never reads it empty."""
    with open(f"{path}.tmp", "w") as f:
        f.write(text)
    os.replace(f"{path}.tmp", path)


class Upper:
    def __call__(self, payload, ctx):
        return {"text": payload["text"].upper()}


class AddSuffix:
    def __init__(self, suffix: str = "!", stage_name: str = ""):
        self.suffix = suffix
        self.stage_name = stage_name

    async def __call__(self, payload, ctx):
        return {**payload, "text": payload["text"] + self.suffix, "by": payload.get("by", []) + [self.stage_name]}


class Tokens:
    """Emits each character as a chunk, then returns the whole text. ``emits``: how many emits
    it started (the last one may be waiting for a credit)."""

    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self.emits = 0

    async def __call__(self, payload, ctx):
        for ch in payload["text"]:
            self.emits += 1
            await ctx.emit({"token": ch})
            if self.delay:
                await asyncio.sleep(self.delay)
        return {"text": payload["text"]}


class Collect:
    """Reads the stream from ``source`` and returns what it got along with its payload."""

    def __init__(self, source: str):
        self.source = source

    async def __call__(self, payload, ctx):
        got = [c["token"] async for c in ctx.stream_from(self.source)]
        return {"streamed": "".join(got), "payload": await ctx.payload()}


class Scale:
    def __init__(self, factor: float = 2.0):
        self.factor = factor

    async def __call__(self, payload, ctx):
        return {"x": payload["x"] * self.factor}


class Sleep:
    """Returns its payload after ``sleep`` seconds (default 10: a slow call), or, with ``gate``,
    once the test created that file (a call held until the test lets it go)."""

    async def __call__(self, payload, ctx):
        if payload.get("gate"):
            await _gate(payload["gate"])
        else:
            await asyncio.sleep(payload.get("sleep", 10))
        return payload


class Fail:
    def __call__(self, payload, ctx):
        if payload.get("fail"):
            raise RuntimeError(f"boom on {payload.get('text')}")
        return payload


class Pid:
    def __call__(self, payload, ctx):
        return {**payload, "pid": os.getpid()}


class Busy:
    def __call__(self, payload, ctx):
        end = time.monotonic() + payload.get("busy", 0.05)
        while time.monotonic() < end:
            pass
        return payload


def pick_first(request_id, payload):
    return payload.get("route", "a")


def concat(payloads):
    return {"text": "+".join(p["text"] for _, p in sorted(payloads.items()))}


def tensor_total(payload):
    return {"x": payload["x"].sum()}


def make_tensor(payload):
    return torch.tensor(payload)


class Mutate:
    """Appends its name to payload['seen'] in place (to show fan-out isolation)."""

    def __init__(self, stage_name: str = ""):
        self.stage_name = stage_name

    def __call__(self, payload, ctx):
        payload["seen"].append(self.stage_name)
        return payload


class Env:
    def __call__(self, payload, ctx):
        return {key: os.environ.get(key) for key in payload["keys"]}


class Unencodable:
    def __call__(self, payload, ctx):
        if payload.get("bad"):
            return {"ok": 1, "bad": object()}
        return {"ok": 1}


class Echo:
    async def __call__(self, payload, ctx):
        return payload


class StreamThenReturn:
    """Emits n chunks to its stream_to targets, then returns its payload. ``emits``: how many
    emits it started (the last one may be waiting for a credit)."""

    def __init__(self):
        self.emits = 0

    async def __call__(self, payload, ctx):
        for i in range(payload.get("n", 3)):
            self.emits += 1
            await ctx.emit({"i": i})
        return payload


class Concurrency:
    """Reports how many calls of this stage ran at once at most."""

    def __init__(self):
        self.now = 0
        self.peak = 0

    async def __call__(self, payload, ctx):
        self.now += 1
        self.peak = max(self.peak, self.now)
        await asyncio.sleep(payload.get("sleep", 0.05))
        self.now -= 1
        return {"peak": self.peak}


class AbortAware:
    """A sync stage that records in a file that it started, loops until it sees ctx.aborted, then
    records that."""

    def __call__(self, payload, ctx):
        write_marker(payload["marker"], "started")
        end = time.monotonic() + 60
        while time.monotonic() < end:
            if ctx.aborted:
                write_marker(payload["marker"], "aborted")
                return payload
            time.sleep(0.01)
        return payload


class BadFactory:
    def __init__(self):
        raise ValueError("cannot load the model weights")


class Crash:
    def __call__(self, payload, ctx):
        if payload.get("crash"):
            os._exit(3)
        return payload


def route_by_field(request_id, payload):
    return payload["route"]


def route_raises(request_id, payload):
    raise RuntimeError("route exploded")


def chunk_index(chunk):
    """A stream projection: the chunk's index alone (its tensor stays with the next stage)."""
    if chunk["i"] == 13:
        raise RuntimeError("projection exploded at chunk 13")
    return {"i": chunk["i"]}


def route_unknown(request_id, payload):
    return "nowhere"


def merge_raises(payloads):
    raise RuntimeError("merge exploded")


def wait_for_named(request_id, from_stage, payload):
    return payload.get("wait")


def wait_for_raises(request_id, from_stage, payload):
    raise RuntimeError("wait_for exploded")


def project_len(payload):
    return {"len": len(payload["text"])}


def project_raises(payload):
    raise RuntimeError("projection exploded")


def stream_done_none(request_id, payload):
    return payload.get("done_to")


def stream_done_raises(request_id, payload):
    raise RuntimeError("stream_done exploded")


def terminals_from_inputs(inputs):
    return inputs.get("terminals")


def terminals_raises(inputs):
    raise RuntimeError("terminal_stages exploded")


def stream_done_by_request_id(request_id, payload):
    """End the stream for 'collect' only when the request id says so."""
    return "collect" if request_id.startswith("done") else None


class AllReduce:
    """A tensor-parallel stage: every rank contributes (rank + 1) * x and all-reduces."""

    def __init__(self, tp_rank: int = 0, tp_size: int = 1, tp_init_method: str | None = None):
        import torch.distributed as dist

        assert dist.is_initialized() and dist.get_world_size() == tp_size
        assert tp_init_method and tp_init_method.startswith("file://")
        self.rank = tp_rank
        self.size = tp_size

    async def __call__(self, payload, ctx):
        import torch.distributed as dist

        part = payload["x"] * (self.rank + 1)
        if payload.get("marker"):  # tells the test this rank reached the all_reduce
            with open(f"{payload['marker']}.{self.rank}", "w"):
                pass
        if self.rank == 0 and payload.get("leader_sleep"):  # a slow rank: it reaches the all_reduce late
            await asyncio.sleep(payload["leader_sleep"])
        dist.all_reduce(part)
        if payload.get("emit"):
            await ctx.emit({"rank_sum": float(part.sum())})
        return {"x": part, "ranks": self.size, "pid": os.getpid()}


class TPChunks:
    """A tensor-parallel stage streaming ``payload["n"]`` chunks: for each, every rank all-reduces
    ``[i, stop]`` (so the ranks stay in step) and emits ``{"i", "rank", "sum"}``; only rank 0's
    chunks may leave the stage. Returns its rank, its chunk count and the group's size.

    An abort reaches each rank at its own point (the leader waits on the caller's credits while a
    follower, whose chunks go nowhere, is already in the next collective): a cancelled rank joins
    one more all-reduce with ``stop`` set, and a rank that sees ``stop`` ends, so no rank is left
    waiting in a collective the others never join."""

    def __init__(self, tp_rank: int = 0, tp_size: int = 1, tp_init_method: str | None = None):
        import torch.distributed as dist

        assert dist.is_initialized() and dist.get_world_size() == tp_size
        self.rank = tp_rank
        self.size = tp_size

    @staticmethod
    def _reduce(i: int, stop: bool) -> torch.Tensor:
        import torch.distributed as dist

        values = torch.tensor([float(i), float(stop)])
        dist.all_reduce(values)
        return values

    async def __call__(self, payload, ctx):
        for i in range(payload["n"]):
            values = self._reduce(i, stop=False)
            if values[1] > 0:  # another rank was cancelled: the request ends on every rank
                raise asyncio.CancelledError
            try:
                await ctx.emit({"i": i, "rank": self.rank, "sum": values[:1].clone()})
            except asyncio.CancelledError:
                self._reduce(i, stop=True)
                raise
        return {"n": payload["n"], "rank": self.rank, "ranks": self.size, "r": payload.get("r")}


class Cwd:
    def __call__(self, payload, ctx):
        return {"cwd": os.getcwd()}


# -- Runtime 2 tests (ordering, streams, supervision, isolation) ---------------------------------

def _spin(seconds: float) -> None:
    """Keep this thread (and, from an async stage, its process's event loop) busy."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _wait_for_file(path: str, deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


async def _gate(path: str, deadline_s: float = 60.0) -> None:
    """Until the test creates ``path`` (a TimeoutError past ``deadline_s``: no call waits forever)."""
    end = time.monotonic() + deadline_s
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"{path} never appeared")
        await asyncio.sleep(0.01)


class TensorChunks:
    """Emits ``n`` chunks ``{"i": i, "t": a tensor full of i}`` (every ``plain``-th one without a
    tensor), raising after the first when ``fail`` is set; then returns its payload."""

    async def __call__(self, payload, ctx):
        n, size, plain = payload.get("n", 3), payload.get("size", 16), payload.get("plain", 0)
        for i in range(n):
            if plain and i % plain == plain - 1:
                await ctx.emit({"i": i})
            else:
                await ctx.emit({"i": i, "t": torch.full((size,), float(i))})
            if payload.get("fail"):
                raise RuntimeError("failed after its first chunk")
        return payload


class CollectTensors:
    """Reads the stream from ``source``, after keeping its event loop busy for ``block`` seconds
    (the chunks queue up unread meanwhile); stops after ``take`` chunks when given. Returns the
    chunk indices in arrival order and those whose tensor was wrong."""

    def __init__(self, source: str, block: float = 0.0, take: int | None = None):
        self.source, self.block, self.take = source, block, take

    async def __call__(self, payload, ctx):
        if self.block:
            _spin(self.block)
        got, bad = [], []
        async for chunk in ctx.stream_from(self.source):
            got.append(chunk["i"])
            t = chunk.get("t")
            if t is not None and not bool((t == chunk["i"]).all()):
                bad.append(chunk["i"])
            if self.take is not None and len(got) >= self.take:
                break
        return {"got": got, "bad": bad}


def merge_tp_input(payloads):
    """Fan-in of ``tok`` (the payload, with ``x``) and ``collect`` (what it streamed)."""
    return {"x": payloads["tok"]["x"], "got": payloads["collect"]["got"]}


class Raise:
    """Raises the ``BaseException`` named by ``raise`` (async stage); otherwise waits for the
    file ``gate`` when given, then returns its payload."""

    async def __call__(self, payload, ctx):
        name = payload.get("raise")
        if name:
            raise _BASE_EXCEPTIONS[name]("raised by the stage")
        if payload.get("gate"):
            await _gate(payload["gate"])
        return {"ok": payload.get("n"), "pid": os.getpid()}


class RaiseSync:
    """Like ``Raise``, as a sync stage (it runs in a worker thread)."""

    def __call__(self, payload, ctx):
        name = payload.get("raise")
        if name:
            raise _BASE_EXCEPTIONS[name]("raised by the stage")
        if payload.get("gate"):
            _wait_for_file(payload["gate"])
        return {"ok": payload.get("n"), "pid": os.getpid()}


_BASE_EXCEPTIONS = {"SystemExit": SystemExit, "KeyboardInterrupt": KeyboardInterrupt,
                    "CancelledError": asyncio.CancelledError, "GeneratorExit": GeneratorExit}


class Gate:
    """Starts at once the first time; every later start (a restart) waits in its factory until
    the file ``gate`` exists, so a test can hold the pipeline in ``restarting``."""

    def __init__(self, marker: str, gate: str):
        if os.path.exists(marker):
            _wait_for_file(gate)
        else:
            write_marker(marker, str(os.getpid()))

    def __call__(self, payload, ctx):
        return {**payload, "pid": os.getpid()}


FORGE_MAGIC = 0x0F0E_0D0C


class Forger:
    """Returns ``{"x": ...}``; a payload with ``forge`` set makes this process's relays send a
    forged handle for that result: its first tensor is a marker the patched ``put`` recognises
    (and strips). Kinds: ``path`` (a segment name outside /dev/shm), ``huge`` (a handle without
    a buffer declaring 512 MiB), ``bounds`` (a span beyond the segment), ``frames`` (inline: a
    frame too short for its tensor), ``other-run`` (a segment of another run)."""

    KINDS = ["path", "huge", "bounds", "frames", "other-run"]

    def __init__(self, victim: str = ""):
        import msgspec

        from omni_core.relay import inline, shm

        self.victim = victim
        original_shm, original_inline = shm.ShmRelay.put, inline.InlineRelay.put
        kinds, victim_path = self.KINDS, victim

        def marked(tensors):
            if tensors and tensors[0].dtype == torch.int64 and tensors[0].numel() == 2 \
                    and int(tensors[0][0]) == FORGE_MAGIC:
                return kinds[int(tensors[0][1])], list(tensors[1:])
            return None, tensors

        async def shm_put(relay, request_id, tensors, target):
            kind, tensors = marked(tensors)
            transfer = await original_shm(relay, request_id, [torch.zeros(1)] + list(tensors) if kind else tensors, target)
            if kind is None:
                return transfer
            h = shm.decode_handle(transfer.handle)
            if kind == "path":
                h = msgspec.structs.replace(h, segment=os.path.relpath(victim_path, "/dev/shm"))
            elif kind == "huge":
                h = msgspec.structs.replace(h, segment="", dtypes=["float32"], shapes=[[1 << 27]], offsets=[0])
            elif kind == "bounds":
                h = msgspec.structs.replace(h, shapes=[[1 << 27]] + h.shapes[1:])
            elif kind == "other-run":
                h = msgspec.structs.replace(h, segment=h.segment.replace("omni-", "omni-x", 1))
            return type(transfer)(shm.encode_handle(h), transfer.frames)

        async def inline_put(relay, request_id, tensors, target):
            kind, tensors = marked(tensors)
            transfer = await original_inline(relay, request_id, [torch.zeros(4)] + list(tensors) if kind else tensors, target)
            if kind is None:
                return transfer
            frames = list(transfer.frames)
            frames[0] = b""  # a 16-byte tensor declared, an empty frame sent
            return type(transfer)(transfer.handle, frames)

        shm.ShmRelay.put, inline.InlineRelay.put = shm_put, inline_put

    def __call__(self, payload, ctx):
        out = {"x": torch.full((8,), float(payload.get("n", 0))), "n": payload.get("n")}
        kind = payload.get("forge")
        if kind:
            out = {"marker": torch.tensor([FORGE_MAGIC, self.KINDS.index(kind)]), **out}
        return out


class EarlyReader:
    """For ``can_accept_stream_before_payload``: notes whether its call started before its
    payload (``payload is PENDING``), writes ``marker`` (``"started"``) when its call starts,
    reads the stream from ``source``, then waits for its payload (unless ``ask`` is false: it
    returns without it); ``raise_first`` raises before asking for it. Cancelled (an abort), it
    writes ``"cancelled"`` to ``marker``. ``asked``: how many calls read their stream to its end
    and asked for their payload."""

    def __init__(self, source: str, marker: str = "", raise_first: bool = False, ask: bool = True):
        self.source, self.marker, self.raise_first, self.ask = source, marker, raise_first, ask
        self.asked = 0

    async def __call__(self, payload, ctx):
        from omni_core import PENDING

        early = payload is PENDING
        if self.marker:
            write_marker(self.marker, "started")
        try:
            got = [c.get("i", c.get("token")) async for c in ctx.stream_from(self.source)]
            if self.raise_first:
                raise RuntimeError("the reader failed before its payload came")
            self.asked += self.ask
            payload = await ctx.payload() if self.ask else None
        except asyncio.CancelledError:
            if self.marker:
                write_marker(self.marker, "cancelled")
            raise
        return {"early": early, "got": got, "payload": payload}


class FailAtGate:
    """Waits for the file ``payload["gate"]``, then fails (a payload that never comes)."""

    async def __call__(self, payload, ctx):
        await _gate(payload["gate"])
        raise RuntimeError("the payload's stage failed")


class EarlyAllReduce:
    """A tensor-parallel ``EarlyReader``: every rank reads the stream from ``source``, waits for
    its payload, then all-reduces ``(rank + 1) * payload["x"]``."""

    def __init__(self, source: str, tp_rank: int = 0, tp_size: int = 1):
        self.source, self.rank, self.size = source, tp_rank, tp_size

    async def __call__(self, payload, ctx):
        import torch.distributed as dist

        from omni_core import PENDING

        early = payload is PENDING
        got = [c["i"] async for c in ctx.stream_from(self.source)]
        payload = await ctx.payload()
        part = payload["x"] * (self.rank + 1)
        dist.all_reduce(part)
        return {"early": early, "got": got, "x": part}


# -- in-process host tests (tests/test_host.py reach the instance as host.stages[name].obj) ------

class Waiter:
    """An async stage whose calls wait until the test sets ``gate``; records the request ids
    whose call started and those whose call was cancelled."""

    def __init__(self):
        self.gate = asyncio.Event()
        self.started: list[str] = []
        self.cancelled: list[str] = []

    async def __call__(self, payload, ctx):
        self.started.append(ctx.request_id)
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled.append(ctx.request_id)
            raise
        return payload


class Journal:
    """Sleeps ``payload["sleep"]`` seconds (default 0.02: work; blocking the loop, one call at a
    time, when ``payload["block"]``) or, with ``payload["gate"]``, waits until the test created
    that file; appends ``"<pid> <request id>"`` to ``path`` when a call starts, and returns the
    payload: which process ran which request."""

    def __init__(self, path: str):
        self.path = path

    async def __call__(self, payload, ctx):
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()} {ctx.request_id}\n")
        if payload.get("gate"):
            await _gate(payload["gate"])
        elif payload.get("block"):
            time.sleep(payload.get("sleep", 0.02))
        else:
            await asyncio.sleep(payload.get("sleep", 0.02))
        return payload
