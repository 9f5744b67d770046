"""Omni inputs and streamed speech, stage by stage on the tiny checkpoint: the processor against the
library's own feature extractor / image processor / tokenizer, bad media of every kind, the
encoders (batched equal to one at a time and to the thinker's own towers), prefill_inputs against
the thinker's forward on the same inputs, and streamed token2wav against the unchunked synthesis."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest
import soundfile
import torch

from omni_transformers.kit.media import MediaError
from omni_transformers.kit.sampling import make_generator
from omni_transformers.qwen2_5_omni.encoders import AudioEncoder, VisionEncoder
from omni_transformers.qwen2_5_omni.inputs import prefill_inputs
from omni_transformers.qwen2_5_omni.parts import load_part, speaker_params
from omni_transformers.qwen2_5_omni.processor import Processor
from omni_transformers.qwen2_5_omni.token2wav import (
    STREAM_MAX_RELATIVE_ERROR,
    STREAM_MIN_CORRELATION,
    ChunkedSynthesis,
    Token2Wav,
    stream_error,
)

pytestmark = pytest.mark.timeout(300)


def tone(seconds: float, rate: int = 16000, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def picture(h: int = 90, w: int = 130, seed: int = 1) -> np.ndarray:
    return (np.random.RandomState(seed).rand(h, w, 3) * 255).astype(np.uint8)


@pytest.fixture(scope="module")
def processor(tiny_model):
    return Processor(str(tiny_model))


@pytest.fixture(scope="module")
def thinker(tiny_model):
    return load_part(tiny_model, "thinker")


def test_chat_template_renders_audio_and_image_parts_like_the_real_one(processor):
    shown, audios, images = processor.media_of(processor.messages_of(
        {"text": "what is this?", "audio": torch.from_numpy(tone(0.5)), "sample_rate": 16000, "image": picture()}))
    text = processor.render(shown)
    assert "<|audio_bos|><|AUDIO|><|audio_eos|><|vision_bos|><|IMAGE|><|vision_eos|>what is this?" in text
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert len(audios) == 1 and len(images) == 1


def test_processor_prepares_inputs_as_the_library_does(processor, tiny_model, tmp_path):
    """Audio from a 24 kHz stereo file (decoded, averaged, resampled) and an image tensor: the
    features equal WhisperFeatureExtractor's and Qwen2VLImageProcessorPil's on the same decoded
    media, and the prompt has one placeholder per feature."""
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    stereo = np.stack([tone(1.2, 24000), tone(1.2, 24000, 300)], axis=1)
    path = tmp_path / "a.wav"
    soundfile.write(path, stereo, 24000, subtype="FLOAT")
    image = picture()
    out = processor({"messages": [{"role": "user", "content": [
        {"type": "audio", "audio": str(path)}, {"type": "image", "image": torch.from_numpy(image)},
        {"type": "text", "text": "hi"}]}]}, None)

    import soxr
    from PIL import Image

    mono = soxr.resample(stereo.mean(axis=1).astype(np.float32), 24000, 16000).astype(np.float32)
    fe = WhisperFeatureExtractor.from_pretrained(tiny_model)
    want = fe([mono], sampling_rate=16000, padding="max_length", return_attention_mask=True, return_tensors="pt")
    frames = int(want["attention_mask"].sum())
    assert out["audio_seqlens"] == [frames]
    torch.testing.assert_close(out["audio_features"][0], want["input_features"][0, :, :frames])
    ip = Qwen2VLImageProcessorPil.from_pretrained(tiny_model)
    pix = ip([Image.fromarray(image, "RGB")], return_tensors="pt")
    torch.testing.assert_close(out["pixel_values"], pix["pixel_values"])
    assert out["image_grid_thw"] == pix["image_grid_thw"].tolist()
    ids = out["input_ids"]
    assert ids.count(processor.tokenizer.convert_tokens_to_ids("<|AUDIO|>")) == ((frames - 1) // 2 + 1 - 2) // 2 + 1
    t, h, w = out["image_grid_thw"][0]
    assert ids.count(processor.tokenizer.convert_tokens_to_ids("<|IMAGE|>")) == t * h * w // 4


def wav_bytes(samples: np.ndarray, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format="WAV")
    return buf.getvalue()


@pytest.mark.parametrize("inputs, where, words", [
    ({"audio": "/nonexistent/a.wav"}, "audio", "cannot read audio"),
    ({"audio": b"not audio at all"}, "audio", "cannot read audio"),
    ({"audio": torch.zeros(2, 100), "sample_rate": 16000}, "audio", "1-D"),
    ({"audio": torch.zeros(100, dtype=torch.int16), "sample_rate": 16000}, "audio", "float"),
    ({"audio": torch.zeros(100)}, "audio", "sample_rate"),
    ({"audio": torch.zeros(0), "sample_rate": 16000}, "audio", "empty"),
    ({"audio": torch.full((100,), float("nan")), "sample_rate": 16000}, "audio", "NaN"),
    ({"audio": torch.zeros(16000 * 11), "sample_rate": 16000}, "audio", "at most 10 s"),
    ({"image": "/nonexistent/a.png"}, "image", "cannot read an image"),
    ({"image": b"\x89PNG broken"}, "image", "cannot read an image"),
    ({"image": torch.zeros(8, 8, 3)}, "image", "uint8"),
    ({"image": torch.zeros(8, 8, dtype=torch.uint8)}, "image", "H x W x 3"),
    ({"image": torch.zeros(1, 300, 3, dtype=torch.uint8)}, "image", "ratio"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "audio", "audio": 3}]}]},
     "messages[0].content[1] (audio)", "file path"),  # the caller's index: the system prompt is not counted
    ({"messages": [{"role": "user", "content": [{"type": "video", "video": "v.mp4"}]}]},
     "messages[0].content[0]", "videos are not supported"),
])
def test_bad_media_is_a_clear_error_naming_the_part(processor, inputs, where, words):
    with pytest.raises(ValueError) as info:
        processor(inputs, None)
    assert str(info.value).startswith(where) and words in str(info.value), str(info.value)
    if "video" not in words:
        assert isinstance(info.value, MediaError)


def test_encoded_bytes_and_resampling_are_accepted(processor):
    out = processor({"audio": wav_bytes(tone(0.5, 8000), 8000), "text": "x"}, None)
    assert out["audio_seqlens"] == [50]  # 0.5 s at 16 kHz, hop 160


def test_encoders_batch_across_requests_and_equal_the_thinkers_towers(processor, thinker, tiny_model):
    """Three requests at once through each encoder (one micro-batch) equal each alone, and equal
    the thinker's own get_audio_features / get_image_features."""
    reqs = [processor({"text": "a", "audio": torch.from_numpy(tone(s)), "sample_rate": 16000,
                       "image": picture(40 + 30 * k, 60 + 20 * k, seed=k)}, None)
            for k, s in enumerate((0.4, 1.3, 2.2))]
    audio, vision = AudioEncoder(str(tiny_model), max_wait=0.05), VisionEncoder(str(tiny_model), max_wait=0.05)

    async def run(reqs):
        a = [audio({"audio_features": r["audio_features"], "audio_seqlens": r["audio_seqlens"]}, None) for r in reqs]
        v = [vision({"pixel_values": r["pixel_values"], "image_grid_thw": r["image_grid_thw"]}, None) for r in reqs]
        return await asyncio.gather(*a, *v)

    async def main():
        together = await run(reqs)
        largest = (audio.batcher.stats.largest, vision.batcher.stats.largest)
        alone = [x for r in reqs for x in await run([r])]
        return together, largest, alone[0::2] + alone[1::2]

    together, largest, alone = asyncio.run(main())
    assert largest == (3, 3)
    for got, want in zip(together, alone, strict=True):
        key = "audio_embeds" if "audio_embeds" in got else "image_embeds"
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)
    with torch.inference_mode():
        for r, got in zip(reqs, together[:3], strict=True):
            n = r["audio_seqlens"][0]
            ref = thinker.get_audio_features(r["audio_features"][0][None], torch.ones(1, n, dtype=torch.long),
                                             return_dict=True).last_hidden_state
            torch.testing.assert_close(got["audio_embeds"], ref, rtol=1e-5, atol=1e-6)
        for r, got in zip(reqs, together[3:], strict=True):
            ref = torch.cat(thinker.get_image_features(r["pixel_values"], torch.tensor(r["image_grid_thw"]),
                                                       return_dict=True).pooler_output)
            torch.testing.assert_close(got["image_embeds"], ref, rtol=1e-5, atol=1e-6)


