"""The families on one GPU, in bfloat16, served end to end by their GPU-placed pipelines (``gpu/check`` runs
these; without CUDA they skip, and under ``OMNI_REQUIRE_CUDA=1`` they fail):

- Qwen3-Omni's tiny checkpoint through ``qwen3_omni.gpu`` (thinker and talker in bfloat16, code2wav in float32):
  a spoken reply whose text tokens equal transformers' ``model.thinker.generate`` on the same GPU in bfloat16
  (greedy) until a step where generate's own top-2 margin was too thin for bfloat16 to decide the pick alike
  (``agreed``: parting at a wider margin fails), its audio streamed, non-empty and finite; 8 requests at once
  each give generate's tokens the same way (so the tokens they get alone).
- A realistic-size random Qwen3-Omni (thinker of hidden 2048, 128 experts, 8 per token, 4 layers and the real
  152,064-token vocabulary; talker, code predictor and code2wav of the real widths, the talker 2 layers), written
  on the GPU at test time by the family's writer with a config override: one spoken request end to end, its
  tokens as generate's (as above); first text, first audio and tokens/s are recorded (junit properties of the
  suite, printed), not asserted.
- Qwen2.5-Omni's tiny checkpoint through ``qwen2_5_omni.gpu``: the same as the first, tokens against its
  ``model.thinker.generate``.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from importlib import resources
from pathlib import Path

import pytest
import torch
import yaml
from omni_core.testing.cuda import require_cuda
from omni_core.testing.leaks import no_leaks  # noqa: F401 - a fixture

pytestmark = [pytest.mark.timeout(200), pytest.mark.cuda(reason="the families' GPU pipelines in bfloat16")]

DEVICE = "cuda:0"
DTYPE = "bfloat16"
# The prompts of the 8 concurrent requests (the first is also the one compared alone in full detail).
PROMPTS = ["Hello there, say something.", "What is up?", "Tell me a story", "Describe Paris.",
           "Why is the sky blue?", "Count to five", "A haiku, please", "Name three colours."]
THINKER_MAX, TALKER_MAX = 24, 48
# A greedy pick is taken as decided alike by two bfloat16 computations when generate's top-2 gap is at least
# this share of the logits' scale (max |logit| at that step). bfloat16 keeps 8 bits of mantissa; on the tiny
# checkpoint its logits differ from float32's by up to 1.7% of that scale (median 0.6%; CPU), and two bfloat16
# paths (other kernels, batch shapes, summation order) by up to about twice that.
SAFE_MARGIN = 0.05
# The 8 replies must share at least this many tokens with generate's in all, else the test compared little (on a
# CPU in bfloat16 they share all of theirs, 99; were each to part at its first thin pick, 16).
MIN_AGREED = 8
STAGE_DTYPES = {"thinker": DTYPE, "text": DTYPE, "talker": DTYPE, "audio_encoder": DTYPE, "vision_encoder": DTYPE}


@pytest.fixture
def record(request, record_testsuite_property):
    """``record(key, value)``: a number of this test in the junit file (a property of the suite, named
    ``<test>.<key>``: gpu/check's junit is xunit2, which has no per-test properties) and in its output."""

    def put(key: str, value) -> None:
        value = round(value, 4) if isinstance(value, float) else value
        record_testsuite_property(f"{request.node.name}.{key}", value)
        print(f"{request.node.name}: {key} = {value}")

    return put


@pytest.fixture
def room(tmp_path):
    """Where a large checkpoint is written: /dev/shm when it has room (memory: written and read back at once),
    else the test's temporary folder; removed after the test."""
    import shutil
    import tempfile

    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > (24 << 30):
        with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="omni-families-gpu-") as folder:
            yield Path(folder)
    else:
        yield tmp_path


@pytest.fixture(scope="session", autouse=True)
def _cuda():
    """The ``cuda`` marker's check (this folder's conftest does not load its hooks): skip without CUDA, fail
    under ``OMNI_REQUIRE_CUDA``, before any checkpoint is written."""
    require_cuda(1, "the families' GPU pipelines in bfloat16")


# -- helpers -------------------------------------------------------------------------------------------


def gpu_pipeline(file: str, model, **extra_args) -> dict:
    """The shipped GPU variant ``file`` (placement spread: every stage on GPU 0 of one), on ``model``, its LMs
    and encoders in bfloat16 (the vocoders keep their float32)."""
    cfg = yaml.safe_load(resources.files("omni_transformers").joinpath("pipelines", file).read_text())
    cfg.pop("serve", None)
    for stage in cfg["stages"]:
        args = stage.setdefault("args", {})
        args["model"] = str(model)
        if stage["name"] in STAGE_DTYPES:
            args["dtype"] = STAGE_DTYPES[stage["name"]]
        args.update(extra_args.get(stage["name"], {}))
    cfg.setdefault("limits", {}).update(request_timeout=150, stream_stall_timeout=120)
    return cfg


