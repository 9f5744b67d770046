"""Qwen3-Omni's speech on the kit, in process: the talker's frames of 16 codes (code0 + the code predictor's 15)
equal what transformers' ``generate(return_audio=True)`` decodes (greedy), alone and for 16 requests at once;
code2wav streamed in chunks equals code2wav over all the frames; a reply with nothing to speak and a first
code that is the end code give text and no audio."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from omni_transformers.qwen3_omni import tiny

pytestmark = [pytest.mark.timeout(900)]

# Greedy margins on random weights are thin (some 1e-7): another matmul shape can flip a pick. These prompts'
# margins hold, alone and batched, with the voice chelsie (checked against generate below).
PROMPTS = ["Hello there, say something.", "What is up?", "Tell me a story", "hi", "Describe Paris.",
           "Why is the sky blue?", "Count to five", "A haiku, please", "ok", "Name three colours.",
           "What time is it?", "Say yes", "Spell omni", "Good morning!", "Help me", "Bye"]
SPEAKER = "chelsie"
THINKER_MAX, TALKER_MAX = 24, 64


class Wire:
    """One stage's stream to the next, in process: what one emits, the other reads (``None`` ends it)."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.emitted: list = []

    async def emit(self, chunk):
        self.emitted.append(chunk)
        await self.queue.put(chunk)

    async def end(self):
        await self.queue.put(None)

    async def stream_from(self, source):
        while (chunk := await self.queue.get()) is not None:
            yield chunk


class Reader:
    """A stage context reading ``wire`` and emitting into its own wire."""

    def __init__(self, wire: Wire):
        self.source = wire
        self.out = Wire()

    async def emit(self, chunk):
        await self.out.emit(chunk)

    def stream_from(self, source):
        return self.source.stream_from(source)


async def speak(stages, payload: dict) -> tuple[dict, dict, dict]:
    """thinker -> talker -> code2wav for one request: the three results."""
    thinker, talker, code2wav = stages
    to_talker = Wire()
    talker_ctx = Reader(to_talker)
    vocoder_ctx = Reader(talker_ctx.out)

    async def run(stage, ctx, wire):
        try:
            return await stage(dict(payload), ctx)
        finally:
            await wire.end()

    return await asyncio.gather(run(thinker, to_talker, to_talker), run(talker, talker_ctx, talker_ctx.out),
                                code2wav(dict(payload), vocoder_ctx))


def frames_of(codes: list[int]) -> list[list[int]]:
    return [codes[i:i + 16] for i in range(0, len(codes), 16)]


@pytest.fixture(scope="module")
def qwen3_tiny(tmp_path_factory):
    return tiny.write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_omni_tiny") / "ckpt")


@pytest.fixture(scope="module")
def stages(qwen3_tiny):
    from omni_transformers.kit.engines import EngineRegistry
    from omni_transformers.qwen3_omni.code2wav import Code2Wav
    from omni_transformers.qwen3_omni.processor import Processor
    from omni_transformers.qwen3_omni.talker import Talker
    from omni_transformers.qwen3_omni.thinker import Thinker

    thinker = Thinker(str(qwen3_tiny), max_new_tokens=THINKER_MAX, engines=EngineRegistry())
    talker = Talker(str(qwen3_tiny), do_sample=False, max_new_tokens=TALKER_MAX)
    code2wav = Code2Wav(str(qwen3_tiny))
    yield Processor(str(qwen3_tiny)), (thinker, talker, code2wav)

    async def close():
        for stage in (thinker, talker, code2wav):
            await stage.close()

    asyncio.run(close())


def reference(qwen3_tiny, ids_list, **media):
    """transformers' generate (greedy thinker and talker) for each prompt (``media``: its audio or image inputs):
    the reply's tokens and the frames code2wav decodes."""
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(qwen3_tiny)
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(qwen3_tiny).eval()
    # transformers 5.25's generate fails for a prompt with audio and an image (the talker's get_rope_index reads
    # config.audio_config, which the talker config lacks): give it the thinker's, as omni's talker does. Only
    # that prompt reads it, so the other references are unchanged.
    model.talker.config.audio_config = model.config.thinker_config.audio_config
    out = []
    for ids in ids_list:
        decoded = []
        hook = model.code2wav.register_forward_pre_hook(lambda module, args, into=decoded: into.append(args[0]))
        try:
            seq, _ = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    return_audio=True, speaker=SPEAKER, thinker_eos_token_id=tok.eos_token_id,
                                    thinker_max_new_tokens=THINKER_MAX, talker_do_sample=False,
                                    talker_max_new_tokens=TALKER_MAX, **media)
        finally:
            hook.remove()
        out.append((seq[0, len(ids):].tolist(), decoded[0][0].T.tolist()))
    return out


