"""The streaming vocoder skeleton: codec codes → waveform, synthesised in chunks as the talker's
frames arrive, chunks of concurrent requests batched (:class:`ChunkBatcher`, first chunks first).

A family subclasses :class:`StreamingVocoder` and fills its hooks:

- ``load_model(path, *, dtype, device)``: its vocoder part;
- ``speaker(payload)``: a request's voice conditioning (``InvalidInput`` naming ``speaker`` for a
  bad name), handed to the synthesis;
- ``new_synthesis(speaker, generator)``: one request's chunked synthesis, an object with
  ``ready(n, final)`` (can the next chunk be made from ``n`` frames; ``final``: the talker ended),
  ``plan(frames, final)`` (the next chunk's window: the frames it is computed from, with the left
  context before it and the look-ahead after it, as an object whose ``synthesis`` is the
  synthesis; None when nothing is left) and ``finish(window, out)`` (the chunk's samples from the
  window's model output, trimmed to its own frames). :class:`ChunkSchedule` holds the usual sizes
  (first chunk, growth, largest chunk, left context, look-ahead, aligned by ``mode``:
  :meth:`ChunkSchedule.for_mode`). ``plan`` runs on the event loop (keep it light: slicing, a
  noise draw), ``finish`` on the batcher's thread;
- ``run_windows(windows)``: the model on the planned windows of concurrent requests → one output
  per window (default: ``run_window`` on each);
- ``batch_key(window)``: windows with equal keys can run in one ``run_windows`` call, and a batch
  holds one key (default None: any windows together);
- ``synthesize(frames, speaker, generator)``: the whole waveform at once (``stream: false``).

Scheduling (:class:`ChunkBatcher`): a request's first chunk is served before other requests'
later chunks (``first_chunk_priority``), and a later chunk passed over by ``max_passed_over``
batches is served before any newer chunk, so no request starves. While a batch with a first
chunk runs, a talker in the same process holds back between its steps (:class:`FirstChunkGate`).

``codebooks`` is the codes per frame the stage takes (a talker's ``CodesChunk.codebooks``); a frame
is an int for 1, a list of ``codebooks`` ints otherwise. The stage streams ``{"audio",
"sample_rate"}`` chunks (``kit.chunks.AudioChunk``), passes text chunks from its source on to the
caller (``relay_text``), writes a WAV as it goes when asked (``wav_path``), and returns ``{"text",
"token_ids", "codes", "audio", "sample_rate", usage...}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import threading
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any

import torch
from omni_core.files import local_path
from omni_core.kits import MicroBatcher

from .checks import VOCODER_MODES
from .chunks import AudioChunk, ChunkError, CodesChunk, TextChunk, codes_chunk
from .sampling import make_generator, resolve_model_path
from .streams import USAGE_KEYS, StreamProgress, request_seed


def stream_error(streamed: torch.Tensor, unchunked: torch.Tensor) -> tuple[float, float]:
    """(relative RMS error, correlation) of a streamed waveform against the unchunked one."""
    if streamed.shape != unchunked.shape:
        raise ValueError(f"the streamed audio has {streamed.numel()} samples, the unchunked {unchunked.numel()}")
    a, b = streamed.double(), unchunked.double()
    if b.numel() == 0:
        return 0.0, 1.0
    rel = float((a - b).norm() / b.norm().clamp_min(1e-30))
    corr = float(torch.corrcoef(torch.stack([a, b]))[0, 1]) if b.numel() > 1 else 1.0
    return rel, corr


def stream_difference(streamed: torch.Tensor, unchunked: torch.Tensor) -> dict[str, float]:
    """How far a streamed waveform is from the unchunked one: ``max_abs`` (the largest sample
    difference), ``snr_db`` (the unchunked waveform's power over the difference's, in dB; inf when
    equal), ``relative_error`` and ``correlation`` (:func:`stream_error`)."""
    rel, corr = stream_error(streamed, unchunked)
    diff = (streamed.double() - unchunked.double()).abs()
    noise = float(diff.square().sum())
    signal = float(unchunked.double().square().sum())
    snr = float("inf") if noise == 0 else 10 * math.log10(max(signal, 1e-300) / noise)
    return {"max_abs": float(diff.max()) if diff.numel() else 0.0, "snr_db": snr, "relative_error": rel,
            "correlation": corr}


def receptive_field(vocoder, mel_dim: int, hop: int, device, start: int = 16, limit: int = 1024) -> int:
    """How many mel frames on either side of a frame change a convolutional vocoder's output for it
    (``hop`` samples a frame): a one-frame change in the middle of a random mel, and the span of
    samples it moves (grown until the span stays inside the probe)."""
    probe = start
    generator = torch.Generator().manual_seed(0)
    while probe <= limit:
        length = 2 * probe + 1
        mel = torch.randn(1, mel_dim, length, generator=generator).to(device) * 0.5 - 4
        bumped = mel.clone()
        bumped[..., probe] += 1.0
        with torch.inference_mode():
            moved = (vocoder(mel).reshape(-1) != vocoder(bumped).reshape(-1)).nonzero().reshape(-1)
        if moved.numel() == 0:
            return 0
        first, last = int(moved[0]) // hop, int(moved[-1]) // hop
        reach = max(probe - first, last - probe)
        if first > 0 and last < length - 1:
            return reach + 1
        probe *= 2
    raise RuntimeError(f"the vocoder's receptive field is wider than {limit} mel frames on each side")


#: How a streaming vocoder cuts its chunks (``mode``): ``exact`` keeps every chunk boundary and
#: context on the model's own blocks (equal to the unchunked synthesis within the family's tested
#: bound); ``fast`` starts at one frame, ramps up, and looks ahead less (the first audio sooner, a
#: measured difference to the unchunked synthesis; docs/models.md).
MODES = VOCODER_MODES


class ChunkSchedule:
    """Chunk sizes in frames: the first ``first`` frames, each next one ``growth`` times larger up to
    ``largest`` (a ramp: 1, 2, 4 ... with ``first`` 1 and ``growth`` 2); ``lookback`` frames of left
    context and ``lookahead`` frames after a chunk; every size rounded up to a multiple of
    ``align``, and a chunk's window (its context included) starting on a multiple of
    ``window_align`` (default ``align``). Bad values are ``ValueError`` naming the option.

    :meth:`for_mode` builds a mode's schedule from a family's presets."""

    def __init__(self, first: int, growth: float, largest: int, lookahead: int, lookback: int, align: int = 1,
                 names: tuple[str, ...] = ("first_chunk_codes", "chunk_growth", "max_chunk_codes",
                                           "lookahead_codes", "lookback_codes"), window_align: int | None = None):
        self.align = align
        self.window_align = align if window_align is None else window_align
        for name, value in ((names[0], first), (names[2], largest)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name, value in ((names[3], lookahead), (names[4], lookback)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if not growth >= 1:
            raise ValueError(f"{names[1]} must be at least 1, got {growth!r}")
        self.first = self.aligned(first)
        self.largest = max(self.first, self.aligned(largest))
        self.growth = float(growth)
        self.lookahead = self.aligned(lookahead)
        self.lookback = self.aligned(lookback)

    @classmethod
    def for_mode(cls, mode: str, block: int, presets: dict[str, dict], **given) -> ChunkSchedule:
        """``mode``'s schedule: its preset (``presets[mode]``: ``first``, ``growth``, ``largest``,
        ``lookahead``, ``lookback``) with the ``given`` values that are not None over it. ``exact``
        aligns every size and window to ``block`` frames (the model's attention block); ``fast``
        cuts chunks anywhere but still starts each window on a block."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        values = {**presets[mode], **{k: v for k, v in given.items() if v is not None}}
        return cls(values["first"], values["growth"], values["largest"], values["lookahead"], values["lookback"],
                   align=block if mode == "exact" else 1, window_align=block)

    def aligned(self, frames: int) -> int:
        return -(-frames // self.align) * self.align

    def window_start(self, start: int) -> int:
        """Where the window of a chunk starting at frame ``start`` begins: ``lookback`` frames
        before it, down to a multiple of ``window_align``."""
        begin = max(0, start - self.lookback)
        return begin // self.window_align * self.window_align

    def first_ready(self, margin: int = 0) -> int:
        """Frames that must have arrived before the first chunk can be made (``margin``: frames
        the family needs past the look-ahead)."""
        return self.first + self.lookahead + margin

    def next(self, size: int) -> int:
        return min(self.largest, self.aligned(int(size * self.growth)))

    def sizes(self, total: int | None = None) -> list[int]:
        """The chunk sizes (for ``total`` frames, the last one what is left; else the first 8)."""
        sizes, size, done = [], self.first, 0
        while total is None and len(sizes) < 8 or total is not None and done < total:
            sizes.append(size if total is None else min(size, total - done))
            done += sizes[-1]
            size = self.next(size)
        return sizes


class FirstChunkGate:
    """Process-wide: while a vocoder makes a request's first chunk, the other model threads of the
    process that ask (a talker's decode loop, between two steps) hold back, each wait at most its
    own bound. On CPU the stages of one process share one interpreter lock, so a talker stepping
    beside the vocoder makes the first chunk wait for its steps (measured: a first chunk's model
    run took 2-5 times as long beside a talker generating); where the talker is ahead of the
    vocoder, as there, holding it back costs the request little."""

    def __init__(self):
        self._lock = threading.Lock()
        self._busy = 0
        self._idle = threading.Event()
        self._idle.set()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Around the making of a first chunk."""
        with self._lock:
            self._busy += 1
            self._idle.clear()
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1
                if self._busy == 0:
                    self._idle.set()

    @property
    def held(self) -> bool:
        return not self._idle.is_set()

    def wait(self, timeout: float) -> bool:
        """Wait until no first chunk is being made, at most ``timeout`` seconds; True if none is."""
        return self._idle.wait(timeout) if timeout > 0 else self._idle.is_set()


#: The gate of this process (see :class:`FirstChunkGate`).
FIRST_CHUNKS = FirstChunkGate()


class _Chunk:
    __slots__ = ("item", "future", "arrived", "first", "key", "seq", "passed")

    def __init__(self, item: Any, future: asyncio.Future, arrived: float, first: bool, key: Hashable, seq: int):
        self.item = item
        self.future = future
        self.arrived = arrived
        self.first = first
        self.key = key
        self.seq = seq
        self.passed = 0  # batches that ran while this chunk waited


class ChunkBatcher(MicroBatcher):
    """The vocoder's micro-batcher, scheduled for the first audio: ``submit(item, first=, key=)``
    queues one chunk and returns its result. A batch is the waiting chunks of one ``key`` (what
    the model runs together), led by the most urgent chunk: a request's first chunk before other
    requests' later ones (``first_chunk_priority``), else the oldest. A chunk passed over by
    ``max_passed_over`` batches becomes urgent too, and urgent chunks go oldest first, so a later
    chunk waits at most ``max_passed_over`` batches plus one per urgent chunk older than it: no
    request starves. Otherwise an ``omni_core.kits.MicroBatcher``: its ``max_batch_size`` /
    ``max_wait`` and their checks (a batch starts when that many chunks wait, or ``max_wait``
    seconds after the oldest arrived), its contract for ``fn`` (a list of items → one result or
    exception per item; a plain function runs on a worker thread), closing and failing. A batch
    holding a first chunk runs inside ``gate.hold()`` (default :data:`FIRST_CHUNKS`; None: no
    gate)."""

    def __init__(self, fn: Callable[[list], list], *, max_batch_size: int = 16, max_wait: float = 0.002,
                 first_chunk_priority: bool = True, max_passed_over: int = 4, name: str | None = None,
                 gate: FirstChunkGate | None = FIRST_CHUNKS):
        super().__init__(fn, max_batch_size=max_batch_size, max_wait=max_wait, name=name)
        if isinstance(max_passed_over, bool) or not isinstance(max_passed_over, int) or max_passed_over < 0:
            raise ValueError(f"max_passed_over must be an integer of at least 0, got {max_passed_over!r}")
        self.first_chunk_priority = bool(first_chunk_priority)
        self.max_passed_over = max_passed_over
        self.gate = gate
        self._waiting: list[_Chunk] = []  # type: ignore[assignment]  # ranked, not first in first out
        self._seq = itertools.count()

    async def submit(self, item: Any, *, first: bool = False, key: Hashable = None) -> Any:
        """Queue one chunk (``first``: a request's first; ``key``: what it batches with) and
        return its result (or raise its error)."""
        self._check_open()
        loop = self._bind()
        future = loop.create_future()
        self._waiting.append(_Chunk(item, future, loop.time(), first, key, next(self._seq)))
        self._poke()
        return await future

    def _rank(self, chunk: _Chunk) -> tuple[bool, int]:
        urgent = chunk.passed >= self.max_passed_over or (self.first_chunk_priority and chunk.first)
        return not urgent, chunk.seq

    def _choose(self) -> list[_Chunk]:
        ranked = sorted(self._waiting, key=self._rank)
        return [c for c in ranked if c.key == ranked[0].key][:self.max_batch_size]

    async def _turn(self) -> bool:
        self._waiting = [c for c in self._waiting if not c.future.done()]  # callers that gave up
        if not self._waiting:
            return False
        assert self._loop is not None
        deadline = min(c.arrived for c in self._waiting) + self.max_wait
        if len(self._waiting) < self.max_batch_size and self._loop.time() < deadline:
            await self._sleep(deadline)  # for more chunks, or the oldest one's deadline
            return True
        batch = self._choose()
        chosen = set(map(id, batch))
        self._waiting = [c for c in self._waiting if id(c) not in chosen]
        for chunk in self._waiting:
            chunk.passed += 1
        await self._run(batch)
        return True

    async def _run(self, batch: list[_Chunk]) -> None:
        self.stats.record(len(batch))
        gate = self.gate if self.gate is not None and any(c.first for c in batch) else None
        with gate.hold() if gate is not None else contextlib.nullcontext():
            await self._run_batch(batch)


class StreamingVocoder:
    """Codes → waveform, streamed as the talker's frames arrive (``stream: false``: one chunk once
    the codes are all in). ``mode``: ``exact`` or ``fast`` (:data:`MODES`; how the family cuts its
    chunks). ``max_batch_size`` / ``max_wait`` / ``first_chunk_priority`` / ``max_passed_over``:
    the :class:`ChunkBatcher` of the chunks of concurrent requests."""

    codebooks = 1

    def __init__(self, model: str | None = None, device: str = "cpu", dtype: str = "float32",
                 sample_rate: int = 24000, wav_path: str | None = None, source: str = "talker",
                 stream: bool = True, max_batch_size: int = 16, max_wait: float = 0.002,
                 stage_name: str = "vocoder", relay_text: bool = True, mode: str = "exact",
                 first_chunk_priority: bool = True, max_passed_over: int = 4):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.path = resolve_model_path(model)
        self.device = torch.device(device)
        self.model = self.load_model(self.path, dtype=dtype, device=device)
        self.sample_rate = sample_rate
        self.wav_path = wav_path
        self.source = source
        self.stream = stream
        self.relay_text = relay_text
        self.batcher = ChunkBatcher(self._windows, max_batch_size=max_batch_size, max_wait=max_wait,
                                    first_chunk_priority=first_chunk_priority, max_passed_over=max_passed_over,
                                    name=stage_name)

    # -- hooks --------------------------------------------------------------------------------
    def load_model(self, path, *, dtype: str, device: str):
        raise NotImplementedError(f"{type(self).__name__} must load its vocoder part (load_model)")

    def speaker(self, payload: dict) -> Any:
        return None

    def new_synthesis(self, speaker: Any, generator: torch.Generator):
        raise NotImplementedError(f"{type(self).__name__} must make a chunked synthesis (new_synthesis)")

    def run_windows(self, windows: list) -> list:
        return [self.run_window(w) for w in windows]

    def batch_key(self, window) -> Hashable:
        return None

    def run_window(self, window) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must run its model on a window (run_window)")

    def synthesize(self, frames: list, speaker: Any, generator: torch.Generator) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must synthesise whole (synthesize)")

    # -- the chunks (a worker thread) -------------------------------------------------------------
    def _windows(self, windows: list) -> list[torch.Tensor | Exception]:
        """Each planned window's chunk (the batcher's function): the model on them all
        (``run_windows``), then each synthesis's ``finish`` (a failure there is its request's alone)."""
        with torch.inference_mode():
            result: list = []
            for w, out in zip(windows, self.run_windows(windows), strict=True):
                try:
                    result.append(w.synthesis.finish(w, out))
                except Exception as exc:
                    result.append(exc)
            return result

    def _chunks(self, items: list[tuple[Any, list, bool]]) -> list[torch.Tensor | Exception]:
        """The next chunk of each request, planned and made in one call (empty: nothing left)."""
        with torch.inference_mode():
            windows: list = []
            for synthesis, frames, final in items:
                try:
                    windows.append(synthesis.plan(frames, final))
                except Exception as exc:  # this request's failure alone
                    windows.append(exc)
        ready = [w for w in windows if w is not None and not isinstance(w, Exception)]
        made = iter(self._windows(ready) if ready else ())
        return [torch.zeros(0) if w is None else w if isinstance(w, Exception) else next(made) for w in windows]

    def next_chunk(self, synthesis, frames: list, final: bool) -> torch.Tensor:
        """One request's next chunk computed alone (empty when nothing is left)."""
        return self._chunks([(synthesis, frames, final)])[0]

    async def close(self) -> None:
        await self.batcher.close()

    async def __call__(self, payload: dict, ctx) -> dict:
        from omni_core import PENDING

        received = CodesReceived(ctx, self.source, self.codebooks, self.relay_text)
        reader = asyncio.create_task(received.read())  # text goes on to the caller before the payload is here
        chunks: list[torch.Tensor] = []
        wav: WavWriter | None = None

        async def emit(audio: torch.Tensor) -> None:
            chunks.append(audio)
            if wav is not None:
                await asyncio.to_thread(wav.write, audio)
            await ctx.emit(AudioChunk(audio, self.sample_rate).to_wire())

        try:
            if payload is PENDING:  # started on the talker's first chunk (can_accept_stream_before_payload)
                payload = await ctx.payload()
            speaker = self.speaker(payload)
            generator = make_generator(request_seed(payload), self.device)
            if "wav_path" in payload:  # the request's file (the operator's wav_path otherwise)
                wav_path = payload["wav_path"] and str(local_path(ctx, payload["wav_path"], "wav_path", write=True))
            else:
                wav_path = self.wav_path
            if wav_path:
                wav = WavWriter(str(wav_path), self.sample_rate)
            if self.stream:
                synthesis = self.new_synthesis(speaker, generator)
                made = 0
                while True:
                    await received.wait(lambda: synthesis.ready(len(received.codes), received.finished))
                    if synthesis.ready(len(received.codes), received.finished):
                        with torch.inference_mode():
                            window = synthesis.plan(list(received.codes), received.finished)
                        if window is None:  # nothing left
                            continue
                        audio = await self.batcher.submit(window, first=made == 0, key=self.batch_key(window))
                        made += 1
                        if audio.numel():
                            await emit(audio)
                    elif received.finished:
                        break
            await reader
            if not self.stream:
                if received.rng_state is not None:  # continue the talker's RNG, as generate's global one
                    generator.set_state(received.rng_state)
                await emit(await asyncio.to_thread(self.synthesize, received.codes, speaker, generator)
                           if received.codes else torch.zeros(0))
            if not chunks:  # the talker ended at once
                await emit(torch.zeros(0))
            if wav is not None:
                wav_path = await asyncio.to_thread(wav.close)
                wav = None
        finally:
            if not reader.done():
                reader.cancel()
            if wav is not None:
                wav.abort()
        result = {"text": "".join(received.text), "token_ids": received.token_ids, "codes": received.codes,
                  "audio": torch.cat(chunks), "sample_rate": self.sample_rate}
        result.update({k: received.extra[k] for k in USAGE_KEYS if k in received.extra})
        if wav_path:
            result["wav_path"] = wav_path
        return result