def test_prefill_inputs_equal_the_thinkers_forward_on_the_same_inputs(processor, thinker, tiny_model):
    """Two audios, one image and text: logits from prefill_inputs' embeddings and M-RoPE positions
    equal the thinker's forward given input_features and pixel_values (positions by get_rope_index)."""
    out = processor({"messages": [{"role": "user", "content": [
        {"type": "audio", "audio": torch.from_numpy(tone(2.0)), "sample_rate": 16000},
        {"type": "image", "image": picture()}, {"type": "text", "text": "hi"},
        {"type": "audio", "audio": torch.from_numpy(tone(0.6, freq=200)), "sample_rate": 16000}]}]}, None)
    audio, vision = AudioEncoder(str(tiny_model)), VisionEncoder(str(tiny_model))

    async def encode():
        return (await audio({k: out[k] for k in ("audio_features", "audio_seqlens")}, None),
                await vision({k: out[k] for k in ("pixel_values", "image_grid_thw")}, None))

    a, v = asyncio.run(encode())
    pre = prefill_inputs(thinker, {**out, **a, **v}, "cpu")
    assert pre.rope_delta < 0 and pre.media_mask.sum() == a["audio_embeds"].shape[0] + v["image_embeds"].shape[0]
    fe = processor.mm.feature_extractor
    feats = torch.zeros(2, fe.feature_size, fe.nb_max_frames)
    mask = torch.zeros(2, fe.nb_max_frames, dtype=torch.long)
    for i, (f, n) in enumerate(zip(out["audio_features"], out["audio_seqlens"], strict=True)):
        feats[i, :, :n], mask[i, :n] = f, 1
    ids = torch.tensor([out["input_ids"]])
    with torch.inference_mode():
        mine = thinker(inputs_embeds=pre.inputs_embeds[None], position_ids=pre.position_ids[:, None]).logits
        ref = thinker(input_ids=ids, attention_mask=torch.ones_like(ids), input_features=feats,
                      feature_attention_mask=mask, pixel_values=out["pixel_values"],
                      image_grid_thw=torch.tensor(out["image_grid_thw"])).logits
    torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="audio features and audio tokens do not match"):
        prefill_inputs(thinker, {**out, **v, "audio_embeds": a["audio_embeds"][1:]}, "cpu")
    with pytest.raises(ValueError, match="no image_embeds"):
        prefill_inputs(thinker, {**out, **a}, "cpu")