async def ask(pipeline, inputs: dict) -> dict:
    """One streamed request: its result, and when its first text, last text and first audio came (seconds)."""
    t0 = time.perf_counter()
    seen: dict = {"first_text_s": None, "last_text_s": None, "first_audio_s": None, "audio_chunks": 0}
    result = None
    async for event in pipeline.stream(inputs):
        now = time.perf_counter() - t0
        if event.is_result:
            result = event.data
        elif isinstance(event.data, dict):
            if event.data.get("text") is not None:
                seen["first_text_s"] = seen["first_text_s"] or now
                seen["last_text_s"] = now
            if event.data.get("audio") is not None:
                seen["first_audio_s"] = seen["first_audio_s"] or now
                seen["audio_chunks"] += 1
    return {"result": result, "total_s": time.perf_counter() - t0, **seen}


def serve(cfg: dict, requests: list[dict]) -> tuple[list[dict], list[dict]]:
    """Each request alone (the first twice: a warm-up), then all at once, on one pipeline."""
    from omni_core import Pipeline

    async def go():
        async with Pipeline(cfg) as pipeline:
            await ask(pipeline, requests[0])
            alone = [await ask(pipeline, r) for r in requests]
            together = await asyncio.gather(*(ask(pipeline, r) for r in requests))
            return alone, list(together)

    return asyncio.run(asyncio.wait_for(go(), 170))


def thinker_generate(model, ids: list[int], max_new: int, eos: int) -> tuple[list[int], list[float]]:
    """transformers' greedy ``model.thinker.generate`` on the GPU: the reply's tokens and, per step, the gap
    between its best and second-best score as a share of the step's largest |score|."""
    with torch.inference_mode():
        out = model.thinker.generate(input_ids=torch.tensor([ids], device=DEVICE),
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=DEVICE),
                                     eos_token_id=eos, do_sample=False, max_new_tokens=max_new,
                                     return_dict_in_generate=True, output_scores=True)
    margins = []
    for scores in out.scores:
        top = scores[0].float().topk(2).values
        margins.append(float((top[0] - top[1]) / scores[0].float().abs().max().clamp_min(1e-6)))
    return out.sequences[0, len(ids):].tolist(), margins


def agreed(got: list[int], tokens: list[int], margins: list[float], what: str) -> int:
    """How many tokens ``got`` shares with generate's ``tokens`` before they part; they may part only at a step
    where generate's pick was thin (top-2 gap under ``SAFE_MARGIN`` of the step's scale), where bfloat16 may decide
    either way; after it the two replies continue from different tokens, and nothing more is compared."""
    n = next((i for i, (a, b) in enumerate(zip(got, tokens, strict=False)) if a != b), None)
    if n is None:
        assert len(got) == len(tokens), f"{what}: {len(got)} tokens where generate has {len(tokens)}, the same before"
        return len(got)
    assert margins[n] < SAFE_MARGIN, (f"{what}: token {n} is {got[n]} where generate picked {tokens[n]} by a margin of "
                                      f"{margins[n]:.3f} of the logits' scale (bfloat16 decides alike above {SAFE_MARGIN})")
    return n


def check_replies(alone: list[dict], together: list[dict], expected: list[tuple[list[int], list[float]]],
                  samples_per_frame: int | None, record) -> None:
    """Tokens as generate's (alone and at once) until a thin pick parts them; speech streamed, non-empty, finite."""
    covered = together_covered = 0
    for i, (one, many, (tokens, margins)) in enumerate(zip(alone, together, expected, strict=True)):
        covered += agreed(one["result"]["token_ids"], tokens, margins, f"prompt {i} alone")
        together_covered += agreed(many["result"]["token_ids"], tokens, margins, f"prompt {i} among {len(together)} at once")
        for reply in (one, many):
            audio = reply["result"]["audio"]
            assert isinstance(audio, torch.Tensor) and torch.isfinite(audio).all(), f"prompt {i}: audio not finite"
            if samples_per_frame is not None:
                frames = len(reply["result"]["codes"])  # frames of 16 codes
                assert audio.numel() == (frames * samples_per_frame - 555 if frames else 0)
    record("tokens_as_generate", covered)
    record("tokens_as_generate_at_once", together_covered)
    record("tokens", sum(len(r["result"]["token_ids"]) for r in alone))
    assert min(covered, together_covered) >= MIN_AGREED, f"only {covered} / {together_covered} tokens as generate's"
    first = alone[0]
    assert len(first["result"]["token_ids"]) >= 2 and first["result"]["audio"].numel() > 0, "the first reply has no speech"
    assert first["first_audio_s"] is not None and first["audio_chunks"] >= 1, "the audio was not streamed"
    spoken = sum(1 for r in alone if r["result"]["audio"].numel() > 0)
    record("requests_with_speech", spoken)
    assert spoken >= len(alone) // 2, f"only {spoken} of {len(alone)} replies have speech"


