"""The csm family: its tiny checkpoint (the depth decoder's settings kept), and ``omni serve`` on that checkpoint
folder answering OpenAI's ``POST /v1/audio/speech`` through the official SDK: greedy codes equal to transformers'
``model.generate``, audio equal to Mimi's whole decode of the codes within one PCM16 step (streamed in chunks),
wav / pcm / sse (each within one PCM16 step of the pipeline's own audio), 4 concurrent greedy requests each
equal to its lone result (codes), 8 concurrent SDK requests each within one PCM16 step of their lone audio, requests with different settings side
by side never changing each other, bad requests refused with OpenAI's error shape."""

from __future__ import annotations

import base64
import io
import json
import wave
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from speech_serving import sdk, serving

pytestmark = pytest.mark.timeout(900)

GREEDY = {"do_sample": False, "depth_decoder_do_sample": False}
PCM16_STEP = 1 / 32768


@pytest.fixture(scope="module")
def csm_tiny(tmp_path_factory):
    from omni_transformers.csm.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("csm") / "ckpt")


@pytest.fixture(scope="module")
def model(csm_tiny):
    from transformers import CsmForConditionalGeneration

    return CsmForConditionalGeneration.from_pretrained(csm_tiny).eval()


@pytest.fixture(scope="module")
def reference(csm_tiny, model):
    """``reference(text, voice, max_new_tokens, **generate_kwargs)`` → frames of ``model.generate`` in this process
    (the end frame cut, as generate's own audio does) and Mimi's whole decode of them."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(csm_tiny)

    def run(text: str, voice: str = "0", max_new_tokens: int = 8, seed: int = 0, **kwargs) -> tuple[list, torch.Tensor]:
        conversation = [{"role": voice, "content": [{"type": "text", "text": text}]}]
        ids = processor.apply_chat_template(conversation, tokenize=True, return_dict=True, return_tensors="pt")
        torch.manual_seed(seed)
        with torch.inference_mode():
            frames = model.generate(input_ids=ids["input_ids"], max_new_tokens=max_new_tokens, **kwargs)[0]
            ends = (frames[:, :-1] == model.config.codebook_eos_token_id).all(-1).nonzero()
            frames = frames[:int(ends[0])] if ends.numel() else frames
            audio = model.codec_model.decode(frames.T[None]).audio_values.reshape(-1)
        return frames.tolist(), audio

    return run


@pytest.fixture(scope="module")
def server(csm_tiny, tmp_path_factory):
    with serving(str(csm_tiny), cwd=tmp_path_factory.mktemp("serve-csm")) as srv:
        yield srv


@pytest.fixture
def client(server):
    with sdk(server) as c:
        yield c


def native(server, **inputs) -> dict:
    from omni_core.encoding import from_jsonable

    r = httpx.post(f"{server.url}/v1/pipelines/csm/requests", json={"input": inputs}, timeout=600)
    assert r.status_code == 200, r.text
    return from_jsonable(r.json()["result"], "result")


def pcm_of(audio: torch.Tensor) -> torch.Tensor:
    return (audio.clamp(-1, 1) * 32767).round().to(torch.int16)


def assert_pcm_close(got: bytes, want: bytes) -> None:
    """The same PCM16 audio within one step: Mimi decodes the windows of concurrent requests together, and a
    batched decode differs from a lone one in the last float bits, so a sample may round the other way."""
    assert len(got) == len(want) and got
    a = torch.frombuffer(bytearray(got), dtype=torch.int16).int()
    b = torch.frombuffer(bytearray(want), dtype=torch.int16).int()
    assert int((a - b).abs().max()) <= 1


def test_the_tiny_checkpoint_keeps_the_depth_decoders_settings(csm_tiny, model):
    names = {p.name for p in csm_tiny.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "chat_template.jinja"} <= names
    gen = json.loads((csm_tiny / "generation_config.json").read_text())
    assert gen["_from_model_config"] is False and gen["depth_decoder_do_sample"] is True
    assert model.depth_decoder.generation_config.do_sample is True
    assert model.codec_model.config.sampling_rate == 24000
    assert model.codec_model.config.sampling_rate / model.codec_model.config.frame_rate == 1920


def test_the_transformers_parts_the_decode_loop_drives_are_there(model):
    """csm/loop.py runs CSM's parts itself: a transformers release that renames or reshapes them fails here,
    naming what moved."""
    import inspect

    for part in ("backbone_model", "depth_decoder", "embed_text_tokens", "lm_head", "codec_model"):
        assert hasattr(model, part), f"CsmForConditionalGeneration has no {part!r} any more: see csm/loop.py"
    assert hasattr(model.backbone_model, "embed_tokens"), "CsmBackboneModel.embed_tokens moved: see csm/loop.py"
    backbone = set(inspect.signature(type(model.backbone_model).forward).parameters)
    assert {"inputs_embeds", "position_ids", "cache", "attention_mask"} <= backbone, backbone
    depth = set(inspect.signature(type(model.depth_decoder).forward).parameters)
    assert "backbone_last_hidden_state" in depth, depth
    assert model.config._attn_implementation in ("sdpa", "omni_rows")


def test_the_server_is_the_checkpoints_family_pipeline(client):
    assert [m.id for m in client.models.list().data] == ["csm"]


def test_greedy_codes_equal_generate_and_the_audio_mimis_whole_decode(server, reference):
    frames, audio = reference("hello there", "1", 12, **GREEDY)
    result = native(server, text="hello there", voice="1", max_new_tokens=12, **GREEDY)
    assert result["codes"] == frames and len(frames) == 12
    assert result["sample_rate"] == 24000 and result["audio"].numel() == 12 * 1920
    error = float((result["audio"] - audio).abs().max())
    print(f"streamed (chunks 2, 4, 6 frames, 25 frames of left context) vs whole decode: max |error| {error:.3g}")
    assert error <= PCM16_STEP
    assert result["prompt_tokens"] > 0 and result["completion_tokens"] == 12


def test_four_concurrent_greedy_requests_each_equal_their_lone_result(server, reference):
    texts = ["hello there", "a much longer sentence to speak", "hi", "what is this?"]
    alone = [native(server, text=t, max_new_tokens=8, **GREEDY)["codes"] for t in texts]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda t: native(server, text=t, max_new_tokens=8, **GREEDY)["codes"], texts))
    assert together == alone == [reference(t, "0", 8, **GREEDY)[0] for t in texts]
    assert len({json.dumps(c) for c in alone}) == 4


def test_requests_with_different_settings_never_change_each_other(server, reference):
    """A greedy request and a sampled one (seeded) run in one batch: the greedy codes stay generate's, the sampled
    ones what the same request draws alone; nothing sticks to the model after them."""
    greedy = {"text": "hello there", "max_new_tokens": 8, **GREEDY}
    sampled = {"text": "hello there", "max_new_tokens": 8, "do_sample": False, "depth_decoder_do_sample": True,
               "depth_decoder_temperature": 1.5, "seed": 7}
    want = native(server, **greedy)["codes"]
    assert want == reference("hello there", "0", 8, **GREEDY)[0]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda inputs: native(server, **inputs)["codes"], [sampled, greedy, sampled, greedy]))
    assert got[1] == got[3] == want  # the sampled depth decoder never leaked into the greedy requests
    assert got[0] == got[2] != want  # the same seed, the same draw
    assert native(server, **sampled)["codes"] == got[0]  # and alone the same as beside the others
    assert native(server, **greedy)["codes"] == want  # nor after them


def test_the_sdk_speaks_wav_pcm_and_sse_equal_to_the_pipeline(client, server):
    result = native(server, text="hello", voice="0")  # the checkpoint's sampling, the default seed
    want = pcm_of(result["audio"]).numpy().tobytes()
    assert result["completion_tokens"] == len(result["codes"]) > 0
    pcm = client.audio.speech.create(model="csm", voice="0", input="hello", response_format="pcm")
    assert_pcm_close(pcm.content, want)
    wav = client.audio.speech.create(model="csm", voice="0", input="hello", response_format="wav")
    body = wav.content
    assert body[:4] == b"RIFF"
    assert_pcm_close(body[44:], want)
    with wave.open(io.BytesIO(body[:40] + len(want).to_bytes(4, "little") + want)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
    with client.audio.speech.with_streaming_response.create(model="csm", voice="0", input="hello",
                                                            response_format="pcm") as r:
        pieces = [p for p in r.iter_bytes() if p]
    assert len(pieces) > 1  # the audio came in chunks as it was decoded
    assert_pcm_close(b"".join(pieces), want)
    r = httpx.post(f"{server.url}/v1/audio/speech", json={"model": "csm", "voice": "0", "input": "hello",
                                                          "stream_format": "sse", "response_format": "pcm"},
                   timeout=600)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) > 1 and events[-1]["type"] == "speech.audio.done"
    assert_pcm_close(b"".join(base64.b64decode(e["audio"]) for e in deltas), want)
    assert events[-1]["usage"]["output_tokens"] == len(result["codes"])


def test_eight_concurrent_sdk_requests_each_equal_their_lone_result(client):
    texts = [f"sentence number {i}" for i in range(8)]

    def speak(text: str) -> bytes:
        return client.audio.speech.create(model="csm", voice="1", input=text, response_format="pcm").content

    alone = [speak(t) for t in texts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(speak, texts))
    # (the tiny model's sampling, seeded alike, draws alike for these texts: the check is that no answer is cut,
    # reordered or mixed with a neighbour's chunks while eight run at once)
    for got, want in zip(together, alone, strict=True):
        assert_pcm_close(got, want)


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"voice": "7", "input": "hi"}, "voice", "this model's: 0, 1"),
    ({"voice": "0", "input": ""}, "input", "required"),
    ({"voice": "0", "input": "hi", "speed": 2.0}, "speed", "not supported"),
    ({"voice": "0", "input": "hi", "instructions": "whisper"}, "instructions", "not supported"),
    ({"voice": "0", "input": "hi", "response_format": "aac"}, "response_format", "aac"),
    ({"voice": "0", "text": "hi"}, "text", "unknown field"),
])
def test_bad_speech_requests_are_refused_with_the_openai_error_shape(server, body, param, says):
    r = httpx.post(f"{server.url}/v1/audio/speech", json={"model": "csm", **body}, timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_a_bad_voice_or_setting_in_the_pipeline_is_refused_naming_it(server):
    for inputs, field in (({"text": "hi", "voice": "9"}, "voice"), ({"text": "hi", "top_p": 3}, "top_p")):
        r = httpx.post(f"{server.url}/v1/pipelines/csm/requests", json={"input": inputs}, timeout=120)
        assert r.status_code == 400 and field in r.text, r.text