class CodesReceived(StreamProgress):
    """What the talker's stream brought so far, read in a task of its own: ``codes`` (frames: ints
    for one codebook, lists of ``codebooks`` ints otherwise), text (passed on to the caller at once
    when ``relay``) and usage; ``wait(ready)`` returns when ``ready()`` holds or the stream ended."""

    def __init__(self, ctx, source: str, codebooks: int = 1, relay: bool = True):
        super().__init__(source)
        self.ctx = ctx
        self.codebooks = codebooks
        self.relay = relay
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.codes: list = []
        self.extra: dict = {}
        self.finished = False
        self.rng_state: torch.Tensor | None = None

    async def _read(self) -> None:
        async for wire in self.ctx.stream_from(self.source):
            chunk = codes_chunk(wire)
            if isinstance(chunk, CodesChunk):
                if chunk.codebooks != self.codebooks:
                    raise ChunkError(f"the vocoder takes frames of {self.codebooks} codes, "
                                     f"got frames of {chunk.codebooks}")
                if self.codebooks == 1:
                    self.codes.extend(int(c) for c in chunk.codes)
                else:
                    self.codes.extend([int(c) for c in f] for f in chunk.frames)
                if chunk.final:
                    self.finished = True
                    if chunk.rng_state is not None:
                        self.rng_state = torch.frombuffer(bytearray(chunk.rng_state), dtype=torch.uint8)
            else:
                if "text" in wire:
                    self.text.append(chunk.text)
                    self.token_ids.extend(chunk.token_ids)
                    if self.relay:
                        await self.ctx.emit(TextChunk(chunk.text, chunk.token_ids).to_wire())
                self.extra.update({k: chunk.usage[k] for k in USAGE_KEYS if k in chunk.usage})
            self.changed.set()
        if not self.finished:
            raise RuntimeError(f"the {self.source} stream ended without its final chunk")