def assert_as_generate(thought: dict, talked: dict, tokens: list[int], want: list) -> None:
    """A spoken reply equals generate's: its tokens, and its frames but that generate decodes one frame less when
    it stops at talker_max_new_tokens (its code predictor runs a step late)."""
    assert thought["token_ids"] == tokens
    frames = frames_of(talked["codes"])
    assert len(want) > 10 and frames[:len(want)] == want and len(frames) - len(want) in (0, 1)


def test_frames_equal_generate_alone_and_16_at_once_equal_alone(qwen3_tiny, stages):
    processor, chain = stages
    payloads = [processor({"text": text, "speaker": SPEAKER}, None) for text in PROMPTS]
    expected = reference(qwen3_tiny, [p["input_ids"] for p in payloads])

    async def go():
        alone = [await speak(chain, p) for p in payloads]
        together = await asyncio.gather(*(speak(chain, p) for p in payloads))
        return alone, together

    alone, together = asyncio.run(go())
    assert sum(len(frames) for _, frames in expected) > 100  # speech, not at once the end code
    for (thought, talked, voiced), (tokens, frames) in zip(alone, expected, strict=True):
        assert thought["token_ids"] == tokens
        assert frames_of(talked["codes"]) == frames
        assert voiced["codes"] == frames
        assert voiced["audio"].numel() == (len(frames) * 1920 - 555 if frames else 0)
    for (_, talked, voiced), (_, talked_alone, voiced_alone) in zip(together, alone, strict=True):
        assert talked["codes"] == talked_alone["codes"]
        # code2wav batches the chunks of concurrent requests: a batched row may differ in the last float bits
        assert voiced["audio"].shape == voiced_alone["audio"].shape
        if voiced["audio"].numel():
            assert (voiced["audio"] - voiced_alone["audio"]).abs().max().item() < 1e-5


def streamed(code2wav, frames: list) -> list[torch.Tensor]:
    """The chunks of ``frames`` arriving one by one, each chunk made as soon as the schedule allows."""
    synthesis = code2wav.new_synthesis(None, None)
    chunks, n = [], 0
    while True:
        while n < len(frames) and not synthesis.ready(n, False):
            n += 1
        final = n == len(frames)
        if not synthesis.ready(n, final):
            return chunks
        chunks.append(synthesis.next_chunk(frames[:n], final))


def test_streamed_code2wav_equals_code2wav_over_all_frames_in_both_modes(qwen3_tiny, stages):
    from omni_transformers.qwen3_omni.code2wav import (
        FAST_MAX_ABS_ERROR,
        STREAM_MAX_ABS_ERROR,
        Code2Wav,
    )

    _, (_, _, exact) = stages
    frames = torch.randint(0, 2048, (300, 16), generator=torch.Generator().manual_seed(0)).tolist()
    whole = exact.decode(frames)
    assert whole.numel() == 300 * 1920 - 555 and whole.abs().max() > 0.01
    fast = Code2Wav(str(qwen3_tiny), mode="fast")
    try:
        for code2wav, first, bound in ((exact, 1, STREAM_MAX_ABS_ERROR), (fast, 1, FAST_MAX_ABS_ERROR)):
            chunks = streamed(code2wav, frames)
            # the first chunk: its frames less the 555 samples its last frame holds back
            assert len(chunks) >= 6 and chunks[0].numel() == first * 1920 - 555
            joined = torch.cat(chunks)
            assert joined.shape == whole.shape
            assert (joined - whole).abs().max().item() < bound
        with pytest.raises(ValueError, match="lookback_frames must be an int >= 1"):
            Code2Wav(str(qwen3_tiny), lookback_frames=0)
    finally:
        asyncio.run(fast.close())


