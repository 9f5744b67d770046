"""The vocoder's batcher (kit/vocoder.py ChunkBatcher) with a fake vocoder's batch function, and the
kit's StreamingVocoder driven in-process by a fake family (no Qwen part).

What is checked: a request's first chunk is served before other requests' later chunks that
waited longer; a later chunk passed over by ``max_passed_over`` batches is served before newer
first chunks (no starvation); without priority, first come first served; a batch holds one key;
failures stay with their callers; a batch with a first chunk holds the process's first-chunk gate;
the fake vocoder streams chunks that make up its unchunked synthesis, concurrent requests equal
each alone."""

from __future__ import annotations

import asyncio

import attrs
import pytest
import torch
from omni_core.kits import BatcherClosed
from omni_core.testing.waiting import until

from omni_transformers.kit.chunks import CodesChunk
from omni_transformers.kit.vocoder import (
    ChunkBatcher,
    ChunkSchedule,
    FirstChunkGate,
    StreamingVocoder,
)

pytestmark = pytest.mark.timeout(120)


class GatedVocoder:
    """A fake vocoder's batch function: each batch is recorded, then waits until the test opens
    the gate (so the test decides what is waiting when the next batch is chosen)."""

    def __init__(self, gate: FirstChunkGate | None = None):
        self.batches: list[list[str]] = []
        self.release = asyncio.Semaphore(0)
        self.gate = gate
        self.held: list[bool] = []

    async def __call__(self, items: list[str]) -> list:
        self.batches.append(list(items))
        self.held.append(self.gate is not None and self.gate.held)
        await self.release.acquire()
        return [ValueError(f"{item} is bad") if item.startswith("bad") else f"audio of {item}" for item in items]


async def served_order(batcher: ChunkBatcher, fake: GatedVocoder, queued: list[tuple[str, bool, object]],
                       later: list[tuple[str, bool, object]] = ()) -> list[list[str]]:
    """Block the batcher on a first batch, queue ``queued`` (name, first, key) behind it, then let
    one batch run at a time, queueing one chunk of ``later`` after each: the batches in order."""
    tasks = [asyncio.ensure_future(batcher.submit("blocker", first=False, key="b"))]
    await until(lambda: len(fake.batches) == 1, "the first batch")
    for name, first, key in queued:
        tasks.append(asyncio.ensure_future(batcher.submit(name, first=first, key=key)))
    await until(lambda: batcher.waiting == len(queued), "the chunks queued")
    pending = list(later)
    while True:
        if pending:
            name, first, key = pending.pop(0)
            queued_before = batcher.waiting  # no batch runs while the fake holds the current one
            tasks.append(asyncio.ensure_future(batcher.submit(name, first=first, key=key)))
            await until(lambda q=queued_before: batcher.waiting == q + 1, f"{name} queued")
        if not batcher.waiting:
            break
        done = len(fake.batches)
        fake.release.release()
        await until(lambda d=done: len(fake.batches) > d, "the next batch")
    fake.release.release()
    results = await asyncio.gather(*tasks)
    assert results[0] == "audio of blocker"
    await batcher.close()
    return fake.batches[1:]


def test_a_first_chunk_goes_before_later_chunks_that_waited_longer():
    async def go():
        fake = GatedVocoder()
        batcher = ChunkBatcher(fake, max_batch_size=1, max_wait=0)
        return await served_order(batcher, fake, [("A later", False, 1), ("B later", False, 2),
                                                  ("C first", True, 3), ("D later", False, 4)])

    assert asyncio.run(go()) == [["C first"], ["A later"], ["B later"], ["D later"]]


def test_without_priority_chunks_go_first_come_first_served():
    async def go():
        fake = GatedVocoder()
        batcher = ChunkBatcher(fake, max_batch_size=1, max_wait=0, first_chunk_priority=False)
        return await served_order(batcher, fake, [("A later", False, 1), ("C first", True, 3)])

    assert asyncio.run(go()) == [["A later"], ["C first"]]


@pytest.mark.parametrize("bound", [0, 2, 3])
def test_a_later_chunk_passed_over_max_passed_over_times_is_served_before_newer_first_chunks(bound):
    """New requests keep coming (a first chunk queued after every batch): the later chunk still
    waits no more than ``bound`` batches."""
    async def go():
        fake = GatedVocoder()
        batcher = ChunkBatcher(fake, max_batch_size=1, max_wait=0, max_passed_over=bound)
        first = [(f"F{i}", True, f"f{i}") for i in range(6)]
        return await served_order(batcher, fake, [("L", False, "l"), *first[:2]], later=first[2:])

    order = [b[0] for b in asyncio.run(go())]
    assert order.index("L") == bound, order
    assert [x for x in order if x != "L"] == [f"F{i}" for i in range(6)]  # first chunks oldest first