class WavWriter:
    """A 16-bit mono WAV written chunk by chunk: the first chunk goes to a new file beside
    ``path`` that is then renamed onto ``path``, and every later chunk is appended to it with the
    header brought up to date, so ``path`` is a whole WAV of the audio so far at every moment (a
    player can open it while the request runs). Concurrent requests naming one path never mix:
    each writes its own file, the last rename wins."""

    def __init__(self, path: str, sample_rate: int):
        self.target = Path(path).expanduser().resolve()
        self.sample_rate = sample_rate
        self._file = self._wave = None
        self._tmp: str | None = None

    def write(self, audio: torch.Tensor) -> None:
        import os
        import tempfile
        import wave

        pcm = (audio.clamp(-1, 1) * 32767).round().to(torch.int16).numpy().tobytes()
        if self._wave is None:
            self.target.parent.mkdir(parents=True, exist_ok=True)
            fd, self._tmp = tempfile.mkstemp(prefix=f".{self.target.name}.", dir=self.target.parent)
            self._file = os.fdopen(fd, "wb")  # noqa: SIM115 - open across chunks, closed in close()
            self._wave = wave.open(self._file, "wb")  # noqa: SIM115
            self._wave.setnchannels(1)
            self._wave.setsampwidth(2)
            self._wave.setframerate(self.sample_rate)
            self._wave.writeframes(pcm)  # the header is patched on every write with new frames
            self._file.flush()
            os.replace(self._tmp, self.target)
            self._tmp = None
        else:
            self._wave.writeframes(pcm)
            self._file.flush()

    def close(self) -> str:
        """Finish the file (an empty WAV if no chunk came) and return its path."""
        if self._wave is None:
            self.write(torch.zeros(0))
        self._wave.close()
        self._file.close()
        self._wave = None
        return str(self.target)

    def abort(self) -> None:
        """Close without finishing: the temporary file of a request that failed before its first
        chunk is removed."""
        for thing in (self._wave, self._file):
            try:
                if thing is not None:
                    thing.close()
            except Exception:  # noqa: BLE001 - best effort on a failed request
                pass
        if self._tmp is not None:
            Path(self._tmp).unlink(missing_ok=True)
