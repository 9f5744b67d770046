"""The streaming vocoder skeleton: codec codes → waveform, synthesised in chunks as the talker's
frames arrive, chunks of concurrent requests batched (``omni_core.MicroBatcher``).

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
  (first chunk, growth, largest chunk, left context, look-ahead, all aligned);
- ``run_windows(windows)``: the model on the planned windows of concurrent requests → one output
  per window (default: ``run_window`` on each);
- ``synthesize(frames, speaker, generator)``: the whole waveform at once (``stream: false``).

``codebooks`` is the codes per frame the stage takes (a talker's ``CodesChunk.codebooks``); a frame
is an int for 1, a list of ``codebooks`` ints otherwise. The stage streams ``{"audio",
"sample_rate"}`` chunks (``kit.chunks.AudioChunk``), passes text chunks from its source on to the
caller (``relay_text``), writes a WAV as it goes when asked (``wav_path``), and returns ``{"text",
"token_ids", "codes", "audio", "sample_rate", usage...}``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch
from omni_core.files import local_path
from omni_core.kits import MicroBatcher

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


class ChunkSchedule:
    """Chunk sizes in frames: the first ``first`` frames, each next one ``growth`` times larger up to
    ``largest``; ``lookback`` frames of left context and ``lookahead`` frames after a chunk; every
    size rounded up to a multiple of ``align``. Bad values are ``ValueError`` naming the option."""

    def __init__(self, first: int, growth: float, largest: int, lookahead: int, lookback: int, align: int = 1,
                 names: tuple[str, ...] = ("first_chunk_codes", "chunk_growth", "max_chunk_codes",
                                           "lookahead_codes", "lookback_codes")):
        self.align = align
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

    def aligned(self, frames: int) -> int:
        return -(-frames // self.align) * self.align

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


class StreamingVocoder:
    """Codes → waveform, streamed as the talker's frames arrive (``stream: false``: one chunk once
    the codes are all in). ``max_batch_size`` / ``max_wait``: the micro-batcher of the chunks of
    concurrent requests."""

    codebooks = 1

    def __init__(self, model: str | None = None, device: str = "cpu", dtype: str = "float32",
                 sample_rate: int = 24000, wav_path: str | None = None, source: str = "talker",
                 stream: bool = True, max_batch_size: int = 16, max_wait: float = 0.002,
                 stage_name: str = "vocoder", relay_text: bool = True):
        self.path = resolve_model_path(model)
        self.device = torch.device(device)
        self.model = self.load_model(self.path, dtype=dtype, device=device)
        self.sample_rate = sample_rate
        self.wav_path = wav_path
        self.source = source
        self.stream = stream
        self.relay_text = relay_text
        self.batcher = MicroBatcher(self._chunks, max_batch_size=max_batch_size, max_wait=max_wait, name=stage_name)

    # -- hooks --------------------------------------------------------------------------------
    def load_model(self, path, *, dtype: str, device: str):
        raise NotImplementedError(f"{type(self).__name__} must load its vocoder part (load_model)")

    def speaker(self, payload: dict) -> Any:
        return None

    def new_synthesis(self, speaker: Any, generator: torch.Generator):
        raise NotImplementedError(f"{type(self).__name__} must make a chunked synthesis (new_synthesis)")

    def run_windows(self, windows: list) -> list:
        return [self.run_window(w) for w in windows]

    def run_window(self, window) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must run its model on a window (run_window)")

    def synthesize(self, frames: list, speaker: Any, generator: torch.Generator) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must synthesise whole (synthesize)")

    # -- the chunks (a worker thread) -------------------------------------------------------------
    def _chunks(self, items: list[tuple[Any, list, bool]]) -> list[torch.Tensor | Exception]:
        """The next chunk of each request (the micro-batcher's function)."""
        with torch.inference_mode():
            windows: list = []
            for synthesis, frames, final in items:
                try:
                    windows.append(synthesis.plan(frames, final))
                except Exception as exc:  # this request's failure alone
                    windows.append(exc)
            ready = [w for w in windows if w is not None and not isinstance(w, Exception)]
            outs = dict(zip(map(id, ready), self.run_windows(ready), strict=True)) if ready else {}
            result: list = []
            for w in windows:
                if w is None:
                    result.append(torch.zeros(0))
                elif isinstance(w, Exception):
                    result.append(w)
                else:
                    try:
                        result.append(w.synthesis.finish(w, outs[id(w)]))
                    except Exception as exc:
                        result.append(exc)
            return result

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
                while True:
                    await received.wait(lambda: synthesis.ready(len(received.codes), received.finished))
                    if synthesis.ready(len(received.codes), received.finished):
                        frames, final = list(received.codes), received.finished
                        audio = await self.batcher.submit((synthesis, frames, final))
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