def test_a_batch_holds_the_lead_chunks_key_up_to_the_batch_size_and_failures_stay_with_their_callers():
    async def go():
        fake = GatedVocoder()
        batcher = ChunkBatcher(fake, max_batch_size=2, max_wait=0)
        order = await served_order(batcher, fake, [("x1", False, "x"), ("y1", False, "y"), ("x2", False, "x"),
                                                   ("x3", False, "x"), ("y2", True, "y")])
        return order

    assert asyncio.run(go()) == [["y2", "y1"], ["x1", "x2"], ["x3"]]

    async def failures():
        fake = GatedVocoder()
        batcher = ChunkBatcher(fake, max_batch_size=4, max_wait=0)
        fake.release.release(), fake.release.release()
        results = await asyncio.gather(batcher.submit("good", key=1), batcher.submit("bad one", key=1),
                                       return_exceptions=True)
        after = await batcher.submit("good again")
        await batcher.close()
        with pytest.raises(BatcherClosed):
            await batcher.submit("late")
        return results, after

    (good, bad), after = asyncio.run(failures())
    assert good == "audio of good" and isinstance(bad, ValueError) and "bad one is bad" in str(bad)
    assert after == "audio of good again"


def test_closing_fails_the_waiting_chunks_and_a_cancelled_chunk_is_left_out():
    async def go():
        fake = GatedVocoder()
        batcher = ChunkBatcher(fake, max_batch_size=1, max_wait=0)
        blocker = asyncio.ensure_future(batcher.submit("blocker"))
        await until(lambda: len(fake.batches) == 1, "the first batch")
        gone = asyncio.ensure_future(batcher.submit("gone", first=True))
        waiting = asyncio.ensure_future(batcher.submit("waiting"))
        await until(lambda: batcher.waiting == 2, "two chunks queued")
        gone.cancel()
        await until(lambda: batcher.waiting == 1, "the cancelled chunk dropped")
        fake.release.release()
        assert await blocker == "audio of blocker"
        await until(lambda: len(fake.batches) == 2, "the next batch")
        await batcher.close()
        with pytest.raises(BatcherClosed):
            await waiting
        return fake.batches

    assert asyncio.run(go()) == [["blocker"], ["waiting"]]


def test_a_batch_with_a_first_chunk_holds_the_first_chunk_gate():
    gate = FirstChunkGate()

    async def go():
        fake = GatedVocoder(gate)
        batcher = ChunkBatcher(fake, max_batch_size=1, max_wait=0, gate=gate)
        for _ in range(2):
            fake.release.release()
        await batcher.submit("later", key=1)
        await batcher.submit("first", first=True, key=1)
        await batcher.close()
        return fake.held

    assert asyncio.run(go()) == [False, True]
    assert not gate.held and gate.wait(0)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"max_batch_size": 0}, "max_batch_size must be an integer of at least 1"),
    ({"max_passed_over": -1}, "max_passed_over must be an integer of at least 0"),
    ({"max_wait": -0.1}, "max_wait must be a number of seconds"),
])
def test_bad_batcher_options_are_refused_naming_them(kwargs, words):
    with pytest.raises(ValueError, match=words):
        ChunkBatcher(lambda items: items, **kwargs)


def test_the_chunk_batcher_is_a_micro_batcher_with_its_checks():
    from omni_core.kits import MicroBatcher

    assert issubclass(ChunkBatcher, MicroBatcher)  # max_batch_size, max_wait, fn checked in one place
    with pytest.raises(TypeError, match="needs a callable batch function, got int"):
        ChunkBatcher(3)


# -- a fake family's streaming vocoder through the kit's StreamingVocoder ---------------------------

SAMPLES = 4  # samples per frame


@attrs.define
class Window:
    synthesis: FakeSynthesis
    codes: list[int]
    window_start: int
    start: int
    end: int


class FakeSynthesis:
    """A chunked synthesis by the kit's ChunkSchedule: each frame's samples depend on the frame and
    its neighbours within ``REACH`` (a moving sum), so a chunk needs look-back and look-ahead."""

    def __init__(self, stage: FakeVocoder):
        self.stage = stage
        self.done = 0
        self.size = stage.schedule.first
        self.finished = False

    def _scheduled(self, n: int) -> bool:
        return n >= self.done + self.size + self.stage.schedule.lookahead

    def ready(self, n: int, final: bool) -> bool:
        return not self.finished and (final or self._scheduled(n))

    def plan(self, codes: list[int], final: bool):
        scheduled = self._scheduled(len(codes))
        end = self.done + self.size if scheduled else len(codes)
        if end <= self.done:
            self.finished = final
            return None
        start = self.stage.schedule.window_start(self.done)
        stop = end + self.stage.schedule.lookahead if scheduled else len(codes)
        return Window(self, codes[start:stop], start, self.done, end)

    def finish(self, window: Window, out: torch.Tensor) -> torch.Tensor:
        own = out[window.start - window.window_start:window.end - window.window_start]
        self.done = window.end
        self.size = self.stage.schedule.next(self.size)
        return own.reshape(-1)