# -- streamed token2wav -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def token2wav(tiny_model):
    return Token2Wav(str(tiny_model))


def stream_in(stage, codes, arrivals, seed=3):
    """Chunks of ChunkedSynthesis when the codes arrive in the given cumulative counts."""
    syn = ChunkedSynthesis(stage, speaker_params(stage.speakers, "Chelsie"), make_generator(seed))
    parts = []
    for k in arrivals:
        while syn.ready(k, k == len(codes)):
            parts.append(syn.next_chunk(codes[:k], k == len(codes)))
    return parts


@pytest.mark.parametrize("n", [1, 7, 64, 150])
def test_streamed_chunks_are_within_the_bound_of_the_unchunked_synthesis(token2wav, n):
    codes = torch.randint(0, 8000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    unchunked = token2wav.synthesize(codes, speaker_params(token2wav.speakers, "Chelsie"), make_generator(3))
    one_by_one = stream_in(token2wav, codes, range(1, n + 1))
    by_sixteen = stream_in(token2wav, codes, [*range(16, n, 16), n])
    at_once = stream_in(token2wav, codes, [n])
    streamed = torch.cat(one_by_one)
    rel, corr = stream_error(streamed, unchunked)
    assert rel <= STREAM_MAX_RELATIVE_ERROR and corr >= STREAM_MIN_CORRELATION, (rel, corr)
    # the chunks depend on the codes alone, not on when they arrived
    for other in (by_sixteen, at_once):
        assert [len(c) for c in other] == [len(c) for c in one_by_one]
        assert torch.equal(torch.cat(other), streamed)
    if n >= 64:
        assert len(one_by_one) >= 3
        sizes = [len(c) // token2wav.hop // token2wav.repeats for c in one_by_one]
        assert token2wav.chunk_schedule()[:4] == [4, 8, 16, 32]
        assert sizes[:-1] == token2wav.chunk_schedule()[:len(sizes) - 1] and sum(sizes) == n


class FakeCtx:
    """A talker stream for token2wav: codes in chunks of 4; the final chunk is held back until an
    audio chunk was emitted (or the stream gives up after its deadline and says so)."""

    def __init__(self, codes):
        self.codes = codes
        self.events: list[str] = []
        self.audio_seen = asyncio.Event()
        self.emitted: list[dict] = []

    async def stream_from(self, source):
        yield {"text": "hi", "token_ids": [104, 105]}
        chunks = [self.codes[i:i + 4] for i in range(0, len(self.codes), 4)]
        for chunk in chunks[:-1]:
            yield {"codes": chunk}
        try:
            await asyncio.wait_for(self.audio_seen.wait(), 60)
        except TimeoutError:
            self.events.append("no audio before the last code")
        self.events.append("last codes")
        yield {"codes": chunks[-1], "final": True}

    async def emit(self, chunk):
        self.emitted.append(chunk)
        if "audio" in chunk:
            self.events.append("audio")
            self.audio_seen.set()


def test_token2wav_emits_audio_before_the_last_code_arrives(token2wav):
    codes = torch.randint(0, 8000, (64,), generator=torch.Generator().manual_seed(5)).tolist()
    ctx = FakeCtx(codes)
    result = asyncio.run(token2wav({"seed": 3, "speaker": "Chelsie", "wav_path": None}, ctx))
    assert "no audio before the last code" not in ctx.events
    assert ctx.events.index("audio") < ctx.events.index("last codes")
    audio = [c["audio"] for c in ctx.emitted if "audio" in c]
    assert len(audio) >= 3 and all(c["sample_rate"] == 24000 for c in ctx.emitted if "audio" in c)
    assert result["codes"] == codes and torch.equal(torch.cat(audio), result["audio"])
    assert ctx.emitted[0] == {"text": "hi", "token_ids": [104, 105]}
    unchunked = token2wav.synthesize(codes, speaker_params(token2wav.speakers, "Chelsie"), make_generator(3))
    rel, corr = stream_error(result["audio"], unchunked)
    assert rel <= STREAM_MAX_RELATIVE_ERROR and corr >= STREAM_MIN_CORRELATION


def test_the_wav_file_holds_the_audio_so_far_after_every_chunk(tmp_path):
    import wave

    from omni_transformers.qwen2_5_omni.token2wav import WavWriter

    target = tmp_path / "out" / "speech.wav"
    writer = WavWriter(str(target), 24000)
    total = []
    for n in (480, 960, 7):
        chunk = torch.linspace(-0.5, 0.5, n)
        writer.write(chunk)
        total.append(chunk)
        with wave.open(str(target)) as w:  # readable while the request runs
            assert w.getframerate() == 24000 and w.getnframes() == sum(len(c) for c in total)
    assert writer.close() == str(target)
    with wave.open(str(target)) as w:
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16)
    assert np.array_equal(pcm, (torch.cat(total) * 32767).round().to(torch.int16).numpy())
    assert sorted(p.name for p in target.parent.iterdir()) == ["speech.wav"]  # no temporary file left
    failed = WavWriter(str(tmp_path / "never.wav"), 24000)
    failed.abort()
    assert not (tmp_path / "never.wav").exists()