def test_a_reply_with_nothing_to_say_and_a_first_end_code_give_text_and_no_audio(qwen3_tiny, stages):
    from omni_transformers.kit.engines import EngineRegistry
    from omni_transformers.qwen3_omni.talker import Talker
    from omni_transformers.qwen3_omni.thinker import Thinker

    processor, (thinker, talker, code2wav) = stages
    payload = processor({"text": "What is up?", "speaker": SPEAKER}, None)
    normal = asyncio.run(speak((thinker, talker, code2wav), payload))

    # The thinker's first token is its end: no reply token to speak.
    first = normal[0]["token_ids"][0]
    silent = Thinker(str(qwen3_tiny), max_new_tokens=THINKER_MAX, eos_token_id=first, engines=EngineRegistry())
    try:
        thought, talked, voiced = asyncio.run(speak((silent, talker, code2wav), payload))
    finally:
        asyncio.run(silent.close())
    assert thought["token_ids"] == [first] and talked["codes"] == []
    assert voiced["codes"] == [] and voiced["audio"].numel() == 0

    # The talker's first code is its end code.
    code0 = normal[1]["codes"][0]
    mute = Talker(str(qwen3_tiny), do_sample=False, max_new_tokens=TALKER_MAX, eos_token_id=[code0])
    try:
        thought, talked, voiced = asyncio.run(speak((thinker, mute, code2wav), payload))
    finally:
        asyncio.run(mute.close())
    assert thought["token_ids"] == normal[0]["token_ids"] and thought["text"]
    assert talked["codes"] == [] and voiced["audio"].numel() == 0


def test_an_unknown_speaker_is_refused_naming_the_voices(stages):
    from omni_core.errors import InvalidInput

    processor, (thinker, talker, code2wav) = stages
    payload = processor({"text": "hi", "speaker": "nobody"}, None)
    with pytest.raises(InvalidInput, match="aiden, chelsie, ethan") as refused:
        asyncio.run(speak((thinker, talker, code2wav), payload))
    assert refused.value.field == "speaker"


def test_requests_aborted_mid_speech_free_their_rows_and_the_others_are_unchanged(stages):
    processor, chain = stages
    thinker, talker, _ = chain
    payloads = [processor({"text": text, "speaker": SPEAKER}, None) for text in PROMPTS[:6]]

    async def go():
        alone = await speak(chain, payloads[0])
        doomed = [asyncio.ensure_future(speak(chain, p)) for p in payloads[1:]]
        # Abort once every doomed request's talker row is live and frames are being made.
        deadline = asyncio.get_running_loop().time() + 300
        while talker.loop.live < len(doomed) or not talker.loop.memory_in_use:
            assert asyncio.get_running_loop().time() < deadline, "the talker rows never went live"
            await asyncio.sleep(0.01)
        kept = asyncio.ensure_future(speak(chain, payloads[0]))
        for task in doomed:
            task.cancel()
        await asyncio.gather(*doomed, return_exceptions=True)
        again = await kept
        deadline = asyncio.get_running_loop().time() + 60
        while talker.loop.live or talker.loop.memory_in_use or thinker.engine.loop.live:
            assert asyncio.get_running_loop().time() < deadline, (talker.loop, thinker.engine.loop)
            await asyncio.sleep(0.01)
        return alone, again

    alone, again = asyncio.run(go())
    assert again[0]["token_ids"] == alone[0]["token_ids"] and again[1]["codes"] == alone[1]["codes"]
    assert again[2]["audio"].shape == alone[2]["audio"].shape


def hello_part() -> dict:
    """An audio part: tests/data/hello.wav."""
    import soundfile

    speech, rate = soundfile.read(str(Path(__file__).parent / "data" / "hello.wav"), dtype="float32")
    return {"type": "audio", "audio": torch.from_numpy(speech), "sample_rate": rate}


def noise_part() -> dict:
    """An image part: 64x96 pixels of seeded noise (a grid of 4x6 patches, 6 image tokens)."""
    import numpy as np

    return {"type": "image", "image": torch.from_numpy((np.random.RandomState(3).rand(64, 96, 3) * 255).astype(np.uint8))}


def ask(qwen3_tiny, chain, payload: dict) -> tuple[dict, tuple[dict, dict, dict]]:
    """The processor's ``payload`` through the encoder stages of the media it has (audio, images), then thinker ->
    talker -> code2wav: what the encoders give and the three results."""
    from omni_transformers.kit.wiring import audio_inputs, image_inputs, text_inputs
    from omni_transformers.qwen3_omni.encoders import AudioEncoder, VisionEncoder

    encoded = {}
    for present, stage, inputs in (("audio_seqlens", AudioEncoder, audio_inputs),
                                   ("image_grid_thw", VisionEncoder, image_inputs)):
        if payload.get(present):
            encoder = stage(str(qwen3_tiny))
            try:
                encoded.update(asyncio.run(encoder(inputs(payload), None)))
            finally:
                asyncio.run(encoder.close())
    return encoded, asyncio.run(speak(chain, {**text_inputs(payload), **encoded}))