REACH = 2


def moving(codes: list[int]) -> torch.Tensor:
    x = torch.tensor(codes, dtype=torch.float64)
    padded = torch.nn.functional.pad(x[None, None], (REACH, REACH))[0, 0]
    summed = torch.stack([padded[i:i + len(codes)] for i in range(2 * REACH + 1)]).sum(0)
    return (summed[:, None] * torch.arange(1, SAMPLES + 1, dtype=torch.float64)).float()


class FakeVocoder(StreamingVocoder):
    """A fake family: its "model" is :func:`moving`; windows of one length batch together."""

    def __init__(self, model, **kwargs):
        schedule = kwargs.pop("schedule")
        super().__init__(model, **kwargs)
        self.schedule = schedule
        self.runs: list[int] = []

    def load_model(self, path, *, dtype, device):
        return moving

    def new_synthesis(self, speaker, generator):
        return FakeSynthesis(self)

    def batch_key(self, window):
        return len(window.codes)

    def run_windows(self, windows):
        self.runs.append(len(windows))
        return [self.model(w.codes) for w in windows]

    def synthesize(self, frames, speaker, generator):
        return self.model(frames).reshape(-1)


class CodesCtx:
    """A talker's stream: the codes in chunks of ``per`` frames."""

    def __init__(self, codes: list[int], per: int):
        self.codes, self.per = codes, per
        self.emitted: list[dict] = []

    async def stream_from(self, source):
        parts = [self.codes[i:i + self.per] for i in range(0, len(self.codes), self.per)]
        for i, part in enumerate(parts):
            await asyncio.sleep(0)
            yield CodesChunk(part, 1, final=i == len(parts) - 1).to_wire()

    async def emit(self, chunk):
        self.emitted.append(chunk)


def scheduled_sizes(schedule: ChunkSchedule, total: int) -> list[int]:
    """The chunks of ``total`` frames: scheduled ones while their look-ahead is there, then the rest."""
    sizes, done, size = [], 0, schedule.first
    while done + size + schedule.lookahead <= total:
        sizes.append(size)
        done, size = done + size, schedule.next(size)
    return sizes + ([total - done] if total > done else [])


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_a_fake_familys_streamed_chunks_make_up_its_unchunked_synthesis_alone_and_together(fake_checkpoint, mode):
    presets = {"exact": {"first": 4, "growth": 2.0, "largest": 16, "lookahead": 4, "lookback": 4},
               "fast": {"first": 1, "growth": 2.0, "largest": 16, "lookahead": REACH, "lookback": REACH}}
    requests = [torch.randint(0, 9, (n,), generator=torch.Generator().manual_seed(n)).tolist()
                for n in (1, 5, 23, 40, 41)]

    def vocoder():
        return FakeVocoder(str(fake_checkpoint), schedule=ChunkSchedule.for_mode(mode, 4, presets), mode=mode,
                           max_batch_size=8, stage_name="fake")

    async def run(stage, batch):
        ctxs = [CodesCtx(codes, 3) for codes in batch]
        results = await asyncio.gather(*(stage({"seed": 0}, c) for c in ctxs))
        await stage.close()
        return [(r, [c["audio"] for c in ctx.emitted if "audio" in c]) for r, ctx in zip(results, ctxs, strict=True)]

    alone = [asyncio.run(run(vocoder(), [codes]))[0] for codes in requests]
    together_stage = vocoder()
    together = asyncio.run(run(together_stage, requests))
    for codes, (one, one_chunks), (many, chunks) in zip(requests, alone, together, strict=True):
        unchunked = moving(codes).reshape(-1)
        assert torch.equal(one["audio"], unchunked) and torch.equal(many["audio"], unchunked)
        assert torch.equal(torch.cat(chunks), many["audio"]) and many["codes"] == codes
        sizes = [len(c) // SAMPLES for c in chunks]
        want = scheduled_sizes(ChunkSchedule.for_mode(mode, 4, presets), len(codes))
        assert sizes == want and [len(c) for c in one_chunks] == [len(c) for c in chunks], (sizes, want)
    assert max(together_stage.runs) > 1  # some windows ran together


def test_a_vocoder_refuses_an_unknown_mode_naming_the_modes(fake_checkpoint):
    with pytest.raises(ValueError, match="mode must be one of exact, fast, got 'quick'"):
        FakeVocoder(str(fake_checkpoint), schedule=None, mode="quick")