def tiny_family_on_gpu(path, model_class, processor, requests: list[dict], pipeline_file: str,
                       samples_per_frame: int | None, record) -> None:
    """transformers' thinker generate for each request (bfloat16, on the GPU; then freed), the requests served by
    the family's GPU pipeline alone and at once, and :func:`check_replies`."""
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(path).eos_token_id
    model = model_class.from_pretrained(path, dtype=torch.bfloat16).to(DEVICE).eval()
    expected = [thinker_generate(model, processor(dict(r), None)["input_ids"], THINKER_MAX, eos) for r in requests]
    del model
    free_gpu()
    alone, together = serve(gpu_pipeline(pipeline_file, path), requests)
    check_replies(alone, together, expected, samples_per_frame, record)
    record("first_audio_s", alone[0]["first_audio_s"])


def free_gpu() -> None:
    """Give the memory of the models this process dropped back to the GPU (the stage processes need it)."""
    gc.collect()
    torch.cuda.empty_cache()


# -- Qwen3-Omni ------------------------------------------------------------------------------------------


def qwen3_requests(processor, prompts: list[str], max_new: int, talker_max: int) -> list[dict]:
    return [{"text": text, "speaker": "chelsie", "max_new_tokens": max_new, "temperature": 0,
             "talker_do_sample": False, "talker_max_new_tokens": talker_max, "wav_path": None} for text in prompts]


@pytest.mark.usefixtures("no_leaks")
def test_qwen3_omni_tiny_in_bfloat16_equals_generate_and_8_at_once_equal_alone(tmp_path, record):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from omni_transformers.qwen3_omni import tiny
    from omni_transformers.qwen3_omni.processor import Processor

    path = tiny.write_tiny_checkpoint(tmp_path / "qwen3_omni")
    processor = Processor(str(path))
    requests = qwen3_requests(processor, PROMPTS, THINKER_MAX, TALKER_MAX)
    tiny_family_on_gpu(path, Qwen3OmniMoeForConditionalGeneration, processor, requests, "qwen3_omni_gpu.yaml", 1920,
                       record)


# The realistic size: the real checkpoint's widths, few layers (what one GPU test can write and load quickly).
REAL_VOCAB = 152064


def realistic_config():
    """Qwen3-Omni-30B-A3B's widths (thinker 2048 wide, 32 heads of 128, 4 KV heads, 128 experts of 768, 8 per
    token, its vocabulary; talker 1024 wide, 128 experts of 384, 6 per token, a shared expert of 768; code
    predictor 5 layers of 1024; code2wav its full size) with 4 thinker layers and 2 talker layers; the audio and
    vision towers stay tiny (the prompts are text), their outputs the thinker's width."""
    from transformers import Qwen3OmniMoeConfig

    from omni_transformers.qwen3_omni import tiny

    d = tiny.tiny_config().to_dict()
    hidden = 2048
    mrope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [24, 20, 20], "interleaved": True,
             "mrope_interleaved": True}
    thinker = d["thinker_config"]
    thinker["text_config"].update(vocab_size=REAL_VOCAB, hidden_size=hidden, intermediate_size=768,
                                  num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                  moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                  rope_parameters=mrope)
    thinker["audio_config"]["output_dim"] = hidden
    thinker["vision_config"]["out_hidden_size"] = hidden
    talker = d["talker_config"]
    talker.update(thinker_hidden_size=hidden, accept_hidden_layer=3)
    talker["text_config"].update(hidden_size=1024, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=16,
                                 num_key_value_heads=2, head_dim=128, moe_intermediate_size=384,
                                 shared_expert_intermediate_size=768, num_local_experts=128, num_experts_per_tok=6,
                                 rope_parameters=mrope)  # the talker's config names its expert count so
    talker["code_predictor_config"].update(hidden_size=1024, intermediate_size=3072, num_hidden_layers=5,
                                           num_attention_heads=16, num_key_value_heads=8, head_dim=128)
    d["code2wav_config"].update(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
                                num_key_value_heads=16, decoder_dim=1536)
    for sub in (thinker["text_config"], talker["text_config"], talker["code_predictor_config"], d["code2wav_config"]):
        sub.pop("layer_types", None)  # derived from the layer count: rebuilt for the new one
    keep = ("thinker_config", "talker_config", "code2wav_config", "enable_audio_output", "im_start_token_id",
            "im_end_token_id", "tts_pad_token_id", "tts_bos_token_id", "tts_eos_token_id", "system_token_id",
            "user_token_id", "assistant_token_id")
    config = Qwen3OmniMoeConfig(**{k: v for k, v in d.items() if k in keep})
    for sub, experts, per_token in ((config.thinker_config.text_config, 128, 8), (config.talker_config.text_config, 128, 6)):
        assert (sub.num_experts, sub.num_experts_per_tok) == (experts, per_token), type(sub).__name__
    return config