def generate_media(payload: dict) -> dict:
    """The processor's audio (one) and image inputs as transformers' ``generate`` takes them."""
    media = {}
    if payload.get("audio_seqlens"):
        [features], [length] = payload["audio_features"], payload["audio_seqlens"]
        media.update(input_features=features[None], feature_attention_mask=torch.ones(1, length, dtype=torch.long))
    if payload.get("image_grid_thw"):
        media.update(pixel_values=payload["pixel_values"], image_grid_thw=torch.tensor(payload["image_grid_thw"]))
    return media


def test_an_audio_prompt_gives_the_tokens_and_frames_of_generate(qwen3_tiny, stages):
    """Audio in the prompt: the processor's features through the audio encoder stage, spliced into the thinker's
    prompt; the talker reads the audio positions through hidden_projection at M-RoPE positions of its own."""
    processor, chain = stages
    messages = [{"role": "user", "content": [hello_part(), {"type": "text", "text": "what is it?"}]}]
    payload = processor({"messages": messages, "speaker": SPEAKER}, None)
    assert len(payload["audio_features"]) == 1 and payload["input_ids"].count(tiny.SPECIAL["<|audio_pad|>"]) > 10
    _, (thought, talked, _) = ask(qwen3_tiny, chain, payload)

    [(tokens, want)] = reference(qwen3_tiny, [payload["input_ids"]], **generate_media(payload))
    assert_as_generate(thought, talked, tokens, want)


def test_an_image_prompt_gives_the_tokens_and_frames_of_generate(qwen3_tiny, stages):
    """Images in the prompt: the vision encoder stage's embeddings spliced in and its deepstack features added to
    the thinker's first layers at the image positions; the talker's M-RoPE positions over the image grid."""
    from omni_transformers.kit.wiring import text_inputs

    processor, chain = stages
    messages = [{"role": "user", "content": [noise_part(), {"type": "text", "text": "what is it?"}]}]
    payload = processor({"messages": messages, "speaker": SPEAKER}, None)
    assert payload["image_grid_thw"] == [[1, 4, 6]]
    encoded, (thought, talked, _) = ask(qwen3_tiny, chain, payload)
    assert encoded["image_embeds"].shape == (6, 32) and encoded["image_deepstack"].shape == (2, 6, 32)

    [(tokens, want)] = reference(qwen3_tiny, [payload["input_ids"]], **generate_media(payload))
    assert_as_generate(thought, talked, tokens, want)
    # the deepstack features matter: without them the reply differs
    plain = {k: v for k, v in encoded.items() if k != "image_deepstack"}
    assert asyncio.run(speak(chain, {**text_inputs(payload), **plain}))[0]["token_ids"] != thought["token_ids"]


def test_an_audio_and_image_prompt_gives_the_tokens_and_frames_of_generate(qwen3_tiny, stages):
    """Audio, an image and text in one request: both encoder stages' outputs spliced into one prompt (the audio's
    embeddings, the image's embeddings and deepstack features), the M-RoPE positions of the thinker and the talker
    over both; its tokens and frames equal ``generate(return_audio=True)``'s with the reference model's talker
    config given the thinker's audio config (see ``reference``)."""
    processor, chain = stages
    # The image first: the reply then runs to THINKER_MAX tokens, each pick's top-2 gap >= 4e-3 (the logits' std
    # ~0.11); with the audio first it ends after 2 tokens.
    messages = [{"role": "user", "content": [noise_part(), hello_part(), {"type": "text", "text": "what is it?"}]}]
    payload = processor({"messages": messages, "speaker": SPEAKER}, None)
    assert len(payload["audio_features"]) == 1 and payload["image_grid_thw"] == [[1, 4, 6]]
    assert payload["input_ids"].count(tiny.SPECIAL["<|audio_pad|>"]) > 10
    encoded, (thought, talked, _) = ask(qwen3_tiny, chain, payload)
    assert {"audio_embeds", "image_embeds", "image_deepstack"} <= encoded.keys()

    [(tokens, want)] = reference(qwen3_tiny, [payload["input_ids"]], **generate_media(payload))
    assert len(tokens) == THINKER_MAX
    assert_as_generate(thought, talked, tokens, want)