@pytest.mark.usefixtures("no_leaks")
def test_qwen3_omni_of_realistic_size_answers_one_spoken_request(room, record):
    from omni_core import Pipeline
    from transformers import AutoTokenizer

    from omni_transformers.qwen3_omni import tiny
    from omni_transformers.qwen3_omni.processor import Processor

    t0 = time.perf_counter()
    model = tiny.random_model(realistic_config(), device=DEVICE, dtype=DTYPE)
    path = tiny.save_checkpoint(model, room / "qwen3_omni_real")
    record("write_s", time.perf_counter() - t0)
    record("parameters", sum(p.numel() for p in model.parameters()))
    record("bytes_on_disk", sum(f.stat().st_size for f in path.iterdir() if f.is_file()))
    assert model.thinker.lm_head.weight.shape[0] == REAL_VOCAB
    processor = Processor(str(path))
    [request] = qwen3_requests(processor, PROMPTS[:1], 32, 64)
    tokens, margins = thinker_generate(model, processor(dict(request), None)["input_ids"], 32,
                                       AutoTokenizer.from_pretrained(path).eos_token_id)
    del model
    free_gpu()

    async def go():
        async with Pipeline(gpu_pipeline("qwen3_omni_gpu.yaml", path)) as pipeline:
            started = time.perf_counter()
            warm = await ask(pipeline, {**request, "max_new_tokens": 4, "talker_max_new_tokens": 8})
            return warm, time.perf_counter() - started, await ask(pipeline, request)

    warm, warm_s, reply = asyncio.run(asyncio.wait_for(go(), 150))
    result = reply["result"]
    got, frames = result["token_ids"], len(result["codes"])
    record("warm_up_s", warm_s)
    for key in ("first_text_s", "first_audio_s", "total_s"):
        record(key, reply[key])
    record("text_tokens", len(got))
    record("text_tokens_per_s", len(got) / reply["last_text_s"])  # the thinker's pace, to its last token
    record("frames", frames)
    record("frames_per_s", frames / reply["total_s"])  # 12.5 frames are a second of speech
    record("tokens_as_generate", agreed(got, tokens, margins, "the realistic-size reply"))
    assert warm["result"]["token_ids"], "the warm-up request got no tokens"
    assert len(got) >= 2 and frames > 0, f"no speech: {len(got)} tokens, {frames} frames"
    audio = result["audio"]
    assert audio.numel() == frames * 1920 - 555 and torch.isfinite(audio).all()
    assert reply["first_audio_s"] is not None and reply["audio_chunks"] >= 1, "the audio was not streamed"


# -- Qwen2.5-Omni ----------------------------------------------------------------------------------------


@pytest.mark.usefixtures("no_leaks")
def test_qwen2_5_omni_tiny_in_bfloat16_equals_generate_and_8_at_once_equal_alone(tmp_path, record):
    from transformers import Qwen2_5OmniForConditionalGeneration

    from omni_transformers.qwen2_5_omni.processor import Processor
    from omni_transformers.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "qwen2_5_omni")
    processor = Processor(str(path))
    requests = [{"text": text, "speaker": "Chelsie", "max_new_tokens": THINKER_MAX, "temperature": 0,
                 "talker_max_new_tokens": TALKER_MAX, "wav_path": None} for text in PROMPTS]
    tiny_family_on_gpu(path, Qwen2_5OmniForConditionalGeneration, processor, requests, "qwen2_5_omni_gpu.yaml", None,
                       record)
